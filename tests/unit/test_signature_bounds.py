"""A call site's signature cache stays bounded over a long run whose static arguments
vary, and does not keep the objects passed by reference alive (batchgraph.lifetimes)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import batchgraph as bg
from batchgraph import binding, inference, portable, recording
from batchgraph.lifetimes import OBJECT_SIGNATURES_KEPT, bounded, holds_objects


class Config:
    """An object of the user's, passed by reference (hashed by identity)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.table = torch.full((3,), scale)  # what a leak would keep: a tensor


def _bound(monkeypatch: pytest.MonkeyPatch, name: str, value: int) -> None:
    """Set a bound of batchgraph.lifetimes where the code reads it: in the module the
    package imported (collecting its doctests, pytest may import the file again as
    another module object, which the code never reads)."""
    for fn in (recording.keep_signature, binding.bounded, portable.bounded,
               inference.trim_fake_cache):
        monkeypatch.setitem(fn.__globals__, name, value)


def scaled(x: torch.Tensor, config: Config) -> torch.Tensor:
    return x * config.table


def test_objects_passed_per_batch_are_not_kept_alive_by_the_cache() -> None:
    # Before, the site of a module-level function (which lives for good) cached one
    # signature per object, holding it: every batch's config stayed alive, and its
    # tensors (40 of 40 here).
    f = bg.batched_func(scaled)
    refs: list[weakref.ref[torch.Tensor]] = []
    for step in range(40):
        config = Config(float(step))
        xs = [torch.arange(3.0) + i for i in range(2)]
        with bg.BatchingPolicy():
            hs = [f(x, config) for x in xs]
        for got, x in zip(bg.compute(hs), xs):
            assert torch.equal(got, scaled(x, config))  # as eagerly
        refs.append(weakref.ref(config.table))
        del config, hs
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= OBJECT_SIGNATURES_KEPT
    assert len(f._bg_cache) <= OBJECT_SIGNATURES_KEPT  # type: ignore[attr-defined]


def scaled_too(x: torch.Tensor, config: Config) -> torch.Tensor:
    return x * config.table


def test_a_long_lived_object_keeps_its_cached_signature() -> None:
    f = bg.batched_func(scaled_too)  # a site of its own: its cache holds this test's
    config = Config(2.0)
    entries = set()
    for _ in range(5):
        with bg.BatchingPolicy() as policy:
            hs = [f(torch.ones(3), config), f(torch.zeros(3), config)]
        assert [t.tolist() for t in bg.compute(hs)] == [[2.0] * 3, [0.0] * 3]
        assert policy.stats is not None and policy.stats.launches <= 2
        entries.update(id(e) for e in f._bg_cache.values())  # type: ignore[attr-defined]
    assert len(entries) == 1  # resolved once, not per batch


