"""A module's parameters (or a function's captured tensors) changed in place between
recording and compute.

A batched call reads its module's parameters when it runs; an eager call read them
when it was made. So an ``optimizer.step()`` (or any in-place update) after a call was
recorded and before it was computed is refused (``ParameterChangedError``), and calls
recorded after the change neither batch nor merge with those recorded before it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


def _model() -> tuple[bg.BatchedFunc, torch.optim.Optimizer]:
    torch.manual_seed(0)
    lin = bg.batched_func(nn.Linear(3, 3).double())
    return lin, torch.optim.SGD(lin.__wrapped__.parameters(), lr=0.5)


def _step(opt: torch.optim.Optimizer, lin: bg.BatchedFunc) -> None:
    lin.__wrapped__(torch.ones(3, dtype=torch.float64)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_an_optimizer_step_between_recording_and_compute_is_refused() -> None:
    lin, opt = _model()
    with bg.BatchingPolicy() as policy:
        h = lin(torch.ones(3, dtype=torch.float64))
    _step(opt, lin)
    with pytest.raises(bg.ParameterChangedError, match=r"Linear.*optimizer\.step\(\)"):
        policy.compute(h)
    assert not h.computed  # refused before anything ran


def test_an_in_place_update_is_refused_too() -> None:
    lin, _ = _model()
    with bg.BatchingPolicy() as policy:
        h = lin(torch.ones(3, dtype=torch.float64))
    with torch.no_grad():
        lin.__wrapped__.weight.mul_(0.5)
    with pytest.raises(bg.ParameterChangedError):
        policy.compute(h)


def test_a_training_loop_on_one_policy_computes_before_each_step() -> None:
    lin, opt = _model()
    x = torch.arange(3, dtype=torch.float64)
    policy = bg.BatchingPolicy()
    for _ in range(3):
        with policy:
            h = lin(x)  # identical call each time: merges only while weights stay
        value = policy.compute(h)
        torch.testing.assert_close(value, lin.__wrapped__(x))
        _step(opt, lin)


def test_calls_recorded_after_a_step_compute_while_older_ones_wait() -> None:
    lin, opt = _model()
    x = torch.arange(3, dtype=torch.float64)
    with bg.BatchingPolicy() as policy:
        before = lin(x)
    _step(opt, lin)
    with policy:
        after = lin(x)  # the same call, new weights: not merged with `before`
    assert after.node != before.node
    torch.testing.assert_close(policy.compute(after), lin.__wrapped__(x))
    with pytest.raises(bg.ParameterChangedError):
        policy.compute(before)


def test_a_change_between_two_calls_without_a_compute_counts_for_both() -> None:
    # Only computes and optimizer steps make calls note the parameters anew: after a
    # change made by hand in between, the later call is refused too (documented).
    lin, _ = _model()
    with bg.BatchingPolicy() as policy:
        lin(torch.ones(3, dtype=torch.float64))
        with torch.no_grad():
            lin.__wrapped__.bias.add_(1.0)
        later = lin(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(bg.ParameterChangedError):
        policy.compute(later)


@settings(deadline=None)
@given(actions=st.lists(st.tuples(st.sampled_from(["record", "compute", "step"]),
                                  st.integers(0, 1), st.integers(0, 7)), max_size=25))
def test_computes_give_eager_values_or_refuse_calls_from_before_a_step(
    actions: list[tuple[str, int, int]],
) -> None:
    """Two modules, each with its optimizer; calls recorded, computed and stepped in a
    random order. A compute gives each call the value its eager run gave at record
    time, or is refused when a call in it was recorded before its module stepped.
    The second module is called through a function closing over its weights."""
    torch.manual_seed(0)
    mods = [nn.Linear(2, 2).double(), nn.Linear(2, 2).double()]
    weight, bias = mods[1].weight, mods[1].bias
    sites = [
        bg.batched_func(mods[0]),
        bg.batched_func(lambda x: nn.functional.linear(x, weight, bias)),
    ]
    opts = [torch.optim.SGD(m.parameters(), lr=0.3) for m in mods]
    steps = [0, 0]
    policy = bg.BatchingPolicy()
    pending: list[tuple[bg.ResultHandle, torch.Tensor, int, int]] = []  # handle, eager, module, step
    for action, m, arg in actions:
        if action == "record":
            x = torch.full((2,), float(arg % 3), dtype=torch.float64)  # identical calls merge
            with torch.no_grad():
                eager = mods[m](x)
            with policy:
                pending.append((sites[m](x), eager, m, steps[m]))
        elif action == "step":
            mods[m](torch.ones(2, dtype=torch.float64)).sum().backward()
            opts[m].step()
            opts[m].zero_grad()
            steps[m] += 1
        elif pending:
            chosen = pending[arg % len(pending):][:2]
            # (A call merged into one computed already has its value: not stale.)
            stale = any(at != steps[mod] and not h.computed for h, _, mod, at in chosen)
            with torch.no_grad():
                if stale:
                    with pytest.raises(bg.ParameterChangedError):
                        policy.compute([h for h, *_ in chosen])
                    # Those from before a step can never compute now.
                    pending = [p for p in pending if p[3] == steps[p[2]] or p[0].computed]
                    continue
                got = policy.compute([h for h, *_ in chosen])
            for value, (_, eager, _, _) in zip(got, chosen, strict=True):
                torch.testing.assert_close(value, eager)
            pending = [p for p in pending if not any(p is c for c in chosen)]


def test_an_embedding_with_max_norm_is_not_taken_for_changed_by_shape_inference() -> None:
    # F.embedding renormalizes the weight in place (max_norm) by a call torch makes
    # within: each new signature's run on fake tensors left the weight's values but
    # moved its version counter, so the calls of the first signature were refused
    # at compute (ParameterChangedError) as if the weight had been changed.
    torch.manual_seed(0)
    embed = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        embed.weight.mul_(3.0)  # rows longer than max_norm: renormalized at lookup
    eager = nn.Embedding(10, 4, max_norm=1.0)
    eager.load_state_dict(embed.state_dict())
    site = bg.batched_func(embed)
    ids = [torch.tensor([1, 2, 3]), torch.tensor([3, 4]), torch.tensor([7]), torch.tensor([1, 2, 3])]
    want = [eager(i) for i in ids]
    version = embed.weight._version
    with bg.BatchingPolicy() as policy:
        handles = [site(i) for i in ids]  # three signatures
    assert embed.weight._version == version
    for got, w in zip(policy.compute(handles), want, strict=True):
        torch.testing.assert_close(got, w)
    torch.testing.assert_close(embed.weight, eager.weight)  # renormalized as eagerly


def _long_rows(seed: int) -> tuple[nn.Embedding, nn.Embedding]:
    """An embedding with max_norm whose rows are longer than it, and an eager copy."""
    torch.manual_seed(seed)
    embed = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        embed.weight.mul_(3.0)  # rows longer than max_norm: renormalized at lookup
    eager = nn.Embedding(10, 4, max_norm=1.0)
    eager.load_state_dict(embed.state_dict())
    return embed, eager


@settings(max_examples=20, deadline=None)
@given(
    ids=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=4), min_size=2, max_size=6),
    data=st.data(),
)
def test_embedding_lookups_with_max_norm_pending_across_computes_compute_as_eagerly(
    ids: list[list[int]], data: st.DataObject,
) -> None:
    # A compute's lookups renormalize the rows they read, in place: the lookups still
    # pending were refused at the next compute (ParameterChangedError), though eagerly
    # a renormalized row reads the same whichever lookup renormalized it first.
    embed, eager = _long_rows(len(ids))
    site = bg.batched_func(embed)
    tensors = [torch.tensor(i) for i in ids]
    want = [eager(i) for i in tensors]
    split = data.draw(st.integers(1, len(ids) - 1))
    with bg.BatchingPolicy() as policy:
        handles = [site(i) for i in tensors]
    got = policy.compute(handles[:split]) + policy.compute(handles[split:])
    for value, w in zip(got, want, strict=True):
        torch.testing.assert_close(value, w)
    torch.testing.assert_close(embed.weight, eager.weight)  # renormalized as eagerly
    torch.stack([v.sum() for v in got]).sum().backward()
    torch.stack([w.sum() for w in want]).sum().backward()
    assert embed.weight.grad is not None and eager.weight.grad is not None
    torch.testing.assert_close(embed.weight.grad, eager.weight.grad)


def test_a_tied_projection_pending_across_a_renormalizing_lookup_is_still_refused() -> None:
    # Another callable reading the weight read its rows as they were at its time:
    # eagerly before the lookup renormalized them.
    embed, _ = _long_rows(0)
    site = bg.batched_func(embed)
    project = bg.batched_func(lambda h: embed.weight @ h)
    with bg.BatchingPolicy() as policy:
        projected = project(torch.ones(4))
        looked_up = site(torch.tensor([1, 2]))
    policy.compute(looked_up)
    with pytest.raises(bg.ParameterChangedError, match="changed in place"):
        policy.compute(projected)


@pytest.mark.parametrize("lookups_first", [True, False])
@pytest.mark.parametrize("deeper", ["lookups", "projections", "neither"])
def test_a_tied_projection_computed_with_renormalizing_lookups_as_eagerly_or_refused(
    lookups_first: bool, deeper: str,
) -> None:
    # Eagerly each projection read the rows as the lookups recorded before it left
    # them. The schedule runs the shallower calls first: in the recorded order where
    # the later ones are deeper, out of it where the earlier ones are, which computed
    # every projection as if recorded before every lookup, or after, silently (0.4+
    # off eager).
    embed, eager = _long_rows(1)
    site = bg.batched_func(embed)
    project = bg.batched_func(lambda h: embed.weight @ h)
    ids, hs = [torch.tensor([i, i + 1]) for i in range(3)], [torch.ones(4) * i for i in range(3)]
    if lookups_first:  # eagerly, in the recorded order
        want = [eager(i) for i in ids] + [eager.weight @ h for h in hs]
    else:
        want = [eager.weight @ h for h in hs] + [eager(i) for i in ids]
    with bg.BatchingPolicy() as policy:
        def lookups() -> list[Any]:
            return [site(bg.batched_value(i) * 1 if deeper == "lookups" else i) for i in ids]

        def projections() -> list[Any]:
            return [project(bg.batched_value(h) * 1 if deeper == "projections" else h)
                    for h in hs]

        handles = lookups() + projections() if lookups_first else projections() + lookups()
    later = "projections" if lookups_first else "lookups"
    try:
        got = policy.compute(handles)
    except bg.ParameterChangedError as e:
        assert "renormalize rows of that weight" in str(e)
        assert deeper != later  # in the recorded order: computed, not refused
        return
    for value, w in zip(got, want, strict=True):
        torch.testing.assert_close(value, w)
    assert deeper in (later, "neither")  # out of it: refused


def test_a_tied_projection_recorded_after_computed_lookups_computes_as_eagerly() -> None:
    # What the refusal says to do: the lookups first, then the projections recorded.
    embed, eager = _long_rows(1)
    site = bg.batched_func(embed)
    project = bg.batched_func(lambda h: embed.weight @ h)
    ids, hs = [torch.tensor([i, i + 1]) for i in range(3)], [torch.ones(4) * i for i in range(3)]
    want = [eager(i) for i in ids] + [eager.weight @ h for h in hs]
    with bg.BatchingPolicy() as policy:
        got = policy.compute([site(i) for i in ids])
        got += policy.compute([project(h) for h in hs])
    for value, w in zip(got, want, strict=True):
        torch.testing.assert_close(value, w)


def test_lookups_renormalizing_nothing_compute_with_a_tied_projection() -> None:
    # Rows within max_norm: the lookups change nothing, so nothing is refused.
    embed, eager = _long_rows(2)
    for e in (embed, eager):
        with torch.no_grad():
            torch.embedding_renorm_(e.weight, torch.arange(10), 1.0, 2.0)
    site = bg.batched_func(embed)
    project = bg.batched_func(lambda h: embed.weight @ h)
    ids, h = [torch.tensor([0, 5]), torch.tensor([9])], torch.ones(4)
    with bg.BatchingPolicy() as policy:
        handles = [site(i) for i in ids] + [project(h)]
    want = [eager(i) for i in ids] + [eager.weight @ h]
    for value, w in zip(policy.compute(handles), want, strict=True):
        torch.testing.assert_close(value, w)
