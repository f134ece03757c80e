"""A module's calls keep the train/eval mode they were recorded in.

Before: modules were held by reference, so a module switched with ``train()`` or
``eval()`` between recording and ``compute`` ran every pending call in its new mode
(dropout on or off, batch or running statistics): other values than the eager run,
silently. Now each call notes its module's mode; calls recorded in different modes
never batch together, and a batch whose module changed mode since is refused at
compute, before anything runs, naming the module and both modes. The same holds for
a submodule of the called module switched alone (noted at the module's first call
after each compute).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from tests.unit.pending_calls import compute_pending


class Moody(nn.Module):
    """Deterministic, and differs by mode: so a result tells which mode it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2.0 if self.training else y - 1.0


def _inputs(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(count)]


def test_a_module_switched_before_compute_is_refused_and_runs_once_switched_back() -> None:
    torch.manual_seed(0)
    module = Moody()
    site = bg.batched_func(module)
    xs = _inputs(4)
    want = [module(x) for x in xs]  # train mode
    with bg.BatchingPolicy() as policy:
        handles = [site(bg.batched_value(x)) for x in xs]
    module.eval()
    with pytest.raises(bg.ModuleModeChangedError, match=r"recorded in train mode, but the module is in eval mode"):
        policy.compute(handles)
    assert not any(h.computed for h in handles)  # refused before anything ran
    module.train()
    got = policy.compute(handles)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_calls_recorded_in_two_modes_never_merge() -> None:
    module = Moody()
    site = bg.batched_func(module)
    x = _inputs(1)[0]
    with bg.BatchingPolicy() as policy:
        h = bg.batched_value(x)
        trained = site(h)
        module.eval()
        evaluated = site(h)  # the same key and input: merged before, one node
    assert trained.node != evaluated.node
    assert policy.graph.node_key[trained.node] != policy.graph.node_key[evaluated.node]
    torch.testing.assert_close(policy.compute(evaluated), module(x))
    with pytest.raises(bg.ModuleModeChangedError, match="recorded in train mode"):
        policy.compute(trained)
    module.train()
    torch.testing.assert_close(policy.compute(trained), module(x))


def test_a_long_lived_graph_serves_across_a_mode_switch() -> None:
    """Calls computed before the switch and calls recorded after it: no false alarm
    (a check on the key alone would refuse the second batch)."""
    module = Moody()
    site = bg.batched_func(module)
    xs = _inputs(2)
    with bg.BatchingPolicy() as policy:
        first = policy.compute(site(bg.batched_value(xs[0])))
        module.eval()
        second = policy.compute(site(bg.batched_value(xs[1])))
    torch.testing.assert_close(second, module(xs[1]))
    module.train()
    torch.testing.assert_close(first, module(xs[0]))


