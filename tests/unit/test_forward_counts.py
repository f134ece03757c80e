"""Forwards counting their calls, or keeping state on plain objects, compute as eagerly.

Before: a step kept in a tensor not made from the input (``self.step = self.step +
1``) is no batched tensor under vmap, so its calls batched and every call of a batch
read the same step, where eagerly three calls read 1, 2, 3 (silently); a Python count
(``self.n += 1``) was also counted by each of batchgraph's runs on fake tensors and
probes. And a tensor kept on a plain object (``self.box.ref = x`` on a
``SimpleNamespace``, a dataclass instance, an object with ``__slots__``) kept the run on
fake tensors' fake, and the compute failed (aten.allclose: DataDependentOutputException).
"""

from __future__ import annotations

import copy
import dataclasses
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from tests.unit.test_forward_caches import (
    Holder,
    Keeping,
    Tables,
    as_eagerly_test,
    assert_like,
    state_of,
)


class Step(Keeping):
    """A step counted in a tensor not made from the input: under vmap it is no batched
    tensor, and every call of a batch read the same step, silently."""

    def fresh(self) -> dict[str, Any]:
        return {"step": torch.zeros((), dtype=torch.float64)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step = self.step + 1
        return self.lin(x) * self.step


class Count(Keeping):
    """A Python count its operations read (each of batchgraph's runs counted too)."""

    def fresh(self) -> dict[str, Any]:
        return {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.lin(x) * self.n


class Halving(Keeping):
    """A float rebound to a new value each call, read by the output."""

    def fresh(self) -> dict[str, Any]:
        return {"scale": 1.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale = self.scale / 2
        return self.lin(x) * self.scale


class Counts(Keeping):
    """Counts kept in a dict: a tensor one and a Python one."""

    def fresh(self) -> dict[str, Any]:
        return {"counts": {"t": torch.zeros((), dtype=torch.float64), "n": 0}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counts["t"] = self.counts["t"] + 1
        self.counts["n"] += 1
        return self.lin(x) * self.counts["t"] - self.counts["n"]


class Steps(Keeping):
    """A step kept in a list, and a count in another."""

    def fresh(self) -> dict[str, Any]:
        return {"steps": [torch.zeros((), dtype=torch.float64)], "ns": [0]}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps[0] = self.steps[0] + 1
        self.ns[0] += 2
        return self.lin(x) * self.steps[0] + self.ns[0]


@dataclasses.dataclass
class Box:
    ref: torch.Tensor | None = None


class Slotted:
    __slots__ = ("ref",)

    def __init__(self) -> None:
        self.ref: torch.Tensor | None = None


class Held(Keeping):
    """A reference kept on a plain object of the user's (a SimpleNamespace)."""

    def fresh(self) -> dict[str, Any]:
        return {"box": types.SimpleNamespace(ref=None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.box.ref is None:
            self.box.ref = x.detach().mean(0)
        return self.lin(x - self.box.ref)


class Boxed(Held):
    """As ``Held``, on a dataclass instance."""

    def fresh(self) -> dict[str, Any]:
        return {"box": Box()}


class Slots(Keeping):
    """As ``Held``, on an object of a class with ``__slots__``, in a dict."""

    def fresh(self) -> dict[str, Any]:
        return {"boxes": {"a": Slotted()}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        box = self.boxes["a"]
        if box.ref is None:
            box.ref = x.detach().mean(0)
        return self.lin(x - box.ref)


class Cached(Keeping):
    """Tables by length kept on a plain object (made from the length only): its calls
    still batch."""

    def fresh(self) -> dict[str, Any]:
        return {"box": types.SimpleNamespace(tables={})}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in self.box.tables:
            self.box.tables[n] = torch.linspace(0, 1, n, dtype=x.dtype)[:, None]
        return self.lin(x) + self.box.tables[n]


class Registered(Keeping):
    """A buffer registered at the first call, from the input: under vmap it held the
    batch's tensor, escaped (other values, silently)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "ref"):
            self.register_buffer("ref", x.detach().mean(0))
        return self.lin(x - self.ref)


class Reregistered(Keeping):
    """A buffer registered anew at each call, from the input (each call reads its own;
    the module keeps the last call's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.register_buffer("ref", x.detach().mean(0))
        return self.lin(x) * self.ref


class BufferStep(Keeping):
    """A step kept in a buffer, registered anew at each call."""

    def fresh(self) -> dict[str, Any]:
        self.register_buffer("step", torch.zeros((), dtype=torch.float64))
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.register_buffer("step", self.step + 1)
        return self.lin(x) * self.step


class Constant(Keeping):
    """A buffer of constants registered at the first call: its calls still batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.full((4,), 2.0, dtype=x.dtype))
        return self.lin(x) * self.scale


class Calls(Keeping):
    """A count for statistics, which no operation reads."""

    def fresh(self) -> dict[str, Any]:
        return {"calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


class Counter(Keeping):
    """A count kept in a tensor, which the output does not read."""

    def fresh(self) -> dict[str, Any]:
        return {"count": torch.zeros(())}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.lin(x)


# Those whose calls run one at a time in recorded order (batchgraph.ordering).
IN_ORDER = (Step, Count, Halving, Counts, Steps, Held, Boxed, Slots, Registered,
            Reregistered, BufferStep)
PATTERNS: list[type[nn.Module]] = [*IN_ORDER, Cached, Constant]


test_a_forward_counting_or_keeping_on_objects_computes_as_eagerly = as_eagerly_test(
    PATTERNS, IN_ORDER)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("pattern", [Step, Count, Counts], ids=lambda p: p.__name__)
def test_coroutine_examples_counting_one_call_each_compute_as_eagerly_or_are_refused(
    pattern: type[nn.Module], groups: int,
) -> None:
    # One call per example: recorded in the eager order, the counts are eager's; run in
    # another order (lanes taking turns), the examples get the ordering error.
    torch.manual_seed(0)
    eager = Holder(nn.Sequential(nn.Identity(), pattern())).double()  # a grandchild's
    model = copy.deepcopy(eager)
    xs = [torch.randn(2, 4, dtype=torch.float64) for _ in range(4)]

    async def once(x: torch.Tensor) -> Any:
        return await bg.value(model.stub(x))

    want = [eager.stub(x) for x in xs]
    try:
        got = bg.run_all([once(x) for x in xs], groups=groups)
    except bg.CoroutineExampleError as err:
        assert groups > 1 and "keeps state of its own" in str(err)
        return
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)
    assert_like(state_of(model.inner[1]), state_of(eager.inner[1]), "state")


@pytest.mark.parametrize("pattern", [Calls, Counter, Tables, Cached, Constant],
                         ids=lambda p: p.__name__)
def test_a_cache_or_a_count_no_operation_reads_still_batches(pattern: type[nn.Module]) -> None:
    # A second and a third run make the same operations: the calls batch (their values
    # do not depend on what was kept).
    _batches_as_eagerly(Holder(pattern()))


def _batches_as_eagerly(model: Holder) -> None:
    """Four calls of ``model.stub`` give eager's values, batched."""
    xs = [torch.randn(3, 4) for _ in range(4)]
    eager = [model.stub(x) for x in xs]
    policy = bg.BatchingPolicy()
    with policy:
        handles = [model.stub(x) for x in xs]
    for got, want in zip(bg.compute(handles), eager, strict=True):
        torch.testing.assert_close(got, want)
    assert policy.stats is not None and policy.stats.unbatched_callables == ()
    assert policy.stats.launches < len(xs)


@pytest.mark.parametrize("pattern", [*IN_ORDER, Calls], ids=lambda p: p.__name__)
def test_state_kept_leaves_counts_and_objects_as_they_were(pattern: type[nn.Module]) -> None:
    from batchgraph.inference import on_fake_tensors
    from batchgraph.module_state import state_kept

    module = pattern()
    before = copy.deepcopy(state_of(module))
    with state_kept(module) as kept, on_fake_tensors():
        module(torch.empty(2, 4))
    assert kept.names
    assert_like(state_of(module), before, "state")


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::batchgraph.BatchedHooksWarning")
@pytest.mark.parametrize("norm", [nn.utils.weight_norm, nn.utils.spectral_norm],
                         ids=["weight_norm", "spectral_norm"])
def test_a_weight_a_pre_hook_makes_anew_at_each_call_still_batches(
    norm: Callable[[nn.Module], nn.Module],
) -> None:
    # The hook sets the module's weight anew at each call, from other tensors: no
    # state each call reads back, so no reason to run the calls one at a time.
    torch.manual_seed(0)
    _batches_as_eagerly(Holder(norm(nn.Linear(4, 4)).eval()))
