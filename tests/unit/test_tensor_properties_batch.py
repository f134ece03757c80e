"""``h.T``, ``h.mT``, ``h.H``, ``h.mH``, ``h.real`` and ``h.imag`` of handles batch.

Before: a handle's property was recorded as a call of batchgraph's own getter, a
function torch's rules do not know, so its calls ran one example at a time (``q @
k.T`` over 4 examples: 4 launches for the transpose, ``stats.unbatched_callables``
naming ``_TensorProperty.T``). Now each is recorded as torch's own call saying the
same (``Tensor.t``, ``Tensor.transpose(-2, -1)``, ``Tensor.adjoint``, ``torch.real``),
which batches; the values, gradients and in-place changes through them are eager's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from tests.unit.test_in_place_on_copy import _compare

READS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "T": lambda t: t.T, "mT": lambda t: t.mT, "H": lambda t: t.H, "mH": lambda t: t.mH,
    "real": lambda t: t.real, "imag": lambda t: t.imag}


def _fits(name: str, ndim: int, complex_: bool) -> bool:
    return {"T": ndim <= 2, "mT": ndim >= 2, "mH": ndim >= 2, "H": ndim == 2,
            "real": True, "imag": complex_}[name]


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(READS)), ndim=st.integers(0, 3), complex_=st.booleans(),
       count=st.integers(1, 4), seed=st.integers(0, 99))
def test_a_property_of_handles_batches_with_eager_values_and_gradients(
        name: str, ndim: int, complex_: bool, count: int, seed: int) -> None:
    if not _fits(name, ndim, complex_):
        return
    torch.manual_seed(seed)
    dtype = torch.complex128 if complex_ else torch.float64
    shape = (2, 3, 4)[:ndim]
    xs = [torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(count)]
    read = READS[name]

    def f(x: torch.Tensor) -> torch.Tensor:
        return (read(x * 2) * 3).abs().sum(0) if ndim else (read(x * 2) * 3).abs()

    _compare(f, xs, xs)  # values and gradients as eagerly
    with bg.BatchingPolicy() as policy:
        bg.compute([f(bg.batched_value(x)) for x in xs])
    assert policy.stats is not None and policy.stats.unbatched_callables == ()
    assert policy.stats.launches <= 5  # mul, the property, mul, abs, sum: once each


def test_a_change_through_the_transpose_of_a_handle_is_refused_as_before() -> None:
    # a view's change reaching the value cannot be recorded: refused, as t()'s is
    with bg.BatchingPolicy():
        y = bg.batched_value(torch.randn(2, 3)) * 1
        with pytest.raises(TypeError, match="would change in place a view of another value"):
            y.T.add_(torch.arange(2.0))


def test_t_of_a_3d_handle_warns_and_reverses_its_dims_as_eagerly() -> None:
    x = torch.randn(2, 3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        want = x.T
        with bg.BatchingPolicy():
            handle = bg.batched_value(x).T
        torch.testing.assert_close(bg.compute(handle), want)
