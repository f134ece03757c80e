"""A module's own attributes named as a call site's fields (``self.name``, ``self.fn``,
``self.cache``, ..., a wrapper's ``self.module``) read and set through its recording
stub reach the module, as eagerly: the stub's fields were named so, and per-example
code got the stub's value, silently (``self.layer.fn(x)`` called the layer itself)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.sites import ModuleStub

# The fields a call site had under these names (base 6da41d3): any module may have them.
NAMES = ("autocast", "by_modes", "cache", "copying", "fn", "held", "last", "last1",
         "mode_module", "name", "shadows")
# And its methods of its own (until 3dd885a), which a module's settings shadowed as well.
METHODS = ("_entry", "_forget", "_infer_spec", "_note_view", "_resolve", "_shadow")


class Layer(nn.Module):
    """A layer with one setting, named ``attr``, scaling its output."""

    def __init__(self, attr: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        setattr(self, attr, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Net(bg.BatchedModule):
    """Per-example code reading and setting the layer's setting through the stub."""

    def __init__(self, attr: str) -> None:
        super().__init__()
        self.layer = Layer(attr)
        self.attr = attr

    def forward(self, x: torch.Tensor) -> Any:
        before = getattr(self.layer, self.attr)
        setattr(self.layer, self.attr, 2.5)
        return self.layer(x) * before + self.layer(x) * getattr(self.layer, self.attr)


def _net(attr: str) -> Net:
    torch.manual_seed(0)
    return Net(attr)


def _inputs() -> list[torch.Tensor]:
    return [torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
            for i in range(3)]


@pytest.mark.parametrize("attr", (*NAMES, *METHODS))
def test_a_setting_read_and_set_through_the_stub_in_a_policy_equals_eager(attr: str) -> None:
    eager_net, net, xs = _net(attr), _net(attr), _inputs()
    eager = [eager_net(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [net(x) for x in xs]
    for e, got in zip(eager, bg.compute(handles)):
        torch.testing.assert_close(got, e)
    assert getattr(net.layer, attr) == getattr(eager_net.layer, attr) == 2.5


@pytest.mark.parametrize("attr", (*NAMES, *METHODS))
def test_a_setting_read_and_set_through_the_stub_in_coroutines_equals_eager(attr: str) -> None:
    eager_net, net, xs = _net(attr), _net(attr), _inputs()
    eager = [eager_net(x) for x in xs]

    async def example(x: torch.Tensor) -> Any:
        first = await net(x)
        return first + await net(x)  # the second round reads the value set in the first

    got = bg.run_all([example(x) for x in xs])
    for x, e, g in zip(xs, eager, got):
        torch.testing.assert_close(g, e + eager_net(x))
    assert getattr(net.layer, attr) == 2.5


class Gated(nn.Module):
    """A layer keeping its activation as ``self.fn`` and its name as ``self.name``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.fn = torch.tanh
        self.name = "encoder"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Residual(nn.Module):
    """A wrapper keeping what it wraps as ``self.module``, as DataParallel does."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.module(x)


class GatedNet(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = Gated()
        self.block = Residual()

    def forward(self, x: torch.Tensor) -> Any:
        h = self.layer.fn(self.layer(x))  # through the stub: was layer(layer(x))
        h = h * 2 if self.layer.name == "encoder" else h
        return self.block.module(h)  # through the stub: was the Residual itself


@pytest.mark.parametrize("attr", (*NAMES, *METHODS, "module"))  # `module`: until 21008eb
def test_a_module_without_the_attribute_lacks_it_through_the_stub_too(attr: str) -> None:
    # Per-example code asking `hasattr(layer, "cache")` takes the branch eager code takes.
    class Holder(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

    holder = Holder()
    eager = hasattr(holder.lin, attr)
    with bg.BatchingPolicy():
        stub = holder.lin
        assert type(stub) is ModuleStub
        assert hasattr(stub, attr) is eager is False
        with pytest.raises(AttributeError, match=attr):
            getattr(stub, attr)


def test_a_modules_own_fn_name_or_module_read_through_the_stub_is_the_modules() -> None:
    eager_net, net, xs = GatedNet(), GatedNet(), _inputs()
    with bg.BatchingPolicy():
        handles = [net(x) for x in xs]
    for x, got in zip(xs, bg.compute(handles)):
        torch.testing.assert_close(got, eager_net(x))


def test_a_batched_func_still_gives_its_callable() -> None:
    # Rules are keyed by `site.fn` (BatchingPolicy(rules={double.fn: ...})); a module's
    # site gives its module as functools.wraps would, not as `fn` (the module's own).
    double = bg.batched_func(torch.tanh)
    assert double.fn is torch.tanh
    lin = nn.Linear(2, 2)
    assert bg.batched_func(lin).__wrapped__ is lin
    with pytest.raises(AttributeError, match="fn"):
        bg.batched_func(lin).fn  # noqa: B018


class _ScaledStack(nn.Sequential):
    """A container of the user's with settings of its own, one named ``container``."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(3, 3), nn.Tanh())
        self.container = 2.0
        self.scale = 1.0


class _StackNet(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.stack = _ScaledStack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stack.scale = 3.0  # set through the container's stub
        return self.stack(x) * self.stack.container * self.stack.scale


def test_a_containers_own_settings_read_and_set_through_its_stub_equal_eager() -> None:
    # Before: the stub's slot `container` was read instead of the container's 2.0
    # (the Sequential itself: TypeError), and setting `scale` raised AttributeError.
    model, eager_model = _StackNet(), _StackNet()
    eager_model.load_state_dict(model.state_dict())
    xs = [torch.randn(3) for _ in range(3)]
    want = [eager_model(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [model(x) for x in xs]
    got = bg.compute(handles)
    assert model.stack.scale == eager_model.stack.scale == 3.0
    assert model.stack.container == 2.0
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