def _weight(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s + 1


def test_varying_float_arguments_keep_a_bounded_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    # A temperature annealed per step: each value is a signature of its own. Before,
    # the cache of a function living for good grew by one entry per value, without
    # end (a bound of 32 here keeps the test short; the default is SIGNATURES_KEPT).
    _bound(monkeypatch, "SIGNATURES_KEPT", 32)
    f = bg.batched_func(_weight)
    for step in range(100):
        s = 1.0 + step / 8
        xs = [torch.arange(3.0), torch.ones(3)]
        with bg.BatchingPolicy():
            hs = [f(x, s) for x in xs]
        for got, x in zip(bg.compute(hs), xs):
            assert torch.equal(got, _weight(x, s))
        assert len(f._bg_cache) <= 32  # type: ignore[attr-defined]
    with bg.BatchingPolicy() as policy:  # a value dropped long ago, seen again
        hs = [f(torch.ones(3), 1.0), f(torch.zeros(3), 1.0)]
    assert [t.tolist() for t in bg.compute(hs)] == [[2.0] * 3, [1.0] * 3]
    assert policy.stats is not None and policy.stats.launches == 1  # batched as one


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200), st.integers(2, 16))
def test_bounded_keeps_the_newest_entries_within_the_limit(keys: list[int], limit: int) -> None:
    table: dict[int, int] = {}
    for i, key in enumerate(keys):
        table = bounded(table, key, i, limit)
        assert len(table) <= limit
        assert table[key] == i  # the entry just set is always there
    last = {key: i for i, key in enumerate(keys)}
    for key, value in table.items():
        assert last[key] == value  # never a stale value
    # The newest distinct keys are there, about half the limit at the least.
    newest = sorted(last, key=last.__getitem__)[-(limit // 2):]
    assert set(newest) <= set(table)


@pytest.mark.parametrize(
    ("sig", "expected"),
    [
        (((float, 0.5), "mean", torch.float32, None), False),
        ((torch.device("cpu"), (int, 3), torch.nn.functional.relu, torch.add), False),
        (((int, 1), Config(1.0)), True),
        ((lambda x: x,), True),  # a local function holds what it captured
        ((torch.ones(2).add,), True),  # bound to a tensor
        ((torch.nn.Linear(2, 2), (int, 1)), False),  # a model's part: lives as the model
        ((torch.nn.Linear(2, 2).forward,), False),
    ],
)
def test_signatures_holding_objects_are_told_apart(sig: Any, expected: bool) -> None:
    assert holds_objects(sig) is expected


class _Scaled(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def f(self, example: tuple[torch.Tensor, float]) -> Any:
        x, s = example
        return self.lin(x) * s


def test_workers_and_binders_keep_a_bounded_number_of_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Batches recorded in workers, bound to the model: the worker's exporter described,
    # and the model's binder checked, a key per new static value, each kept for good.
    _bound(monkeypatch, "SIGNATURES_KEPT", 16)
    net = _Scaled()
    collate = bg.GraphCollate(net, "f")
    for step in range(50):
        examples = [(torch.ones(3), 1.0 + step / 4), (torch.zeros(3), 1.0 + step / 4)]
        got = bg.bind(collate.build(examples), net)
        for value, example in zip(got, examples):
            torch.testing.assert_close(value, net.f(example))  # as eagerly
    binder = net.__dict__[binding._BINDER].value[0]
    assert len(binder._checked) <= 16
    exporter = collate._state[2]  # type: ignore[index]  # built in this process
    assert len(exporter._described) <= 16


def test_torchs_fake_dispatch_cache_keeps_a_bounded_number_of_our_entries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Each new signature runs once on fake tensors, and torch keeps what its fake ops
    # dispatched in one dict for the process, never trimmed: a float per step made
    # three entries for good. Only our entries are trimmed; others' stay.
    _bound(monkeypatch, "FAKE_ENTRIES_KEPT", 50)
    with FakeTensorMode():  # someone else's entry (torch.compile's, say)
        torch.empty(7, 11).mul(0.125)
    theirs = list(FakeTensorMode.cache)[-1]
    start = len(FakeTensorMode.cache)
    f = bg.batched_func(_weight)
    with bg.BatchingPolicy():
        hs = [f(torch.ones(3), 1.0 + step / 16) for step in range(100)]
    got = bg.compute(hs)
    assert all(torch.equal(g, _weight(torch.ones(3), 1.0 + s / 16)) for s, g in enumerate(got))
    assert len(FakeTensorMode.cache) <= start + 50
    assert theirs in FakeTensorMode.cache


def _block(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(x))


class _Deep(bg.BatchedModule):
    """More layers than OBJECT_SIGNATURES_KEPT, each passed to one recorded function."""

    def __init__(self, block: Any) -> None:
        super().__init__()
        self.block = block
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(3, 3) for _ in range(OBJECT_SIGNATURES_KEPT + 8)])

    def run(self, x: torch.Tensor) -> Any:
        for layer in self.layers:  # recording stubs inside the block
            x = self.block(layer, x)
        return x


@pytest.mark.parametrize("through", ["stubs", "modules"])
def test_a_models_layers_passed_to_a_function_keep_their_signatures(through: str) -> None:
    # Counted among objects of the user's, each layer's signature pushed out an older
    # one: every call resolved anew (a run on fake tensors each), every batch.
    block = bg.batched_func(lambda layer, x: _block(layer, x))  # a site of its own
    model = _Deep(block)
    xs = [torch.randn(3) for _ in range(2)]
    entries: list[set[int]] = []
    for _ in range(3):
        with bg.BatchingPolicy():
            if through == "stubs":
                hs = [model.run(x) for x in xs]
            else:
                hs = []
                for x in xs:
                    for layer in model.layers._modules.values():  # the modules themselves
                        x = block(layer, x)
                    hs.append(x)
        for got, x in zip(bg.compute(hs), xs):
            want = x
            for layer in model.layers:
                want = _block(layer, want)
            torch.testing.assert_close(got, want)
        entries.append({id(e) for e in block._bg_cache.values()})  # type: ignore[attr-defined]
    assert len(entries[0]) == len(model.layers)
    assert entries[0] == entries[1] == entries[2]  # resolved once, not per batch
