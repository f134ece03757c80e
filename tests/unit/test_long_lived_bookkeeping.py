"""A policy kept for a whole training loop keeps bookkeeping bounded, not growing
with every step.

Parameter versions are part of a key's identity, so each optimizer step gives every
module a new key id and a dozen notes of it; values handed out, answers about
gradients and each released store were noted too, for the policy's life (250 to 340 bytes a
recorded call in a small training loop, with a few kilobytes a module a step). What
stays is five list slots a node. Values and gradients must still equal eager code's,
however often what nothing can reach is forgotten.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.graph import STORE_SHIFT
from tests.releaser_slack import forgetting_every


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    eager = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    batched = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    batched.load_state_dict(eager.state_dict())
    return eager, batched


def _train(policy: bg.BatchingPolicy, steps: int, examples: int = 5,
           traced: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Train a batched model and an eager copy side by side in ``policy``; check each
    step's loss and the parameters; return the graph's note counts after each step.
    ``traced``: the nodes recorded and the bytes traced so far, after the steps it
    names (keys)."""
    eager, batched = _pair()
    first, second = bg.batched_func(batched[0]), bg.batched_func(batched[2])
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(batched.parameters(), lr=0.05)
    graph = policy.graph
    counts = []
    gen = torch.Generator().manual_seed(1)
    with policy:
        for _ in range(steps):
            xs = [torch.randn(4, dtype=torch.float64, generator=gen) for _ in range(examples)]
            outs = policy.compute([second(first(x).tanh()) for x in xs])
            loss = sum((o ** 2).sum() for o in outs)
            want = sum((eager(x) ** 2).sum() for x in xs)
            assert isinstance(loss, torch.Tensor) and isinstance(want, torch.Tensor)
            torch.testing.assert_close(loss, want)
            loss.backward()
            want.backward()
            opt_b.step()
            opt_e.step()
            opt_b.zero_grad()
            opt_e.zero_grad()
            counts.append(len(graph.key_ids) + len(graph.key_versions) + len(graph.key_params)
                          + len(graph.key_grad) + len(graph.handed_out) + len(graph.node_grad))
            if traced is not None and len(counts) in traced:
                gc.collect()
                traced[len(counts)] = (len(graph), tracemalloc.get_traced_memory()[0])
    for p, q in zip(batched.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q)
    return counts


@pytest.mark.parametrize("dedupe", [True, False])
@pytest.mark.parametrize("slack", [0, 64])
def test_a_training_loop_in_one_policy_keeps_its_notes_bounded(dedupe: bool, slack: int) -> None:
    # dedupe=False: nothing is noted for merging, so only the nodes recorded since
    # the last pass bring the next one on.
    with forgetting_every(slack):
        counts = _train(bg.BatchingPolicy(dedupe=dedupe), steps=60)
    assert max(counts[30:]) <= max(counts[:30])  # bounded, not one more set a step
    assert counts[-1] < 60


def test_released_stores_and_their_locations_are_one_object_each() -> None:
    with forgetting_every(0):
        policy = bg.BatchingPolicy()
        _train(policy, steps=20)
    graph = policy.graph
    released = [s for s in graph.stores if not s]
    assert len(released) > 20
    assert len({id(s) for s in released}) == 1
    computed = graph.node_loc[: graph.first_uncomputed]
    gone = [loc for loc in computed if not graph.stores[loc >> STORE_SHIFT]]
    assert len(gone) > 100
    assert len({id(loc) for loc in gone}) == 1


def test_bytes_a_recorded_call_leaves_behind_in_a_long_training_loop() -> None:
    traced = {100: (0, 0), 400: (0, 0)}  # from step 100 on: one-off costs are paid
    with forgetting_every(256):
        tracemalloc.start()
        try:
            policy = bg.BatchingPolicy()
            _train(policy, steps=400, traced=traced)
        finally:
            tracemalloc.stop()
    (nodes, before), (nodes_after, after) = traced[100], traced[400]
    per_call = (after - before) / (nodes_after - nodes)
    # Five list slots a node (40 bytes) and a share of each step's store slots: was
    # 337 bytes before key ids, handed-out notes and released stores were forgotten.
    print(f"{per_call:.1f} bytes a call")
    assert per_call < 80, per_call


def test_a_module_left_unused_until_its_key_is_forgotten_computes_and_batches_again() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3).double(), nn.Linear(3, 3).double()
    site_a, site_b = bg.batched_func(a), bg.batched_func(b)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with forgetting_every(0), bg.BatchingPolicy() as policy:
        first = policy.compute([site_b(x) for x in xs])
        for _ in range(5):  # b's key id is forgotten meanwhile; a's change every step
            loss = sum(o.sum() for o in policy.compute([site_a(x) for x in xs]))
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert not any(key.fn is b for key, *_ in policy.graph.key_ids)
        again = policy.compute([site_b(x) for x in xs])
        assert policy.stats.launches == 1  # one call of b for the four
    for x, f, g in zip(xs, first, again):
        torch.testing.assert_close(f, b(x))
        torch.testing.assert_close(g, b(x))


def test_a_handle_kept_across_steps_that_forget_keys_still_reads_and_records() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    site = bg.batched_func(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(3, dtype=torch.float64)
    with forgetting_every(0), bg.BatchingPolicy() as policy:
        kept = site(x)
        old = policy.compute(kept).detach().clone()
        for _ in range(4):
            out = policy.compute(site(torch.randn(3, dtype=torch.float64)))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
        later = policy.compute(site(kept))  # the kept value, through today's weights
        torch.testing.assert_close(policy.compute(kept), old)
    torch.testing.assert_close(later, lin(old))


def test_a_call_recorded_before_a_step_is_still_refused_after_forgetting() -> None:
    lin = nn.Linear(3, 3)
    site = bg.batched_func(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with forgetting_every(0), bg.BatchingPolicy() as policy:
        for _ in range(3):  # passes of forgetting run, with this call pending
            pending = site(torch.ones(3))
            policy.compute(site(torch.zeros(3))).sum().backward()
            opt.step()
            opt.zero_grad()
            with pytest.raises(bg.ParameterChangedError):
                policy.compute(pending)


@pytest.mark.parametrize("handed_out", [True, False])
def test_a_held_value_read_from_a_released_one_still_requires_grad(handed_out: bool) -> None:
    # n = m * 2 is held while m's value is released and its notes forgotten: handed
    # out again, n must still carry x's gradient, as eagerly (it came back detached).
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    site, tanh = bg.batched_func(lin), bg.batched_func(torch.tanh)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    with forgetting_every(0), bg.BatchingPolicy() as policy:
        m = tanh(x)
        policy.compute(m if handed_out else site(m))
        n = m * 2
        policy.compute(site(n))
        del m
        policy.releaser.step()
        out = policy.compute(n)
        again = policy.compute(n * 3)  # a new call on it
    assert out.requires_grad and again.requires_grad
    (out.sum() + again.sum()).backward()
    expected = torch.autograd.grad((torch.tanh(x) * 2).sum() * 4, x)[0]
    torch.testing.assert_close(x.grad, expected)
