"""Parameters frozen or unfrozen (``requires_grad_``) between recording and compute.

Eagerly a call computes with its parameters' ``requires_grad`` as it is when the call
is made: a layer frozen after a forward pass still gets its gradient from it at
``backward()``, and one unfrozen after it gets none. A batched call reads the setting
when it computes, so a switch in between silently moved gradients (a frozen layer got
none, an unfrozen one got one and was then stepped). Now refused at compute, as a
change of the parameters' values is; freezing between computes trains as eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from batchgraph.data.trees import Tree
from batchgraph.models.treelstm import TreeLSTMClassifier

TREES = [Tree.from_nested((1, (2, 3))), Tree.leaf(4), Tree.from_nested(((5, 6), (7, 8))),
         Tree.from_nested((((1, 2), 3), 4)), Tree.leaf(9)]
LAYERS = ("embed", "leaf", "cell", "out")


def _model(seed: int) -> TreeLSTMClassifier:
    torch.manual_seed(seed)
    return TreeLSTMClassifier(10, 3, hidden=4).double()


@pytest.mark.parametrize("freeze", [True, False])
def test_a_switch_between_recording_and_compute_is_refused(freeze: bool) -> None:
    model = _model(0)
    model.out.requires_grad_(not freeze)
    with bg.BatchingPolicy() as policy:
        handles = [model.logits(t) for t in TREES]
    model.out.requires_grad_(freeze)
    with pytest.raises(bg.ParameterChangedError, match=r"'weight', 'bias' of .*Linear.*requires_grad"):
        policy.compute(handles)
    model.out.requires_grad_(not freeze)  # switched back: computes
    assert len(policy.compute(handles)) == len(TREES)


def test_a_function_reading_a_tensor_frozen_since_is_refused() -> None:
    w = torch.ones(3, requires_grad=True)
    scale = bg.batched_func(lambda x: x * w)
    with bg.BatchingPolicy() as policy:
        h = scale(torch.ones(3))
    w.requires_grad_(False)
    with pytest.raises(bg.ParameterChangedError, match=r"'tensor #0'"):
        policy.compute(h)


@settings(deadline=None, max_examples=10)
@given(seed=st.integers(0, 2**16),
       plan=st.lists(st.tuples(st.lists(st.integers(0, len(TREES) - 1), min_size=1, max_size=4),
                               st.sampled_from(LAYERS), st.booleans()),
                     min_size=1, max_size=4))
def test_freezing_layers_between_steps_trains_as_eagerly(
    seed: int, plan: list[tuple[list[int], str, bool]]
) -> None:
    """Each step: a batch recorded, computed and stepped, then a layer frozen or
    unfrozen. Parameters and which have gradients as eagerly after each step; a batch
    recorded before the switch (a loader working ahead) is refused where the switch
    reached a layer it calls."""
    eager = _model(seed)
    model = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    for batch, layer, grad in plan:
        trees, labels = [TREES[i] for i in batch], torch.tensor([i % 3 for i in batch])
        with bg.BatchingPolicy() as policy:
            handles = [model.logits(t) for t in trees]
        losses = [F.cross_entropy(torch.stack([eager.logits(t) for t in trees]), labels),
                  F.cross_entropy(torch.stack(policy.compute(handles)), labels)]
        for loss, opt in zip(losses, opts, strict=True):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)
        with bg.BatchingPolicy() as ahead:
            stale = [model.logits(t) for t in trees]
        switched = next(getattr(model, layer).parameters()).requires_grad != grad
        for m in (eager, model):
            getattr(m, layer).requires_grad_(grad)
        if switched and (layer != "cell" or any(t.token is None for t in trees)):
            with pytest.raises(bg.ParameterChangedError, match="requires_grad"):
                ahead.compute(stale)
        else:
            ahead.compute(stale)
