"""A per-example 0-d tensor meets tensors with dimensions: eager dtypes and values.

Stacked, a 0-d input has a dimension, so ``ElementwiseKey`` casts it first to the
dtype the eager call computes in. For a true division of integers that dtype is a
float one, where the 0-d input was cast to the other input's integer dtype and lost
its value: ``pixels / torch.tensor(256)`` of uint8 pixels divided by 0 (inf), and a
uint8 tensor divided by an int8 -3 divided by 253. Under ``torch.func.vmap``
(``VmapKey``: a function of the user's, ``torch.atan2``) torch itself casts so: a
batch holding a 0-d value out of the other inputs' range runs one call at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg

_INTS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_DIVISIONS: dict[str, Callable[[Any, Any], Any]] = {
    "/": lambda a, b: a / b,
    "torch.div": torch.div,
    "torch.true_divide": torch.true_divide,
    "Tensor.div": lambda a, b: a.div(b),
    "floor": lambda a, b: torch.div(a, b, rounding_mode="floor"),
    "trunc": lambda a, b: a.div(b, rounding_mode="trunc"),
}


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, values: list[int]) -> torch.Tensor:
    t = torch.tensor(values[: max(1, len(values))] * 6)[: torch.Size(shape).numel()]
    if dtype is torch.bool:
        return (t % 2 == 1).view(shape)
    return t.to(torch.int64).view(shape).to(dtype)


@given(
    op=st.sampled_from(sorted(_DIVISIONS)),
    dtypes=st.tuples(st.sampled_from(_INTS), st.sampled_from(_INTS)),
    shape=st.sampled_from([(3,), (2, 3)]),
    zero_dim_first=st.booleans(),
    values=st.lists(st.integers(-300, 2**33), min_size=6, max_size=6),
    divisors=st.lists(st.integers(-300, 2**33).filter(bool), min_size=2, max_size=2),
)
def test_integer_division_by_a_0d_tensor_is_eager(
    op: str, dtypes: tuple[torch.dtype, torch.dtype], shape: tuple[int, ...],
    zero_dim_first: bool, values: list[int], divisors: list[int],
) -> None:
    fn = _DIVISIONS[op]
    ranked_dtype, scalar_dtype = dtypes
    pairs = [(_tensor(shape, ranked_dtype, values), _tensor((), scalar_dtype, [d]))
             for d in divisors]

    def divide(x: Any, c: Any) -> Any:
        return fn(c, x) if zero_dim_first else fn(x, c)

    try:
        eager = [divide(x, c) for x, c in pairs]
    except RuntimeError:  # integer division by zero, bool division: not recorded either
        return
    _assert_batched_is_eager(divide, pairs, eager)


def _assert_batched_is_eager(fn: Callable[[Any, Any], Any],
                             pairs: list[tuple[torch.Tensor, torch.Tensor]],
                             eager: list[torch.Tensor]) -> None:
    """``fn`` recorded on each pair gives ``eager``: dtypes, and values bit for bit."""
    with bg.BatchingPolicy():
        handles = [fn(bg.batched_value(x), bg.batched_value(c)) for x, c in pairs]
    for want, got in zip(eager, bg.compute(handles), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_uint8_pixels_divided_by_a_plain_0d_tensor() -> None:
    pixels = [torch.tensor([10, 200, 255], dtype=torch.uint8),
              torch.tensor([0, 128, 64], dtype=torch.uint8)]
    with bg.BatchingPolicy():
        handles = [bg.batched_value(p) / torch.tensor(256) for p in pixels]
    for p, got in zip(pixels, bg.compute(handles), strict=True):
        torch.testing.assert_close(got, p / torch.tensor(256), rtol=0, atol=0)
        assert bool(got.isfinite().all())


def _user_division(x: Any, n: Any) -> Any:
    return (x / n) * 2  # a function of the user's: batched through vmap


_VMAPPED: dict[str, Callable[[Any, Any], Any]] = {
    "user function": bg.batched_func(_user_division),
    "torch.atan2": torch.atan2,
    "user add (wraps eagerly too)": bg.batched_func(lambda x, n: x + n * 3),
}


@given(
    op=st.sampled_from(sorted(_VMAPPED)),
    dtypes=st.tuples(st.sampled_from(_INTS[1:]), st.sampled_from(_INTS[1:])),
    values=st.lists(st.integers(-300, 300), min_size=6, max_size=6),
    scalars=st.lists(st.integers(-2**20, 2**20).filter(bool), min_size=3, max_size=3),
)
def test_vmapped_calls_with_a_0d_integer_input_are_eager(
    op: str, dtypes: tuple[torch.dtype, torch.dtype], values: list[int], scalars: list[int],
) -> None:
    fn = _VMAPPED[op]
    ranked_dtype, scalar_dtype = dtypes
    pairs = [(_tensor((2, 3), ranked_dtype, values), _tensor((), scalar_dtype, [n]))
             for n in scalars]
    _assert_batched_is_eager(fn, pairs, [fn(x, n) for x, n in pairs])



_EXACT_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64,
                 torch.float32, torch.float64]
_THREE_OPERANDS: dict[str, Callable[[Any, Any, Any], Any]] = {
    "clamp": lambda a, b, c: torch.clamp(a, min=b, max=c),
    "where": lambda a, b, c: torch.where(c > 0, a, b),
    "maximum, minimum": lambda a, b, c: torch.minimum(torch.maximum(a, b), c),
    "add with alpha": lambda a, b, c: torch.add(a, b, alpha=2) * c,
    "sub, then a float": lambda a, b, c: (a - b) * c + 0.5,
}


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(shape, generator=gen) * 200
    if dtype is torch.bool:
        return x > 0
    return x if dtype.is_floating_point else x.round().to(torch.int64).to(dtype)


@given(
    op=st.sampled_from(sorted(_THREE_OPERANDS)),
    dtypes=st.tuples(*[st.sampled_from(_EXACT_DTYPES)] * 3),
    shapes=st.sampled_from([((), (3,), ()), ((3,), (), ()), ((2, 3), (), (3,)), ((), (), (2, 3))]),
    seed=st.integers(0, 2**16),
)
def test_0d_inputs_among_several_kinds_promote_as_eagerly(
    op: str, dtypes: tuple[torch.dtype, ...], shapes: tuple[tuple[int, ...], ...], seed: int,
) -> None:
    # One 0-d input of a kind above the tensors with dimensions lifts the computation
    # dtype for the other 0-d inputs too (clamp of uint8 with a float64 min and an
    # int8 max -6 computes in float64: cast to uint8 the max read 250).
    fn = _THREE_OPERANDS[op]
    gen = torch.Generator().manual_seed(seed)
    examples = [[_values(s, d, gen).to(d) for s, d in zip(shapes, dtypes, strict=True)]
                for _ in range(2)]
    try:
        eager = [fn(*xs) for xs in examples]
    except RuntimeError:  # kinds the op refuses (a bool subtracted): refused recorded too
        return
    with bg.BatchingPolicy():
        handles = [fn(*map(bg.batched_value, xs)) for xs in examples]
    for want, got in zip(eager, bg.compute(handles), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_clamp_of_uint8_by_a_float64_min_and_an_int8_max_is_eager() -> None:
    xs = [torch.tensor([3, 200, 7], dtype=torch.uint8), torch.tensor([0, 1, 255], dtype=torch.uint8)]
    low = torch.tensor(-100.5, dtype=torch.float64)
    highs = [torch.tensor(-6, dtype=torch.int8), torch.tensor(100, dtype=torch.int8)]
    with bg.BatchingPolicy():
        handles = [torch.clamp(bg.batched_value(x), min=low, max=bg.batched_value(h))
                   for x, h in zip(xs, highs)]
    for x, h, got in zip(xs, highs, bg.compute(handles), strict=True):
        want = torch.clamp(x, min=low, max=h)  # in float64: -6 is -6.0
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_0d_complex_input_with_half_tensors_computes_in_complex_half() -> None:
    xs = [torch.randn(3).half() for _ in range(2)]
    cs = [torch.tensor(1.5 + 0.5j), torch.tensor(-2.0 + 1j)]
    with bg.BatchingPolicy():
        handles = [bg.batched_value(x) * bg.batched_value(c) for x, c in zip(xs, cs)]
    for x, c, got in zip(xs, cs, bg.compute(handles), strict=True):
        want = x * c
        assert got.dtype == want.dtype == torch.complex32
        torch.testing.assert_close(got.to(torch.complex64), want.to(torch.complex64))
