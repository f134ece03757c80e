"""A differential fuzzer: random per-example programs over ``wide_ops`` (operations with
drawn arguments, two-value operands, modules) run eagerly and batched, several examples
of different sizes at once, and give the same values and gradients (float64).

A program may read a value mid-way (``bg.compute`` inside the open policy, or
``await bg.value`` in a coroutine example run by ``bg.run_all``) and go on recording on
the tensor handed out, and may branch on a value it read (which op runs next depends
on the sign of a sum). A step that raises eagerly is skipped in the eager run; batched
it must raise too, where it is recorded or at compute, never give a value.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.decoder_models import run_eagerly
from tests.property.test_tensor_ops_property import _MODULES, _check, _grads, _inputs
from tests.property.wide_ops import OPS, Op, module_ops

_OPS: dict[str, Op] = {**OPS, **module_ops(_MODULES)}
_NAMES = sorted(_OPS)
# Eager errors a drawn step may meet (shapes that do not broadcast or fit).
_EAGER_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)

Step = tuple[str, int, int, int]
Read = Callable[[Any], Awaitable[Any]]

SHAPES = [(), (3,), (4,), (1, 4), (2, 4), (4, 3), (2, 3, 4), (3, 1, 2), (0, 4)]
steps = st.tuples(st.sampled_from([*_NAMES, "read", "branch"]), st.integers(0, 64),
                  st.integers(0, 64), st.integers(0, 2**16))
programs = st.lists(steps, min_size=1, max_size=8)
examples = st.lists(
    st.tuples(st.sampled_from(SHAPES), st.none() | programs, st.integers(0, 8), st.booleans()),
    min_size=1, max_size=5,
)


class Run:
    """What one example's run of a program made: its values, the steps that raised
    (eagerly), and the values of steps expected to raise that did not (recorded)."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.failed: set[int] = set()
        self.unraised: list[Any] = []


async def run_program(x: Any, program: list[Step], read: Read,
                      must_fail: set[int] | None = None) -> Run:
    """Run ``program`` from ``x``: each step applies its op to values picked from those
    made so far; ``read`` reads a value (``await`` of an identity, ``bg.compute``, or
    ``bg.value``). ``must_fail`` (recorded runs): the steps that raised eagerly."""
    run = Run()
    run.values.append(x)
    for k, (name, pick_a, pick_b, c) in enumerate(program):
        a = run.values[pick_a % len(run.values)]
        b = run.values[pick_b % len(run.values)]
        if name == "read":
            run.values.append(await read(a))
            continue
        if name == "branch":  # which op runs depends on a value read
            total = await read(a.sum())
            name = _NAMES[c % len(_NAMES)] if float(total.detach()) > 0 else _NAMES[c // 7 % len(_NAMES)]
        try:
            value = _OPS[name](a, b, c)
        except Exception as error:
            if must_fail is None and isinstance(error, _EAGER_ERRORS):
                run.failed.add(k)
                continue
            if must_fail is None or k not in must_fail:
                raise  # batched raised where eagerly the step ran
            continue
        if must_fail is not None and k in must_fail:
            run.unraised.append(value)  # computing it must raise
        elif value is not None:
            # A data-dependent shape (a[a > 0]) is known once read, as in user code.
            run.values.append(await read(value) if _shape_unknown(value) else value)
    return run


def _shape_unknown(value: Any) -> bool:
    try:
        value.shape  # noqa: B018 (a handle of a data-dependent shape raises)
    except TypeError:
        return True
    return False


async def _identity(x: Any) -> Any:
    return x


async def _compute(x: Any) -> Any:
    return bg.compute(x)


Spec = list[tuple[tuple[int, ...], Any, int, bool]]


def _eager(shared: list[Step], spec: Spec, seed: int,
           ) -> tuple[list[torch.Tensor], list[list[Step]], list[Run]]:
    """The examples' inputs and programs, and their eager runs (gradients cleared)."""
    xs = _inputs(spec, seed)
    program_of = [own or shared for _, own, _, _ in spec]
    _grads(xs)
    return xs, program_of, [run_eagerly(run_program(x, p, _identity)) for x, p in zip(xs, program_of)]


# vmap's per-example fallback warns on the CPU.
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


@given(shared=programs, spec=examples, dedupe=st.booleans(), seed=st.integers(0, 2**16))
def test_wide_programs_batched_equal_eager(
    shared: list[Step], spec: Spec, dedupe: bool, seed: int
) -> None:
    xs, program_of, eager = _eager(shared, spec, seed)

    def batched() -> list[list[Any]]:
        with bg.BatchingPolicy(dedupe=dedupe):
            runs = [run_eagerly(run_program(bg.batched_value(x), p, _compute, e.failed))
                    for x, p, e in zip(xs, program_of, eager)]
            values = bg.compute([r.values for r in runs])
            for r in runs:
                for h in r.unraised:
                    with pytest.raises(Exception):  # noqa: B017 (eagerly: any error)
                        bg.compute(h)
            return values  # type: ignore[no-any-return]

    _check(xs, [e.values for e in eager], batched, program_of, seed)


@given(shared=programs, spec=examples, groups=st.integers(1, 2),
       overlap=st.sampled_from(["inline", "thread", "parallel"]), seed=st.integers(0, 2**16))
def test_wide_programs_as_coroutines_equal_eager(
    shared: list[Step], spec: Spec, groups: int, overlap: str, seed: int
) -> None:
    # Each way lanes take turns ("auto" picks one by timings, which load moves).
    xs, program_of, eager = _eager(shared, spec, seed)

    async def example(x: torch.Tensor, program: list[Step], failed: set[int]) -> list[Any]:
        run = await run_program(bg.batched_value(x), program, bg.value, failed)
        assert not run.unraised, "a step that raised eagerly gave a value batched"
        return run.values

    def batched() -> list[list[Any]]:
        return bg.run_all(
            [example(x, p, e.failed) for x, p, e in zip(xs, program_of, eager)],
            groups=groups, overlap=overlap)

    _check(xs, [e.values for e in eager], batched, program_of, seed)
