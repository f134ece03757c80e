"""Submodule stubs pinned in instance dicts while recording: gone when recording ends."""

from __future__ import annotations

import copy
import pickle
import threading

import torch
from torch import nn

import batchgraph as bg
from batchgraph.sites import ModuleStub


class Net(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.layers = nn.ModuleList([nn.Linear(3, 3)])

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.lin(x))


def test_stubs_are_pinned_while_recording_and_unpinned_after() -> None:
    net = Net()
    with bg.BatchingPolicy():
        first = net.lin
        assert type(first) is ModuleStub and net.__dict__["lin"] is first
        assert net.lin is first  # a plain lookup now
        h = net.f(torch.ones(3))
    assert net.lin is net._modules["lin"] and "lin" not in net.__dict__
    assert isinstance(net.layers, nn.ModuleList) and "layers" not in net.__dict__
    assert torch.allclose(bg.compute(h), net.f(torch.ones(3)))


def test_a_submodule_replaced_or_removed_while_recording() -> None:
    net = Net()
    with bg.BatchingPolicy():
        _ = net.lin
        other = nn.Linear(3, 3)
        net.lin = other
        assert net.lin.__wrapped__ is other
        net.lin = None  # type: ignore[assignment]
        assert net.lin is None
        net.lin = other
        _ = net.lin
        del net.lin
        assert "lin" not in net._modules and "lin" not in net.__dict__


def test_copies_made_while_recording_hold_modules_not_stubs() -> None:
    net = Net()
    with bg.BatchingPolicy():
        _ = net.lin, net.layers
        clone = copy.deepcopy(net)
        pickled = pickle.loads(pickle.dumps(net))
    for copied in (clone, pickled):
        assert "lin" not in copied.__dict__ and isinstance(copied.lin, nn.Linear)
        x = torch.randn(3)
        assert torch.equal(copied.f(x), net.f(x))


def test_coroutine_runs_unpin() -> None:
    net = Net()

    async def one(x: torch.Tensor) -> torch.Tensor:
        return await bg.value(net.f(x))

    xs = [torch.randn(3) for _ in range(3)]
    got = bg.run_all([one(x) for x in xs])
    assert all(torch.allclose(g, net.f(x)) for g, x in zip(got, xs))
    assert "lin" not in net.__dict__ and isinstance(net.lin, nn.Linear)


def test_another_thread_reading_while_recording_still_runs_eagerly() -> None:
    net = Net()
    x = torch.randn(3)
    want = net.f(x)
    got: list[torch.Tensor] = []
    with bg.BatchingPolicy():
        _ = net.lin, net.layers  # pinned
        worker = threading.Thread(target=lambda: got.append(net.f(x)))
        worker.start()
        worker.join()
    assert type(got[0]) is torch.Tensor and torch.equal(got[0], want)
