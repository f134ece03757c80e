"""Modules whose forward keeps a tensor it makes (a mask made once, a rotary table
cached per length, the last output, a dict or list of tensors) compute as eagerly,
and leave their attributes as eager calls do: real tensors of per-example shapes.

Before: the run on fake tensors that learns a new signature's output kept its fake
tensor in the module (the compute and every later eager call failed: "aten.allclose:
DataDependentOutputException", or returned fake tensors); and where that was undone,
vmap's run kept the batch's tensor, escaped from vmap, and a forward reading it back
(``if self.ref is None: self.ref = x``) gave each example its own where eagerly later
calls read the first one's: other values, silently.
"""

from __future__ import annotations

import asyncio
import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import batchgraph as bg


class Keeping(nn.Module):
    """A linear layer and the attributes ``fresh`` gives, set anew per instance."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        for name, value in self.fresh().items():
            setattr(self, name, value)

    def fresh(self) -> dict[str, Any]:
        return {}


class Mask(Keeping):
    """A mask made at the first call, from the input's shape only."""

    def fresh(self) -> dict[str, Any]:
        return {"mask": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            self.mask = torch.ones_like(x[0]) * 2
        return self.lin(x) * self.mask


class Reference(Keeping):
    """A reference taken from the first call's values, read by the later ones."""

    def fresh(self) -> dict[str, Any]:
        return {"ref": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ref is None:
            self.ref = x.detach().mean(0)
        return self.lin(x - self.ref)


class Bound(Keeping):
    """As ``Reference``, with no torch op in the branch (the example's input itself)."""

    def fresh(self) -> dict[str, Any]:
        return {"ref": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ref is None:
            self.ref = x
        return self.lin(x - self.ref[:1])


class Last(Keeping):
    """Keeps its last output (for inspection)."""

    def fresh(self) -> dict[str, Any]:
        return {"last": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.lin(x))
        self.last = out
        return out


class Rotary(Keeping):
    """A table cached per length, grown when a longer input comes."""

    def fresh(self) -> dict[str, Any]:
        return {"cached_len": 0, "cos": None}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n > self.cached_len:
            self.cos = torch.cos(torch.arange(n, dtype=x.dtype))[:, None]
            self.cached_len = n
        assert self.cos is not None
        return self.lin(x) * self.cos[:n]


class Tables(Keeping):
    """Tables kept in a dict by length."""

    def fresh(self) -> dict[str, Any]:
        return {"tables": {}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in self.tables:
            self.tables[n] = torch.linspace(0, 1, n, dtype=x.dtype)[:, None]
        return self.lin(x) + self.tables[n]


class History(Keeping):
    """Appends each output to a list of its own."""

    def fresh(self) -> dict[str, Any]:
        return {"seen": []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.seen.append(out.detach())
        return out


class Recent(Keeping):
    """Keeps its last two outputs in a deque."""

    def fresh(self) -> dict[str, Any]:
        return {"recent": collections.deque(maxlen=2)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        self.recent.append(out.detach())
        return out


class Nested(Keeping):
    """A reference kept in a dict inside a dict (a per-layer cache): only the inner
    dict changes."""

    def fresh(self) -> dict[str, Any]:
        return {"cache": {"layer": {}}}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.cache["layer"]
        if "ref" not in inner:
            inner["ref"] = x.detach().mean(0)
        return self.lin(x - inner["ref"])


class Running(Keeping):
    """A total carried from call to call (each call reads the earlier ones')."""

    def fresh(self) -> dict[str, Any]:
        return {"total": torch.zeros(4)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) + self.total
        self.total = self.total + x.detach().sum(0)
        return out


class RunningInPlace(Keeping):
    """A total carried from call to call in place (the tensor attribute stays the same
    object): runs on fake tensors skip the change, so nothing is left to put back, but
    batched calls of another length ran before it, silently (outputs off)."""

    def fresh(self) -> dict[str, Any]:
        return {"total": torch.zeros(4)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total += x.detach().sum(0)
        return self.lin(x) + self.total


PATTERNS: list[type[nn.Module]] = [
    Mask, Reference, Bound, Last, Rotary, Tables, History, Recent, Nested, Running,
    RunningInPlace,
]
# Those whose calls run one at a time in recorded order: the tensor kept is the batch's
# under vmap (batchgraph.ordering).
IN_ORDER = (Mask, Reference, Bound, Last, History, Recent, Nested, Running, RunningInPlace)


class Holder(bg.BatchedModule):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def stub(self, x: Any) -> Any:  # the module through its recording stub
        return self.inner(x).sum(0)

    @bg.batched_func
    def method(self, x: torch.Tensor) -> torch.Tensor:  # a decorated method
        return self.inner(x).sum(0) * 2

    async def coroutine(self, x: Any) -> Any:  # awaits its value in the middle
        h = self.inner(x)
        h = await bg.value(h)
        return self.inner(h).sum(0)


def _function(model: Holder) -> Callable[[Any], Any]:
    def apply(x: torch.Tensor) -> torch.Tensor:  # a function reading the module
        return model.inner(x).sum(0) - 1
    return bg.batched_func(apply)


ENTRIES = ["stub", "method", "function", "coroutine"]


def run_entry(model: Holder, entry: str, xs: list[torch.Tensor], batched: bool) -> list[torch.Tensor]:
    if entry == "coroutine":
        if batched:
            return list(bg.run_all([model.coroutine(x) for x in xs]))
        return [asyncio.run(model.coroutine(x)) for x in xs]
    if entry == "function":
        f: Callable[[Any], Any] = _function(model)
    else:
        f = getattr(model, entry)
    if not batched:
        return [f(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [f(x) for x in xs]
    return list(bg.compute(handles))


def assert_like(got: Any, want: Any, where: str) -> None:
    """An attribute left as eager code leaves it: a real tensor of its shape and
    values (no fake tensor, none of vmap's), or the same numbers and containers."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert not isinstance(got, FakeTensor), where
        assert not torch._C._functorch.is_functorch_wrapped_tensor(got), where
        torch.testing.assert_close(got.detach(), want.detach(), msg=where)
    elif isinstance(want, (list, tuple, collections.deque)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_like(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_like(got[k], want[k], f"{where}[{k!r}]")
    elif hasattr(want, "__dict__") or hasattr(type(want), "__slots__"):  # a plain object
        assert type(got) is type(want), where
        assert_like(_fields(got), _fields(want), where)
    else:
        assert got == want, where


def _fields(obj: Any) -> dict[str, Any]:
    return {**getattr(obj, "__dict__", {}),
            **{name: getattr(obj, name) for name in getattr(type(obj), "__slots__", ())}}


def state_of(module: nn.Module) -> dict[str, Any]:
    """The attributes and buffers a forward may keep (not the module's own)."""
    return {**{k: v for k, v in vars(module).items()
               if not k.startswith("_") and k != "training"},
            **{f"buffer {k}": v for k, v in module.named_buffers(recurse=False)}}


def as_eagerly_test(patterns: list[type[nn.Module]], in_order: tuple[type[nn.Module], ...]
                    ) -> Callable[..., None]:
    """The test that each of ``patterns``, through each entry, computes as eagerly
    (``check_as_eagerly``), over lists of lengths."""

    @pytest.mark.parametrize("entry", ENTRIES)
    @pytest.mark.parametrize("pattern", patterns, ids=lambda p: p.__name__)
    @settings(max_examples=3, deadline=None)
    @given(lengths=st.lists(st.integers(1, 3), min_size=1, max_size=4),
           seed=st.integers(0, 99))
    def test(entry: str, pattern: type[nn.Module], lengths: list[int], seed: int) -> None:
        check_as_eagerly(entry, pattern, lengths, seed, pattern in in_order)

    return test


test_a_forward_keeping_tensors_computes_and_leaves_them_as_eagerly = as_eagerly_test(
    PATTERNS, IN_ORDER)


def check_as_eagerly(entry: str, pattern: type[nn.Module], lengths: list[int], seed: int,
                     in_order: bool) -> None:
    """Two rounds of ``pattern``'s calls through ``entry``, batched and eagerly: the
    same values, gradients and state left (``in_order``: coroutine examples are
    refused, as their calls keep state of their own)."""
    torch.manual_seed(seed)
    eager = Holder(pattern()).double()
    model = copy.deepcopy(eager)
    xs = [torch.randn(n, 4, dtype=torch.float64) for n in lengths]
    if entry == "coroutine" and in_order and len(xs) > 1:
        # run_all interleaves the examples' calls, where eagerly each example runs
        # to its end first: with state carried across calls, refused.
        with pytest.raises(bg.CoroutineExampleError, match="keeps state of its own"):
            run_entry(model, entry, xs, batched=True)
        return
    for round_ in range(2):  # the second round starts from what the first left
        runs_alike(model, eager, entry, xs, f"round {round_}")
    # and a later eager call computes with it as eagerly
    x = torch.randn(lengths[0], 4, dtype=torch.float64)
    torch.testing.assert_close(model.inner(x), eager.inner(x))


def runs_alike(model: Holder, eager: Holder, entry: str, xs: list[torch.Tensor],
               where: str) -> None:
    """``xs`` through ``entry`` of ``model`` batched and of ``eager`` eagerly: the same
    values, gradients and state left in ``inner``."""
    want = run_entry(eager, entry, xs, batched=False)
    got = run_entry(model, entry, xs, batched=True)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w)
    torch.autograd.backward([w.sum() for w in want])
    torch.autograd.backward([g.sum() for g in got])
    for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
        assert b.grad is not None and a.grad is not None
        torch.testing.assert_close(b.grad, a.grad, msg=f"{name}, {where}")
    assert_like(state_of(model.inner), state_of(eager.inner), where)


def test_the_shapes_only_cache_still_batches() -> None:
    # A table made from lengths only (no batched tensor in it) is no reason to run
    # the examples one at a time: vmap's run keeps a real table of its own.
    model = Holder(Rotary())
    xs = [torch.randn(3, 4) for _ in range(4)]
    with bg.BatchingPolicy() as policy:
        handles = [model.stub(x) for x in xs]
    bg.compute(handles)
    assert "Rotary" not in policy.stats.unbatched_callables
    assert policy.stats.launches < len(xs)


def test_a_forward_keeping_a_batched_tensor_runs_one_example_at_a_time() -> None:
    model = Holder(Bound())
    with bg.BatchingPolicy() as policy:
        handles = [model.stub(torch.randn(2, 4)) for _ in range(3)]
    bg.compute(handles)
    assert policy.stats.unbatched_callables == ("Bound",)


def test_state_kept_names_what_it_undid() -> None:
    from batchgraph.inference import on_fake_tensors
    from batchgraph.module_state import state_kept

    module = Tables()
    module.tables[1] = real = torch.zeros(1, 1)
    with state_kept(module) as kept, on_fake_tensors():
        module(torch.empty(2, 4))
    assert kept.names == ["Tables.tables"] and not kept.batched
    assert module.tables == {1: real}


def test_state_carried_across_calls_counts_each_call_in_recorded_order() -> None:
    # Identical calls of two examples are not merged into one (the total counts both),
    # and a later example's value asked for first still follows the earlier calls.
    torch.manual_seed(0)
    eager = Holder(Running())
    model = copy.deepcopy(eager)
    x = torch.randn(2, 4)
    xs = [x, x, torch.randn(1, 4), x]
    want = [eager.stub(v) for v in xs]
    with bg.BatchingPolicy():
        handles = [model.stub(v) for v in xs]
    torch.testing.assert_close(bg.compute(handles[2]), want[2])
    for w, g in zip(want, bg.compute(handles), strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(model.inner.total, eager.inner.total)


def test_the_depth_scheduler_refuses_to_reorder_state_carried_across_calls() -> None:
    model = Holder(Running())
    with bg.BatchingPolicy(scheduler="depth"):
        deep = model.stub(model.stub(torch.randn(1, 4)).expand(2, 4))  # two calls deep
        shallow = model.stub(torch.randn(2, 4))  # recorded after, one call deep
    with pytest.raises(bg.BatchgraphError, match="order they were recorded"):
        bg.compute([deep, shallow])
