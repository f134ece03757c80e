"""Per-example code that differentiates: inside a recorded function, as eagerly.

A function computing forces as the gradient of an energy with respect to its input
(``-torch.autograd.grad(energy, pos, create_graph=True)[0]``) runs eagerly on an
input that requires grad. Its shape was inferred on fake tensors that do not, and
recording failed with a ``ShapeMismatchError`` telling the user to check shapes that
were right. ``torch.autograd.grad`` called on handles themselves cannot be recorded
(the graph between them is built only when their batch runs): it is refused, saying
what to write instead, where it failed as a shape error too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchgraph as bg

_WEIGHT = torch.randn(3, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)


def _forces(pos: torch.Tensor) -> torch.Tensor:
    energy = torch.tanh(pos @ _WEIGHT).pow(2).sum()
    (grad,) = torch.autograd.grad(energy, pos, create_graph=True)
    return -grad


@pytest.mark.parametrize("atoms", [[4, 4, 4], [4, 5, 2]])
def test_a_function_differentiating_its_input_matches_eager(atoms: list[int]) -> None:
    torch.manual_seed(0)
    positions = [torch.randn(n, 3, requires_grad=True) for n in atoms]
    forces = bg.batched_func(_forces)
    with bg.BatchingPolicy():
        handles = [forces(bg.batched_value(p) * 1.5) for p in positions]
    got = bg.compute(handles)
    eager = [_forces(p * 1.5) for p in positions]
    for want, value in zip(eager, got, strict=True):
        torch.testing.assert_close(value, want)
    # Second order: the loss on the forces trains the weight and moves the positions.
    leaves = [_WEIGHT, *positions]
    want_grads = torch.autograd.grad(sum((f * f).sum() for f in eager), leaves)
    grads = torch.autograd.grad(sum((f * f).sum() for f in got), leaves)
    for a, b in zip(want_grads, grads, strict=True):
        torch.testing.assert_close(b, a)


def test_a_shape_error_in_such_a_function_is_still_a_shape_error() -> None:
    def bad(pos: torch.Tensor) -> Any:
        return torch.autograd.grad((pos @ torch.ones(4, 2)).sum(), pos)[0]  # (3,) @ (4, 2)

    f = bg.batched_func(bad)
    with bg.BatchingPolicy(), pytest.raises(bg.ShapeMismatchError, match="check the shapes"):
        f(bg.batched_value(torch.ones(3, requires_grad=True)))


def test_a_function_changing_its_input_in_place_is_still_refused_so() -> None:
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)

    f = bg.batched_func(scale)
    with bg.BatchingPolicy(), pytest.raises(TypeError, match="in place"):
        f(bg.batched_value(torch.ones(3)) * 1)


@pytest.mark.parametrize("call", ["grad", "backward"])
def test_autograd_on_handles_is_refused_with_what_to_write(call: str) -> None:
    with bg.BatchingPolicy():
        pos = bg.batched_value(torch.randn(4, 3, requires_grad=True)) * 1
        energy = (pos * pos).sum()
        with pytest.raises(TypeError, match=r"bg\.batched_func\(f\)"):
            if call == "grad":
                torch.autograd.grad(energy, pos)
            else:
                torch.autograd.backward(energy)
