"""A value computed, without grad, from a value that requires grad (a comparison, an
argmax of an input) does not require grad when handed out, as eagerly, also where a
later call of the same compute gathered it in one pool with that input.

A gather takes many rows at once, so a row without grad gathered with one that has it
requires grad inside the batch; ``Executor._detach_borrowed_grad`` asks then whether
the row's node requires grad eagerly, before the compute has stored any value. That
answer (the comparison counted as requiring grad, through its input) must not become
the node's answer for good: the value handed out afterwards required grad, with a
``grad_fn``, where eagerly it has neither (found by the DAG programs fuzzer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import batchgraph as bg

_PLAIN = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64)

# A value without grad made from an input that requires grad (then shifted by a plain
# tensor, so that it is a float row of the input's spec: both travel in one pool).
_NO_GRAD_FROM_INPUT: dict[str, Callable[[Any], Any]] = {
    "comparison": lambda x: (x == 1) + _PLAIN,
    "argmax": lambda x: x.argmax() + _PLAIN,
    "detach": lambda x: x.detach() * 2,
    "sign": lambda x: torch.sign(x) * _PLAIN,
}

# Later calls on it, recorded in this order: the first gathers it alone, the second
# in one gather with the input itself (the order that went wrong).
_LATER: list[Callable[[Any], Any]] = [lambda a: a * 2, lambda a: a @ _PLAIN, lambda a: a.sum()]


def _program(x: Any, made: Callable[[Any], Any]) -> list[Any]:
    a = made(x)
    return [a, *(f(a) for f in _LATER), x * 3]


@pytest.mark.parametrize("made", sorted(_NO_GRAD_FROM_INPUT))
@pytest.mark.parametrize("examples", [1, 3])
def test_values_without_grad_from_an_input_with_grad_are_handed_out_without_grad(
    made: str, examples: int
) -> None:
    xs = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(examples)]
    eager = [_program(x, _NO_GRAD_FROM_INPUT[made]) for x in xs]
    with bg.BatchingPolicy():
        handles = [_program(bg.batched_value(x), _NO_GRAD_FROM_INPUT[made]) for x in xs]
    got = bg.compute(handles)
    for want, values in zip(eager, got):
        assert [v.requires_grad for v in values] == [w.requires_grad for w in want]
        assert [v.grad_fn is None for v in values] == [w.grad_fn is None for w in want]
        for w, v in zip(want, values):
            torch.testing.assert_close(v, w, rtol=0, atol=0)
    # The value that does require grad still gives the eager gradient.
    torch.stack([vs[-1].sum() for vs in got]).sum().backward()
    for x in xs:
        torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_a_second_compute_reads_the_stored_answer_not_the_running_one() -> None:
    # The answer given while the first compute ran is dropped once it has stored its
    # values: a call recorded on the comparison later, in another compute, hands out
    # a value without grad too.
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with bg.BatchingPolicy():
        a = (bg.batched_value(x) == 1) + _PLAIN
        first = bg.compute([a * 2, a @ _PLAIN, bg.batched_value(x) * 3])
        second = bg.compute(a.sum() * 2)
    assert [v.requires_grad for v in first] == [False, False, True]
    assert not second.requires_grad
