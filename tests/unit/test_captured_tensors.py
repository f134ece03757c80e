"""Tensors a recorded function reads besides its arguments are watched like a
module's parameters: changed in place between recording and compute, the calls are
refused (``ParameterChangedError``), as eagerly they read the old values."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.captured import captured_tensors

torch.manual_seed(0)
WEIGHT = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
LAYER = nn.Linear(3, 3).double()


def _through_global(x: torch.Tensor) -> torch.Tensor:
    return x @ WEIGHT


def _through_helper(x: torch.Tensor) -> torch.Tensor:
    return _through_global(x).tanh()


def _closing(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: x @ w


def _with_default(x: torch.Tensor, w: torch.Tensor = WEIGHT) -> torch.Tensor:
    return x @ w


def _weights_in_a_list() -> Callable[[torch.Tensor], torch.Tensor]:
    ws = [WEIGHT, LAYER.weight]
    return lambda x: x @ ws[0] @ ws[1]


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "closure": _closing(WEIGHT),
    "global": _through_global,
    "helper naming a global": _through_helper,
    "default argument": _with_default,
    "list in a closure": _weights_in_a_list(),
    "partial": functools.partial(torch.matmul, other=WEIGHT),
    "bound method of a module": LAYER.forward,
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_an_in_place_change_before_compute_is_refused(name: str) -> None:
    f = bg.batched_func(FUNCTIONS[name])
    x = torch.randn(3, dtype=torch.float64)
    with bg.BatchingPolicy() as policy:
        h = f(x)
    with torch.no_grad():
        WEIGHT.add_(1.0)
        LAYER.weight.add_(1.0)
    with pytest.raises(bg.ParameterChangedError, match="tensors read by"):
        policy.compute(h)
    assert not h.computed


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_unchanged_tensors_compute_as_eagerly(name: str) -> None:
    f = bg.batched_func(FUNCTIONS[name])
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with bg.BatchingPolicy():
        hs = [f(x) for x in xs]
    for got, x in zip(bg.compute(hs), xs, strict=True):
        torch.testing.assert_close(got, FUNCTIONS[name](x))


def test_a_training_loop_on_one_policy_does_not_merge_across_steps() -> None:
    # The identical call merges with the one before only while the weight stays:
    # after an optimizer step it is a new node with the new weight's value.
    weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    f = bg.batched_func(lambda x: x @ weight)
    opt = torch.optim.SGD([weight], lr=0.5)
    x = torch.arange(3, dtype=torch.float64)
    policy = bg.BatchingPolicy()
    nodes = set()
    for _ in range(3):
        with policy:
            h = f(x)
        nodes.add(h.node)
        torch.testing.assert_close(policy.compute(h), x @ weight)
        (x @ weight).sum().backward()
        opt.step()
        opt.zero_grad()
    assert len(nodes) == 3


def test_what_is_found() -> None:
    assert [t is WEIGHT for t in captured_tensors(_through_helper)] == [True]
    assert {id(t) for t in captured_tensors(LAYER.forward)} == {id(p) for p in LAYER.parameters()}
    assert captured_tensors(torch.tanh) == ()
    assert captured_tensors(lambda x: x.relu()) == ()
    with torch.inference_mode():
        frozen = torch.ones(2)  # keeps no version counter: cannot be watched
    assert captured_tensors(lambda x: x * frozen) == ()


def test_a_cycle_of_functions_is_visited_once() -> None:
    def ping(x: torch.Tensor, n: int) -> torch.Tensor:
        return pong(x, n - 1) if n else x @ WEIGHT

    def pong(x: torch.Tensor, n: int) -> torch.Tensor:
        return ping(x, n)

    assert [t is WEIGHT for t in captured_tensors(ping)] == [True]
