"""A callable of the user's own named as if in place (``masked_``) or holding an
``inplace`` flag computes as eagerly.

Such a call on a handle was recorded on a copy of the handle (``batchgraph.on_copy``),
which was then handed back as its result, by the name or the flag alone: a function
``masked_(h)`` returning a new tensor gave ``h`` back unchanged (``[-1, 2, -3]`` where
eagerly ``[0, 2, 0]``), a block keeping ``self.inplace = True`` for an activation of
its own (timm's style) returned its input, and a function changing its input in place
but returning its sum returned the changed input, all silently. torch's own names and
flags still mean in place (``h.relu_()``, ``nn.ReLU(inplace=True)``); a user's mean so
where the call, run on fake tensors, changes its first input and returns it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


def masked_(x: torch.Tensor) -> torch.Tensor:
    """Returns a new tensor: the input is left alone."""
    y = x * 1
    y.masked_fill_(y < 0, 0.0)
    return y


def clamp_(x: torch.Tensor) -> torch.Tensor:
    """Changes its input in place and returns it, as torch's own ``clamp_``."""
    return x.clamp_(min=0.0)


class HardSigmoid(nn.Module):
    """An activation keeping ``inplace`` for an intermediate value, not its input."""

    def __init__(self) -> None:
        super().__init__()
        self.inplace = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(x + 3.0, inplace=self.inplace) / 6.0


class LayerScale(nn.Module):
    """timm's ``LayerScale(inplace=True)``: scales its input in place and returns it."""

    def __init__(self) -> None:
        super().__init__()
        self.inplace = True
        self.gamma = nn.Parameter(torch.linspace(0.5, 2.0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.gamma) if self.inplace else x * self.gamma


def _module_call(module: nn.Module) -> Callable[[Any], Any]:
    site = bg.batched_func(module)
    return lambda h: site(h)


_CALLS: dict[str, tuple[Callable[[Any], Any], Callable[[torch.Tensor], torch.Tensor]]] = {
    "a new value named in place": (bg.batched_func(masked_), masked_),
    "an in-place function of the user's": (bg.batched_func(clamp_), clamp_),
    "a module flag for an inner value": (_module_call(HardSigmoid()), HardSigmoid()),
}


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(sorted(_CALLS)),
       values=st.lists(st.lists(st.floats(-5, 5, width=32), min_size=4, max_size=4),
                       min_size=1, max_size=4))
def test_user_callables_named_or_flagged_in_place_compute_as_eagerly(
    name: str, values: list[list[float]]
) -> None:
    recorded, eager_fn = _CALLS[name]
    xs = [torch.tensor(v) for v in values]
    eager = []
    for x in xs:
        y = x * 1
        out = eager_fn(y)
        eager.append((out * 1, y * 1))  # the result, and the input as it is afterwards
    with bg.BatchingPolicy():
        handles = []
        for x in xs:
            h = bg.batched_value(x) * 1
            out = recorded(h)
            handles.append((out * 1, h * 1))
    for (out, after), (eager_out, eager_after) in zip(bg.compute(handles), eager, strict=True):
        torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
        torch.testing.assert_close(after, eager_after, rtol=0, atol=0)


def test_an_in_place_module_of_the_users_keeps_its_values_and_gradients() -> None:
    torch.manual_seed(0)
    scale = LayerScale()
    site = bg.batched_func(scale)
    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    eager = []
    for x in xs:
        y = x * 1
        eager.append(scale(y) + y)  # eagerly y is the scaled value too
    with bg.BatchingPolicy() as policy:
        handles = []
        for x in xs:
            h = bg.batched_value(x) * 1
            handles.append(site(h) + h)
    got = policy.compute(handles)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)
    leaves = [scale.gamma, *xs]
    weights = [1.0, -2.0, 0.5]
    grads = [torch.autograd.grad(sum(w * v.sum() for w, v in zip(weights, vals)), leaves)
             for vals in (got, eager)]
    for g, e in zip(*grads, strict=True):
        torch.testing.assert_close(g, e)


def test_a_function_changing_its_input_and_returning_another_value_is_refused() -> None:
    def scale_and_sum_(x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()

    site = bg.batched_func(scale_and_sum_)
    with bg.BatchingPolicy(), pytest.raises(TypeError, match=r"scale_and_sum_.*changes its "
                                                          r"input 0 .* in place"):
        site(bg.batched_value(torch.ones(3)) * 1)


def test_a_user_function_named_in_place_takes_a_plain_tensor() -> None:
    # It was refused as "would change a tensor in place with a recorded value".
    site = bg.batched_func(lambda x, h: masked_(x) + h)
    site_named = bg.batched_func(masked_)
    x = torch.tensor([-1.0, 2.0, -3.0])
    with bg.BatchingPolicy():
        g = bg.batched_value(torch.ones(3)) * 1
        a = site_named(x)
        b = site(x, g)
    got_a, got_b = bg.compute([a, b])
    torch.testing.assert_close(got_a, masked_(x), rtol=0, atol=0)
    torch.testing.assert_close(got_b, masked_(x) + 1, rtol=0, atol=0)
    torch.testing.assert_close(x, torch.tensor([-1.0, 2.0, -3.0]), rtol=0, atol=0)


def test_torchs_own_in_place_calls_still_record_on_a_copy() -> None:
    relu = bg.batched_func(nn.ReLU(inplace=True))
    x = torch.tensor([-1.0, 2.0])
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        out = relu(h)
        assert out is h  # eagerly the call returns its input
        g = h * 1
        h2 = bg.batched_value(x) * 1
        h2.clamp_(min=0.5)
    torch.testing.assert_close(bg.compute(g), torch.tensor([0.0, 2.0]), rtol=0, atol=0)
    torch.testing.assert_close(bg.compute(h2), torch.tensor([0.5, 2.0]), rtol=0, atol=0)
