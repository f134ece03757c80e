"""Random tensor programs give the same values and gradients batched as eagerly.

Each example runs a program from ``tensor_programs`` (most share one program, some
have their own) on an input of its own shape (some inputs repeat another's values, so
identical calls merge). Every value the program makes is compared with the eager run
(shape, dtype and values), and so are the gradients of a weighted sum of all of them
with respect to the inputs and the modules' parameters.

This is the test that catches a batching rule that reads a per-example argument in
the batched sense: a softmax over ``dim=-1`` of 0-d values taken across the batch, an
index by a tensor taken for a static int.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.decoder_models import run_eagerly
from tests.property.tensor_programs import (
    SHAPES,
    Modules,
    catalog,
    run_program,
    run_program_awaiting,
)

_MODULES = Modules().double()
_OPS = catalog(_MODULES)

steps = st.tuples(st.sampled_from(sorted(_OPS)), st.integers(0, 64), st.integers(0, 64),
                  st.integers(0, 64))
programs = st.lists(steps, min_size=1, max_size=8)
examples = st.lists(
    st.tuples(st.sampled_from(SHAPES), st.none() | programs, st.integers(0, 8), st.booleans()),
    min_size=1, max_size=5,
)


def _inputs(spec: list[tuple[tuple[int, ...], Any, int, bool]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xs: list[torch.Tensor] = []
    for shape, _, other, repeat in spec:
        if repeat and xs:  # the same values as an earlier input: its calls merge
            xs.append(xs[other % len(xs)].detach().clone())
        else:
            xs.append(torch.randn(shape, generator=gen, dtype=torch.float64))
    return [x.requires_grad_() for x in xs]


def _weighted_sum(values: list[Any], weights: list[torch.Tensor | None]) -> Any:
    total: Any = 0
    for v, w in zip(values, weights):
        if w is not None:
            total = total + (v * w).sum()
    return total


def _grads(xs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    tensors = [*xs, *_MODULES.parameters()]
    grads = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


def _check(
    xs: list[torch.Tensor], eager: list[list[Any]], batched: Callable[[], list[list[Any]]],
    programs_of: list[Any], seed: int,
) -> None:
    """Compare ``batched()``'s values, and the gradients of a weighted sum of them,
    with ``eager``'s (the eager values' gradients are taken first)."""
    gen = torch.Generator().manual_seed(seed + 1)
    weights = [[torch.randn(v.shape, generator=gen, dtype=torch.float64)
                if v.is_floating_point() else None for v in vs] for vs in eager]
    loss = sum(_weighted_sum(vs, ws) for vs, ws in zip(eager, weights))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    eager_grads = _grads(xs)

    values = batched()
    assert len(values) == len(eager)
    for i, (want, got) in enumerate(zip(eager, values)):
        assert len(want) == len(got)
        for j, (w, g) in enumerate(zip(want, got)):
            where = f"example {i}, value {j} (after {programs_of[i][:j]})"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), where
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, equal_nan=True, msg=where)
    loss = sum(_weighted_sum(vs, ws) for vs, ws in zip(values, weights))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()
    for k, (w, g) in enumerate(zip(eager_grads, _grads(xs))):
        assert (w is None) == (g is None), f"gradient {k}: {w} vs {g}"
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9, equal_nan=True,
                                       msg=f"gradient {k}")


# The catalog's attention runs through vmap's per-example fallback on the CPU, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


@settings(max_examples=4 * settings.default.max_examples)  # cheap: 4x the profile
@given(shared=programs, spec=examples, dedupe=st.booleans(), seed=st.integers(0, 2**16))
def test_tensor_programs_batched_equal_eager(
    shared: list[tuple[str, int, int, int]],
    spec: list[tuple[tuple[int, ...], Any, int, bool]],
    dedupe: bool,
    seed: int,
) -> None:
    xs = _inputs(spec, seed)
    program_of = [own or shared for _, own, _, _ in spec]
    _grads(xs)  # start from no gradients
    eager = [run_program(_OPS, x, p) for x, p in zip(xs, program_of)]

    def batched() -> list[list[Any]]:
        with bg.BatchingPolicy(dedupe=dedupe):
            handles = [run_program(_OPS, bg.batched_value(x), p) for x, p in zip(xs, program_of)]
            return bg.compute(handles)  # type: ignore[no-any-return]

    _check(xs, eager, batched, program_of, seed)


@settings(max_examples=2 * settings.default.max_examples)
@given(shared=programs, spec=examples, awaits=st.lists(st.booleans(), min_size=1, max_size=4),
       groups=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_tensor_programs_reading_values_as_coroutines_equal_eager(
    shared: list[tuple[str, int, int, int]],
    spec: list[tuple[tuple[int, ...], Any, int, bool]],
    awaits: list[bool],
    groups: int,
    seed: int,
) -> None:
    xs = _inputs(spec, seed)
    program_of = [own or shared for _, own, _, _ in spec]
    _grads(xs)
    eager = [run_eagerly(run_program_awaiting(_OPS, x, p, awaits))
             for x, p in zip(xs, program_of)]

    def batched() -> list[list[Any]]:
        return bg.run_all(  # type: ignore[no-any-return]
            [run_program_awaiting(_OPS, x, p, awaits)
             for x, p in zip(xs, program_of)],
            groups=groups,
        )

    _check(xs, eager, batched, program_of, seed)


# Float32 copies of the modules, for autocast (which leaves float64 alone).
_MODULES32 = Modules()
_OPS32 = catalog(_MODULES32)


def _run_in_and_out_of_autocast(x: Any, program: list[tuple[str, int, int, int]],
                                inside: list[bool]) -> list[Any]:
    """``run_program``, each step inside ``torch.autocast`` (CPU, bfloat16) or not."""
    values = [x]
    for k, (name, pick_a, pick_b, c) in enumerate(program):
        applies, op = _OPS32[name]
        a = values[pick_a % len(values)]
        if applies(a):
            region = (torch.autocast("cpu", dtype=torch.bfloat16) if inside[k % len(inside)]
                      else contextlib.nullcontext())
            with region:
                values.append(op(a, values[pick_b % len(values)], c))
    return values


@given(shared=programs, spec=examples, inside=st.lists(st.booleans(), min_size=1, max_size=3),
       seed=st.integers(0, 2**16))
def test_tensor_programs_in_and_out_of_autocast_keep_eager_dtypes(
    shared: list[tuple[str, int, int, int]],
    spec: list[tuple[tuple[int, ...], Any, int, bool]],
    inside: list[bool],
    seed: int,
) -> None:
    # Values computed in bfloat16 differ in their last bits between a batch and one
    # example, so this compares what must match exactly: every value is a real tensor
    # of the eager shape and dtype (the spec recorded in its autocast state).
    xs = [x.detach().float() for x in _inputs(spec, seed)]
    program_of = [own or shared for _, own, _, _ in spec]
    with torch.no_grad():
        try:
            eager = [_run_in_and_out_of_autocast(x, p, inside) for x, p in zip(xs, program_of)]
        except RuntimeError:  # a program autocast makes invalid eagerly (dtype clashes)
            return
        with bg.BatchingPolicy():
            handles = [_run_in_and_out_of_autocast(bg.batched_value(x), p, inside)
                       for x, p in zip(xs, program_of)]
        got = bg.compute(handles)
    assert len(got) == len(eager)
    for i, (want, values) in enumerate(zip(eager, got)):
        assert len(values) == len(want), f"example {i}"
        for j, (w, g) in enumerate(zip(want, values)):
            assert type(g) is torch.Tensor, f"example {i}, value {j}: {type(g).__name__}"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"example {i}, value {j}"
