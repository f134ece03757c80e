"""A forward keeping a plain number it sets again at every call: a count read only
by Python's control flow, a number taken from the input's shape.

Before: a count read only by control flow (``self.n += 1; if self.n > 2: return
lin(x) * 2``) makes the same operations at every call once its branch settles, so
its calls batched and the count counted batched calls, not examples (eagerly 4 after
4 calls, batched 2), and a ``bg.batched_func`` reading the module, resolved anew at
each batch, batched where the module's own call ran in order. A number taken from
the input's shape and read by the next call (``out = lin(x) * self.n; self.n =
x.shape[0]``) was set to the value it had by a run of one length, so the calls of
that length batched and ran before a longer call recorded ahead of them (outputs
off, silently). Now both run one at a time in recorded order (``number_reads``);
a count nothing reads and the modules' settings still batch.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from tests.unit.test_forward_caches import (
    Holder,
    Keeping,
    as_eagerly_test,
    assert_like,
    check_as_eagerly,
    runs_alike,
    state_of,
)


class BranchCount(Keeping):
    """A count read by control flow alone: calls 3.. take the other branch."""

    def fresh(self) -> dict[str, Any]:
        return {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        if self.n > 2:
            return self.lin(x) * 2
        return self.lin(x)


class EveryOther(Keeping):
    """A float count whose parity (through arithmetic) picks the branch."""

    def fresh(self) -> dict[str, Any]:
        return {"t": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t = self.t + 0.5
        return self.lin(x) - 1 if (self.t * 2) % 2 else self.lin(x)


class LastLength(Keeping):
    """The length of the call before, read by the output."""

    def fresh(self) -> dict[str, Any]:
        return {"n": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * self.n
        self.n = x.shape[0]
        return out


class Length(Keeping):
    """The call's own length kept (the module holds the last call's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n = x.size(0)
        return self.lin(x) * self.n


