"""Containers inside a ``BatchedModule`` read while recording as the eager code reads them."""

from __future__ import annotations

import torch
from torch import nn

import batchgraph as bg


class WithParameterContainers(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(2)])
        self.shifts = nn.ParameterDict({"a": nn.Parameter(torch.randn(3))})

    def f(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) + self.scales[0] + self.shifts["a"]
        for scale in self.scales:
            y = y * scale
        for name, shift in self.shifts.items():
            y = y - shift if name == "a" else y
        return y


def test_parameter_lists_and_dicts_index_and_iterate_as_eagerly() -> None:
    torch.manual_seed(0)
    model = WithParameterContainers().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(3)]
    eager = [model.f(x) for x in xs]
    expected = torch.autograd.grad(sum(e.sum() for e in eager), list(model.parameters()))
    with bg.BatchingPolicy():  # the stub of a ParameterList was not subscriptable
        handles = [model.f(x) for x in xs]
    batched = bg.compute(handles)
    for a, b in zip(batched, eager):
        torch.testing.assert_close(a, b)
    grads = torch.autograd.grad(sum(b.sum() for b in batched), list(model.parameters()))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)
    # The worker path names them by path and reads the live ones.
    batch = bg.GraphCollate(model, "f").build(xs)
    for a, b in zip(bg.Binder(model).run(batch), eager):
        torch.testing.assert_close(a, b)


class SkipsDropout(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 3)])

    def f(self, x: torch.Tensor) -> torch.Tensor:
        assert isinstance(self.layers, nn.ModuleList)
        for layer in self.layers:
            if isinstance(layer, nn.Dropout):  # per-example code asking what a layer is
                continue
            x = layer(x)
        return x


def test_isinstance_of_a_submodule_answers_as_eagerly() -> None:
    # Before, a stub was no nn.Dropout: the recorded code took the other branch and
    # applied the dropout the eager code skipped (training mode: other values).
    torch.manual_seed(0)
    model = SkipsDropout().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    eager = [model.f(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [model.f(x) for x in xs]
        assert type(model.layers[0]) is not nn.Linear  # still a stub, which records
        assert bg.batched_func(model.layers[0]) is model.layers[0]  # already a site
    for a, b in zip(bg.compute(handles), eager):
        torch.testing.assert_close(a, b)


def test_a_submodule_assigned_while_recording_is_the_module_itself() -> None:
    model = SkipsDropout()
    with bg.BatchingPolicy():
        model.last = model.layers[2]  # a stub here, as the eager code's module
        model.all = model.layers
    assert model.last is model.layers[2] and model._modules["last"] is model.layers[2]
    assert model.all is model.layers
    assert set(model.state_dict()) >= {"last.weight", "all.0.weight"}