def test_a_submodule_reached_through_a_batched_module_is_checked() -> None:
    class Model(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.block = Moody()

        def forward(self, x: Any) -> Any:
            return self.block(bg.batched_value(x))

    model = Model()
    with bg.BatchingPolicy() as policy:
        handle = model(_inputs(1)[0])
    model.eval()  # recursive: the block too
    with pytest.raises(bg.ModuleModeChangedError, match="Moody"):
        policy.compute(handle)


def test_vmapped_batchnorm_recorded_in_eval_then_trained_is_refused_clearly() -> None:
    # Used to fail inside vmap (batch statistics of one example).
    norm = nn.BatchNorm1d(3).double().eval()
    site = bg.batched_func(norm)
    with bg.BatchingPolicy() as policy:
        handle = site(bg.batched_value(torch.ones(2, 3, dtype=torch.float64)))
    norm.train()
    with pytest.raises(bg.ModuleModeChangedError, match="recorded in eval mode"):
        policy.compute(handle)


@given(st.lists(st.sampled_from(["record", "record", "switch", "compute"]), max_size=14))
def test_random_record_switch_compute_sequences_match_eager(ops: list[str]) -> None:
    """Each call computes as it would have eagerly, or compute is refused exactly when
    some pending call was recorded in the other mode."""
    torch.manual_seed(0)
    module = Moody()
    site = bg.batched_func(module)
    xs = _inputs(len(ops) + 1)
    pending: list[tuple[Any, torch.Tensor, bool]] = []  # handle, eager value, mode
    with bg.BatchingPolicy() as policy:
        for i, op in enumerate([*ops, "compute"]):
            if op == "record":
                with torch.no_grad():
                    want = module(xs[i])
                pending.append((site(bg.batched_value(xs[i])), want, module.training))
            elif op == "switch":
                module.train(not module.training)
            elif pending:
                stale = any(mode != module.training for _, _, mode in pending)
                compute_pending(policy, pending, bg.ModuleModeChangedError if stale else None)


def test_an_async_batcher_serves_across_a_mode_switch_between_requests() -> None:
    """The long-lived lane of a server: requests before a switch ran in one mode,
    requests after it in the other; no request is refused (a check on the key alone,
    tried before, refused the second wave)."""
    import asyncio

    module = Moody()
    site = bg.batched_func(module)
    xs = _inputs(6)

    async def request(x: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = await bg.value(site(bg.batched_value(x)))
        return value

    async def main() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        async with bg.AsyncBatcher(max_latency=0.005) as batcher:
            first = await asyncio.gather(*(batcher.run(request(x)) for x in xs[:3]))
            module.eval()
            second = await asyncio.gather(*(batcher.run(request(x)) for x in xs[3:]))
        return list(first), list(second)

    first, second = asyncio.run(main())
    with torch.no_grad():
        for x, got in zip(xs[3:], second):
            torch.testing.assert_close(got, module(x))
        module.train()
        for x, got in zip(xs[:3], first):
            torch.testing.assert_close(got, module(x))


class Block(nn.Module):
    """A module recorded as one call, with a submodule that differs by mode."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Moody()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 0.5


def test_a_submodule_switched_alone_before_compute_is_refused() -> None:
    block = Block().train()
    site = bg.batched_func(block)
    xs = _inputs(3)
    with torch.no_grad():
        expected = [block(x) for x in xs]
        with bg.BatchingPolicy() as policy:
            hs = [site(x) for x in xs]
        block.inner.eval()  # the submodule alone: the block itself stays in train mode
        with pytest.raises(bg.ModuleModeChangedError, match=r"submodule\(s\) inner\b"):
            policy.compute(hs)
        assert not any(h.computed for h in hs)
        block.inner.train()
        for got, want in zip(policy.compute(hs), expected, strict=True):
            torch.testing.assert_close(got, want)


def test_a_submodule_switched_between_computes_gives_eager_values() -> None:
    block = Block().train()
    site = bg.batched_func(block)
    x = _inputs(1)[0]
    with torch.no_grad():
        policy = bg.BatchingPolicy()
        with policy:
            before = site(x)
        torch.testing.assert_close(policy.compute(before), block(x))
        block.inner.eval()
        with policy:
            after = site(x)  # the same call in the new mode: neither merged nor refused
        assert after.node != before.node
        torch.testing.assert_close(policy.compute(after), block(x))


def test_a_submodule_switched_between_two_calls_without_a_compute_counts_for_both() -> None:
    # Calls note their module's own mode each; its submodules' modes only at a key's
    # first call after a compute, so the later call is refused too (documented).
    block = Block().train()
    site = bg.batched_func(block)
    xs = _inputs(2)
    with torch.no_grad(), bg.BatchingPolicy() as policy:
        site(xs[0])
        block.inner.eval()
        later = site(xs[1])
    with pytest.raises(bg.ModuleModeChangedError):
        policy.compute(later)


class NoisyInTraining(nn.Module):
    """Adds noise in training mode only: its run on fake tensors in eval mode meets
    no random op."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x) if self.training else x


class AuxInTraining(nn.Module):
    """Returns a second output in training mode only (as Inception's aux logits)."""

    def forward(self, x: torch.Tensor) -> Any:
        return (x * 2.0, x.sum()) if self.training else x * 2.0


def test_a_batchnorm_computed_in_eval_mode_then_trained_gives_eager_values() -> None:
    # Used to fail in vmap at the compute after the switch: the call's key, chosen
    # (and cached) in eval mode, was a vmap that cannot update running statistics.
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(3).double().eval()
    site = bg.batched_func(norm)
    xs = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        policy.compute([site(x) for x in xs])
    norm.train()
    with torch.no_grad():
        state = {k: v.clone() for k, v in norm.state_dict().items()}
        want = [norm(x) for x in xs]
        norm.load_state_dict(state)
    with bg.BatchingPolicy() as policy:
        got = policy.compute([site(x) for x in xs])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_a_layer_drawing_only_in_training_draws_per_example_after_a_switch() -> None:
    # Used to merge the identical calls recorded after the switch (found deterministic
    # in eval mode): both examples got one draw.
    site = bg.batched_func(NoisyInTraining().eval())
    x = torch.zeros(5)
    with bg.BatchingPolicy() as policy:
        policy.compute([site(x), site(x)])
    site.__wrapped__.train()
    with bg.BatchingPolicy() as policy:
        a, b = policy.compute([site(x), site(x)])
    assert not torch.equal(a, b)
    site.__wrapped__.eval()  # and back: no draw, the calls merge again
    with bg.BatchingPolicy() as policy:
        a, b = policy.compute([site(x), site(x)])
    assert torch.equal(a, x) and torch.equal(b, x)
    assert policy.stats.nodes == 1


@pytest.mark.parametrize("first", [True, False])
def test_a_module_whose_outputs_differ_by_mode_gives_eager_outputs_after_a_switch(
    first: bool,
) -> None:
    # Used to fail with BatchedCallError ("returned 2 tensors for a batch"): the
    # output spec was the one found in the first mode.
    module = AuxInTraining().train(first)
    site = bg.batched_func(module)
    xs = _inputs(3)
    for training in (first, not first, first):
        module.train(training)
        with bg.BatchingPolicy() as policy:
            got = policy.compute([site(x) for x in xs])
        for g, x in zip(got, xs, strict=True):
            want = module(x)
            assert type(g) is type(want)
            torch.testing.assert_close(g, want)


_MOODY = Moody()


def _reads_moody(x: torch.Tensor) -> torch.Tensor:
    """A function reading a module (a global here), recorded as one call."""
    return _MOODY(x) + 1.0


def test_a_function_whose_module_is_switched_before_compute_is_refused() -> None:
    # Used to compute in the module's new mode, silently unlike the eager run.
    _MOODY.train()
    site = bg.batched_func(_reads_moody)
    xs = _inputs(3)
    with torch.no_grad():
        want = [_reads_moody(x) for x in xs]
        with bg.BatchingPolicy() as policy:
            hs = [site(x) for x in xs]
        _MOODY.eval()
        with pytest.raises(bg.ModuleModeChangedError, match=r"module\(s\) Moody, Moody.lin read by"):
            policy.compute(hs)
        _MOODY.train()
        for got, w in zip(policy.compute(hs), want, strict=True):
            torch.testing.assert_close(got, w)


def test_a_function_reading_a_batchnorm_computed_in_eval_mode_then_trained_gives_eager_values() -> None:
    # Used to fail in vmap at the compute after the switch (the key found in eval mode).
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(3).double().eval()
    site = bg.batched_func(lambda x: norm(x) * 2.0)
    xs = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        policy.compute([site(x) for x in xs])
    norm.train()
    with torch.no_grad():
        state = {k: v.clone() for k, v in norm.state_dict().items()}
        want = [norm(x) * 2.0 for x in xs]
        norm.load_state_dict(state)
    with bg.BatchingPolicy() as policy:
        got = policy.compute([site(x) for x in xs])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
