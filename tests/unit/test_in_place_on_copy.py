"""In-place calls on handles record on a copy, which the input handle then stands for
(batchgraph.on_copy): values and gradients as eagerly, where the change is seen
through every name bound to the changed tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchgraph as bg


class Block(bg.BatchedModule):
    """A residual block as model zoos write it: the in-place ReLU changes ``y``, which
    the sum reads again, so eagerly ``z + y`` is twice the activation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Sequential(nn.Linear(4, 3), nn.ReLU(inplace=True))

    def f(self, x: Any) -> Any:
        y = self.lin(x)
        z = self.act(y)
        return self.out(z + y), z is y


def _compare(fn: Callable[[Any], Any], xs: list[torch.Tensor], params: list[torch.Tensor]) -> None:
    """fn's values and gradients batched equal its eager ones."""
    eager = [fn(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [fn(bg.batched_value(x)) for x in xs]
    got = policy.compute(handles)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
    weights = [float(i + 1) for i in range(len(xs))]  # swapped rows cannot pass
    grads = [torch.autograd.grad(sum(w * v.sum() for w, v in zip(weights, vals)), params)
             for vals in (got, eager)]
    for g, e in zip(*grads, strict=True):
        torch.testing.assert_close(g, e)


def test_an_in_place_relu_module_changes_its_input_as_eagerly() -> None:
    torch.manual_seed(0)
    block = Block()
    xs = [torch.randn(4) for _ in range(5)]
    eager = [block.f(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [block.f(bg.batched_value(x)) for x in xs]
        assert all(same for _, same in handles)  # the call returns its input, as eagerly
    got = policy.compute([h for h, _ in handles])
    for g, (e, _) in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
    assert policy.stats.unbatched_calls == 0
    _compare(lambda x: block.f(x)[0], xs, list(block.parameters()))


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's clamp_
@pytest.mark.parametrize("name", ["relu_", "sigmoid_", "mul_", "clamp_", "add_", "functional",
                                  "torch_fn", "abs_ twice"])
def test_in_place_calls_on_a_handle_equal_eager(name: str) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(3, 3)
    other = torch.randn(3, requires_grad=True)

    def f(x: Any) -> Any:
        h = lin(x)
        before = h * 1  # recorded before the change: the old value, as eagerly
        alias = h
        if name == "relu_":
            out = h.relu_()
        elif name == "sigmoid_":
            out = h.sigmoid_()
        elif name == "mul_":
            out = h.mul_(2.5)
        elif name == "clamp_":
            out = h.clamp_(min=-0.1, max=0.2)
        elif name == "add_":
            out = h.add_(other, alpha=2.0)
        elif name == "functional":
            out = F.leaky_relu(h, 0.2, inplace=True)
        elif name == "torch_fn":
            out = torch.tanh_(h)
        else:
            out = h.abs_().sub_(0.5)
        return torch.stack([before, alias, out, h])

    params = [*lin.parameters(), *([other] if name == "add_" else [])]
    _compare(f, [torch.randn(3) for _ in range(4)], params)


def test_in_place_calls_batch_into_one_launch_per_step() -> None:
    act = bg.batched_func(nn.ReLU(inplace=True))
    with bg.BatchingPolicy() as policy:
        hs = [act(bg.batched_value(torch.randn(3)) * 1) for _ in range(6)]
    policy.compute(hs)
    assert policy.stats.launches == 2  # the multiplication and the ReLU
    assert policy.stats.unbatched_calls == 0


def test_in_place_dropout_draws_per_example_and_is_the_identity_in_eval() -> None:
    drop = nn.Dropout(0.5, inplace=True)
    site = bg.batched_func(drop)
    with bg.BatchingPolicy() as policy:
        hs = [site(bg.batched_value(torch.ones(64)) * 1) for _ in range(2)]
    a, b = policy.compute(hs)
    assert not torch.equal(a, b)  # identical calls are not merged: each draws its own
    assert set(a.unique().tolist()) <= {0.0, 2.0}
    drop.eval()
    with bg.BatchingPolicy() as policy:
        h = site(bg.batched_value(torch.ones(4)) * 1)
    torch.testing.assert_close(policy.compute(h), torch.ones(4))


def test_in_place_on_a_value_that_others_share_memory_with_is_refused() -> None:
    with bg.BatchingPolicy():
        given = bg.batched_value(torch.ones(2))
        with pytest.raises(TypeError, match=r"tensor given to bg\.batched_value"):
            bg.batched_func(nn.ReLU(inplace=True))(given)
        h = given * 1
        row = h[0]  # a view of h: eagerly the change reaches it
        with pytest.raises(TypeError, match="view of another value"):
            row.relu_()
        h.relu_()
        with pytest.raises(TypeError, match=r"changed in place by `Tensor\.relu_`"):
            bg.compute(row * 1)


def test_an_out_tensor_is_still_refused() -> None:
    out = torch.zeros(2)
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)) * 1
        with pytest.raises(TypeError, match=r"out=\.\.\.\) writes"):
            torch.tanh(h, out=out)