class DictCount(Keeping):
    """A count kept in a dict, read by control flow alone."""

    def fresh(self) -> dict[str, Any]:
        return {"state": {"n": 0, "name": "count"}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state["n"] += 1
        return self.lin(x) * 2 if self.state["n"] > 2 else self.lin(x)


class ListLength(Keeping):
    """The length of the call before, kept in a list."""

    def fresh(self) -> dict[str, Any]:
        return {"lengths": [1]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * self.lengths[0]
        self.lengths[0] = x.shape[0]
        return out


PATTERNS: list[type[nn.Module]] = [BranchCount, EveryOther, LastLength, Length, DictCount,
                                   ListLength]

test_a_number_set_at_every_call_and_read_computes_as_eagerly = as_eagerly_test(
    PATTERNS, tuple(PATTERNS))


@pytest.mark.parametrize("entry", ["stub", "method", "function"])
@settings(max_examples=4, deadline=None)
@given(before=st.integers(0, 4), lengths=st.lists(st.integers(1, 3), min_size=1, max_size=5))
def test_a_count_read_by_control_flow_counts_every_call_once_its_branch_settled(
        entry: str, before: int, lengths: list[int]) -> None:
    # ``before`` eager calls first: from 2 on, every run takes the branch calls 3.. take
    torch.manual_seed(0)
    eager = Holder(BranchCount())
    for _ in range(before):
        eager.inner(torch.randn(2, 4))
    model = copy.deepcopy(eager)
    runs_alike(model, eager, entry, [torch.randn(n, 4) for n in lengths], "state")
    assert model.inner.n == eager.inner.n == before + len(lengths)


class Layers(nn.Module):
    """Torch's usual layers under a module of the user's holding number settings and
    counts nothing reads: its calls batch."""

    def __init__(self) -> None:
        super().__init__()
        self.width, self.scale, self.calls = 8, 0.5, 0
        self.stats = {"calls": 0, "sizes": [0]}
        self.embed = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.cell = nn.GRUCell(8, 8)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8).eval()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.stats["calls"] += 1
        self.stats["sizes"][0] += 1  # (a list in a dict: not looked into)
        x = self.norm(self.lin(self.embed(tokens))) * self.scale
        h = self.cell(x, torch.zeros(tokens.shape[0], self.width))
        return self.layer(self.bn(h)[None])[0]


def test_usual_layers_under_a_module_with_number_settings_still_batch() -> None:
    torch.manual_seed(0)
    model = Holder(Layers())
    xs = [torch.randint(0, 10, (3,)) for _ in range(6)]
    want = [model.stub(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [model.stub(x) for x in xs]
    for g, w in zip(bg.compute(handles), want, strict=True):
        torch.testing.assert_close(g, w)
    assert policy.stats is not None and policy.stats.unbatched_callables == ()
    assert policy.stats.launches <= 3


def test_numbers_carried_leaves_the_attributes_as_they_were() -> None:
    from batchgraph.number_reads import numbers_carried

    module = Length()
    module.n, module.calls = 5, 1
    before = copy.deepcopy(state_of(module))
    assert numbers_carried(lambda: module(torch.ones(2, 4)), [module]) == ["Length.n"]
    assert_like(state_of(module), before, "state")
    assert type(module.n) is int and type(module.calls) is int


# Recording refuses a forward that writes a handle into a tensor in place (copy_, t[i] =).
WRITES_A_HANDLE = "recorded value is not known until computed|in place with a recorded value"


def plain_and_coroutine_calls_as_eagerly(make: Callable[[], nn.Module], groups: int) -> None:
    """``make()``'s module as a grandchild (``nn.Sequential``), called on handles in a
    policy and by ``run_all`` examples calling it once each (in ``groups``): the same
    values and state left as eagerly, or a clear error (examples interleaved: the
    ordering error; a handle written into a tensor: ``WRITES_A_HANDLE``)."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Identity(), make()).double()
    model, twin, eager_twin = (copy.deepcopy(eager) for _ in range(3))
    xs = [torch.randn(n, 4, dtype=torch.float64) for n in [1, 2, 3, 2]]

    async def once(x: torch.Tensor) -> Any:
        return await bg.value(twin(bg.batched_value(x)))

    def plain() -> list[torch.Tensor]:
        with bg.BatchingPolicy():
            handles = [model(bg.batched_value(x)) for x in xs]
        return list(bg.compute(handles))

    runs = [(plain, model, eager),
            (lambda: bg.run_all([once(x) for x in xs], groups=groups), twin, eager_twin)]
    for run, batched, reference in runs:
        want = [reference(x) for x in xs]
        try:
            got = run()
        except (bg.CoroutineExampleError, RuntimeError) as err:
            assert re.search(WRITES_A_HANDLE, str(err)) or (
                groups > 1 and "keeps state of its own" in str(err)), err
            continue
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        assert_like(state_of(batched[1]), state_of(reference[1]), "state")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.__name__)
def test_a_grandchild_setting_numbers_called_on_handles_and_in_coroutines(
        pattern: type[nn.Module], groups: int) -> None:
    plain_and_coroutine_calls_as_eagerly(pattern, groups)


class ExactInt(Keeping):
    """A forward checking its setting is an exact int (the watching numbers are not)."""

    def fresh(self) -> dict[str, Any]:
        return {"width": 4, "calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(self.width) is not int:
            raise TypeError("width must be an int")
        self.calls += 1
        return self.lin(x)


def test_a_forward_refusing_the_watching_numbers_still_records_and_batches() -> None:
    model = Holder(ExactInt())
    xs = [torch.randn(3, 4) for _ in range(4)]
    want = [model.stub(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [model.stub(x) for x in xs]
    for g, w in zip(bg.compute(handles), want, strict=True):
        torch.testing.assert_close(g, w)
    assert policy.stats is not None and policy.stats.launches < len(xs)


@pytest.mark.parametrize("pattern", [LastLength, ListLength], ids=lambda p: p.__name__)
def test_a_length_kept_for_the_next_call_orders_a_first_call_setting_it_unchanged(
        pattern: type[nn.Module]) -> None:
    # The length-1 call sets the length it found (1): its run changes nothing.
    check_as_eagerly("stub", pattern, [1, 2, 1], 0, in_order=True)
