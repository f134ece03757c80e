"""Random DAG programs over values of mixed dtypes give the eager values and gradients.

Each example runs a program from ``dag_programs`` (most share one, some have their
own) on three inputs of its own shapes and dtypes, so that some calls batch and some
do not. Every value is compared with the eager run (shape, dtype, values, and whether
it requires grad), and so are the gradients of a weighted sum of all the floating
values with respect to the inputs and a module's parameters. Data-dependent values
(and some others) are computed as they are made, inside the open policy, so later steps
read them in a later compute; the same programs also run as coroutine examples
(``bg.run_all``), reading those values with ``await bg.value(h)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.dag_programs import (
    LINEAR,
    OPS,
    Step,
    run_awaiting,
    run_eagerly,
    run_recorded,
)

_SHAPES = [(3, 4), (2, 4), (4,), (), (3,), (0,)]
# The first input requires grad (mostly float64, where the checks are exact).
_FIRST_DTYPES = [torch.float64, torch.float64, torch.float64, torch.float32, torch.complex128]
_OTHER_DTYPES = [torch.float64, torch.float32, torch.complex128, torch.int64, torch.bool]

steps = st.tuples(st.sampled_from(sorted(OPS)), st.integers(0, 63), st.integers(0, 63),
                  st.integers(0, 63))
programs = st.lists(steps, min_size=1, max_size=8)
examples = st.lists(
    st.tuples(st.sampled_from(_FIRST_DTYPES), st.sampled_from(_SHAPES), st.sampled_from(_SHAPES),
              st.sampled_from(_OTHER_DTYPES), st.integers(1, 3), st.none() | programs),
    min_size=1, max_size=4,
)
Example = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], torch.dtype, int, Any]


# vmap's per-example fallback (clamp_ on a copy, say) warns on the CPU, and so does
# copying complex values into a real tensor (eagerly too).
pytestmark = [pytest.mark.filterwarnings("ignore:There is a performance drop"),
              pytest.mark.filterwarnings("ignore:Casting complex values to real")]


def _inputs(spec: list[Example], seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    made = []
    for first, shape, other_shape, dtype, count, _ in spec:
        x = torch.randn(shape, generator=gen, dtype=first).requires_grad_()
        y = torch.randn(other_shape, generator=gen, dtype=torch.float64) * 3
        y = y > 0 if dtype == torch.bool else y.to(dtype)
        if y.is_floating_point() or y.is_complex():
            y.requires_grad_()
        made.append([x, y, torch.randint(-3, 5, (count,), generator=gen)])
    return made


def _copies(inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[t.detach().clone().requires_grad_(t.requires_grad) for t in xs] for xs in inputs]


_SINGLE = (torch.float32, torch.complex64)


def _tolerance(before: list[torch.Tensor]) -> dict[str, float]:
    """Exact up to float64 rounding, unless a float32 value came first (``before``
    holds it): batched float32 reductions and products round in another order, and
    their results reach the float64 values made from them."""
    if any(v.dtype in _SINGLE for v in before):
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-9, "atol": 1e-10}


def _loss(values: list[list[Any]], seed: int) -> Any:
    """A weighted sum of every floating value that requires grad (its real part, in
    float64)."""
    gen = torch.Generator().manual_seed(seed)
    total: Any = 0
    for vs in values:
        for v in vs:
            if v.requires_grad and (v.is_floating_point() or v.is_complex()):
                weight = torch.randn(v.shape, generator=gen, dtype=torch.float64)
                total = total + (v.real if v.is_complex() else v).double().mul(weight).sum()
    return total


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    grads = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def _check(spec: list[Example], shared: list[Step], seed: int,
           batched: Callable[[list[Step], list[list[torch.Tensor]], list[set[int]]], list[list[Any]]],
           ) -> None:
    """Run the examples eagerly and through ``batched(programs, inputs, left_out)``;
    compare values, whether they require grad, and gradients."""
    inputs = _inputs(spec, seed)
    program_of = [own or shared for *_, own in spec]
    eager_inputs, inputs_b = _copies(inputs), _copies(inputs)
    params = list(LINEAR.parameters())
    _grads(params)
    eager, left_out = [], []
    for program, xs in zip(program_of, eager_inputs):
        values, failed = run_eagerly(program, xs)
        eager.append(values)
        left_out.append(failed)
    got = batched(program_of, inputs_b, left_out)

    for i, (want, values) in enumerate(zip(eager, got)):
        assert len(values) == len(want), f"example {i}"
        for j, (w, g) in enumerate(zip(want, values)):
            where = f"example {i}, value {j} (program {program_of[i]}, left out {left_out[i]})"
            assert type(g) is torch.Tensor, where
            assert (g.shape, g.dtype) == (w.shape, w.dtype), where
            torch.testing.assert_close(g.detach(), w.detach(), equal_nan=True, msg=where,
                                       **_tolerance(want[: j + 1]))
            assert g.requires_grad == w.requires_grad, where

    eager_loss = _loss(eager, seed)
    if not isinstance(eager_loss, torch.Tensor):
        return
    try:
        eager_loss.backward()
    except RuntimeError:  # an in-place change of a value autograd saved: eagerly an error
        return
    tensors = [*(t for xs in eager_inputs for t in xs), *params]
    eager_grads = _grads(tensors)
    _loss(got, seed).backward()
    got_grads = _grads([*(t for xs in inputs_b for t in xs), *params])
    single = any(v.dtype in _SINGLE for vs in eager for v in vs)
    for k, (w, g) in enumerate(zip(eager_grads, got_grads)):
        assert (w is None) == (g is None), f"gradient {k}"
        if w is not None and g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4 if single else 1e-6,
                                       atol=1e-4 if single else 1e-7, equal_nan=True,
                                       msg=f"gradient {k}")


@settings(max_examples=3 * settings.default.max_examples)
@given(shared=programs, spec=examples, dedupe=st.booleans(), seed=st.integers(0, 2**16))
def test_dag_programs_of_mixed_dtypes_batched_equal_eager(
    shared: list[Step], spec: list[Example], dedupe: bool, seed: int
) -> None:
    def batched(program_of: list[list[Step]], inputs: list[list[torch.Tensor]],
                left_out: list[set[int]]) -> list[list[Any]]:
        with bg.BatchingPolicy(dedupe=dedupe):
            handles = [run_recorded(program, [bg.batched_value(t) for t in xs], failed)
                       for program, xs, failed in zip(program_of, inputs, left_out)]
            return bg.compute(handles)  # type: ignore[no-any-return]

    _check(spec, shared, seed, batched)


@given(shared=programs, spec=examples, groups=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_dag_programs_as_coroutines_equal_eager(
    shared: list[Step], spec: list[Example], groups: int, seed: int
) -> None:
    # The same programs as coroutine examples (bg.run_all), reading the values they
    # compute as they go with `await bg.value(h)`.
    def batched(program_of: list[list[Step]], inputs: list[list[torch.Tensor]],
                left_out: list[set[int]]) -> list[list[Any]]:
        return bg.run_all(  # type: ignore[no-any-return]
            [run_awaiting(program, xs, failed)
             for program, xs, failed in zip(program_of, inputs, left_out)],
            groups=groups,
        )

    _check(spec, shared, seed, batched)
