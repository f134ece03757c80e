"""A fused optimizer step (``Adam(fused=True)``, ...) between recording and compute.

A fused step updates the parameters in one kernel that leaves their version counters
as they were, so batchgraph, which watches those counters, took the weights for
unchanged: calls recorded before the step computed with the new weights (eagerly they
used the old ones), and an identical call recorded after it merged with one recorded
before. A fused step now counts as the change it is, as a ``foreach`` step does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.data.trees import Tree
from batchgraph.models.treelstm import TreeLSTMClassifier

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

FUSED: dict[str, Make] = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.1, fused=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


def _trained(make: Make) -> tuple[nn.Linear, bg.BatchedFunc, torch.optim.Optimizer]:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    opt = make(list(lin.parameters()))
    lin(torch.ones(3)).sum().backward()
    return lin, bg.batched_func(lin), opt


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_fused_step_between_recording_and_compute_is_refused(name: str) -> None:
    lin, site, opt = _trained(FUSED[name])
    x = torch.arange(3.0)
    with bg.BatchingPolicy() as policy:
        before = site(x)
    opt.step()
    with policy:
        after = site(x)  # the same call, new weights: not merged with `before`
    assert after.node != before.node
    torch.testing.assert_close(policy.compute(after), lin(x))
    with pytest.raises(bg.ParameterChangedError, match=r"optimizer\.step\(\)"):
        policy.compute(before)


def test_a_parameter_without_a_gradient_is_not_taken_for_changed() -> None:
    # The step skips it (its weights stay): its calls still compute.
    torch.manual_seed(0)
    used, idle = nn.Linear(3, 3), nn.Linear(3, 3)
    opt = torch.optim.Adam([*used.parameters(), *idle.parameters()], fused=True)
    used(torch.ones(3)).sum().backward()
    with bg.BatchingPolicy() as policy:
        h = bg.batched_func(idle)(torch.ones(3))
    opt.step()
    torch.testing.assert_close(policy.compute(h), idle(torch.ones(3)))


TREES = [Tree.from_nested((1, (2, 3))), Tree.leaf(4), Tree.from_nested(((5, 6), (7, 8))),
         Tree.from_nested((((1, 2), 3), 4))]


@settings(deadline=None, max_examples=8)
@given(seed=st.integers(0, 2**16), batch=st.lists(st.integers(0, len(TREES) - 1),
                                                   min_size=1, max_size=4),
       name=st.sampled_from(sorted(FUSED)))
def test_training_with_a_fused_optimizer_follows_eager_training(
    seed: int, batch: list[int], name: str
) -> None:
    """Parameters after each step as eagerly; a batch recorded before a step (a loader
    working ahead) and computed after it is refused."""
    torch.manual_seed(seed)
    eager = TreeLSTMClassifier(10, 3, hidden=4).double()
    model = copy.deepcopy(eager)
    opts = [FUSED[name](list(m.parameters())) for m in (eager, model)]
    trees, labels = [TREES[i] for i in batch], torch.tensor([i % 3 for i in batch])
    for _ in range(3):
        with bg.BatchingPolicy() as policy:
            handles = [model.logits(t) for t in trees]
        losses = [F.cross_entropy(torch.stack([eager.logits(t) for t in trees]), labels),
                  F.cross_entropy(torch.stack(policy.compute(handles)), labels)]
        with bg.BatchingPolicy() as ahead:
            stale = [model.logits(t) for t in trees]
        for loss, opt in zip(losses, opts, strict=True):
            opt.zero_grad()
            loss.backward()
            opt.step()
        for p, q in zip(eager.parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
        with pytest.raises(bg.ParameterChangedError):
            ahead.compute(stale)
