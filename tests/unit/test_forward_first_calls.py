"""A forward whose first call, or first few, compute otherwise than the later ones.

Before: ``carries_state`` compared the second and third of batchgraph's runs of a
call only, so a first-call flag (``out = x * (2 if self.seen else 1); self.seen =
True``: the second run changes nothing) or a count read until it stops changing
(``min(self.step, 2)``: the third run repeats the second) was taken for a cache filled
once, and the calls batched: every call of the batch read the state as the first
call found it, silently (lengths 2, 2, 2: outputs 1x, 1x, 1x where eagerly 1x, 2x,
2x). Now the first run's operations that compute the output are compared with the
second's too; a cache filled once (a table per length) still batches.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import batchgraph as bg
from tests.unit.test_forward_caches import Holder, Keeping, as_eagerly_test


class FirstFlag(Keeping):
    """The first call scales by 1, the later ones by 2 (the second run changes nothing)."""

    def fresh(self) -> dict[str, Any]:
        return {"seen": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * (2 if self.seen else 1)
        self.seen = True
        return out


class FirstBranch(Keeping):
    """A branch taken on the first call only (HF-style ``if not self.initialized``)."""

    def fresh(self) -> dict[str, Any]:
        return {"initialized": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.initialized:
            self.initialized = True
            return self.lin(x)
        return self.lin(x) * 3


class FirstExtra(Keeping):
    """An operation made on the first call only: the later calls make fewer."""

    def fresh(self) -> dict[str, Any]:
        return {"seen": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if not self.seen:
            out = out - 1
        self.seen = True
        return out


test_a_forward_computing_otherwise_at_its_first_call_computes_as_eagerly = as_eagerly_test(
    [FirstFlag, FirstBranch, FirstExtra], (FirstFlag, FirstBranch, FirstExtra))


class Warmup(Keeping):
    """A count read until it stops changing: the third run repeats the second."""

    def fresh(self) -> dict[str, Any]:
        return {"step": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return self.lin(x) * min(self.step, 2)


def batched_as_eagerly(pattern: type[Keeping], n: int) -> tuple[Holder, Holder, Any]:
    """``n`` calls of ``pattern`` of length 3, batched and eagerly: the same values;
    the batched model, the eager one and the batched run's statistics."""
    torch.manual_seed(0)
    eager = Holder(pattern())
    model = copy.deepcopy(eager)
    xs = [torch.randn(3, 4) for _ in range(n)]
    want = [eager.stub(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [model.stub(x) for x in xs]
    for g, w in zip(bg.compute(handles), want, strict=True):
        torch.testing.assert_close(g, w)
    return model, eager, policy.stats


def test_a_count_read_until_it_stops_changing_computes_as_eagerly() -> None:
    model, eager, _ = batched_as_eagerly(Warmup, 3)
    assert model.inner.step == eager.inner.step == 3


class Rotary(Keeping):
    """A table made for the longest length seen so far, sliced per call."""

    def fresh(self) -> dict[str, Any]:
        return {"table": None, "length": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > self.length:
            self.table = torch.arange(n, dtype=x.dtype)[:, None] * 0.1
            self.length = n
        return self.lin(x) + self.table[:n]


def test_a_cache_filled_at_the_first_call_still_batches() -> None:
    _, _, stats = batched_as_eagerly(Rotary, 4)
    assert "Rotary" not in stats.unbatched_callables
    assert stats.launches < 4
