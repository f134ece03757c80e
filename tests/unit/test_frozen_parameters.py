"""Parameters frozen or unfrozen (``requires_grad_``) between recording and compute.

Eagerly a call's value is computed with its parameters' ``requires_grad`` as it is
when the call is made, and a backward accumulates only into those that require grad
then. A layer unfrozen after its calls were recorded therefore gets no gradient from
them eagerly, but a batched call reads the setting when it computes: the layer got a
gradient (and was stepped), silently. Refused at compute now. A layer frozen in
between gets no gradient either way, and computes.
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


def test_a_layer_unfrozen_between_recording_and_compute_is_refused() -> None:
    model = _model(0)
    model.out.requires_grad_(False)
    with bg.BatchingPolicy() as policy:
        handles = [model.logits(t) for t in TREES]
    model.out.requires_grad_(True)
    with pytest.raises(bg.ParameterChangedError, match=r"'weight', 'bias' of .*Linear.*requires_grad"):
        policy.compute(handles)
    model.out.requires_grad_(False)  # switched back: computes
    assert len(policy.compute(handles)) == len(TREES)


def test_a_function_reading_a_tensor_unfrozen_since_is_refused() -> None:
    w = torch.ones(3, requires_grad=False)
    scale = bg.batched_func(lambda x: x * w)
    with bg.BatchingPolicy() as policy:
        h = scale(torch.ones(3))
    w.requires_grad_(True)
    with pytest.raises(bg.ParameterChangedError, match=r"'tensor #0'"):
        policy.compute(h)


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 2**16),
       plan=st.lists(st.tuples(st.lists(st.integers(0, len(TREES) - 1), min_size=1, max_size=4),
                               st.sampled_from(LAYERS), st.booleans()),
                     min_size=1, max_size=5))
def test_switching_layers_between_recording_and_backward_trains_as_eagerly(
    seed: int, plan: list[tuple[list[int], str, bool]]
) -> None:
    """Each step: a batch recorded (eagerly: run), a layer frozen or unfrozen, then
    computed, backward and stepped. Parameters, and which have gradients, as eagerly
    after each step; refused exactly where a layer the batch calls was unfrozen (the
    step is then skipped on both sides)."""
    eager = _model(seed)
    model = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, model)]
    for batch, layer, grad in plan:
        trees, labels = [TREES[i] for i in batch], torch.tensor([i % 3 for i in batch])
        with bg.BatchingPolicy() as policy:
            handles = [model.logits(t) for t in trees]
        eager_loss = F.cross_entropy(torch.stack([eager.logits(t) for t in trees]), labels)
        unfrozen = grad and not next(getattr(model, layer).parameters()).requires_grad
        for m in (eager, model):
            getattr(m, layer).requires_grad_(grad)
        if unfrozen and (layer != "cell" or any(t.token is None for t in trees)):
            with pytest.raises(bg.ParameterChangedError, match="requires_grad"):
                policy.compute(handles)
            continue
        losses = [eager_loss, F.cross_entropy(torch.stack(policy.compute(handles)), labels)]
        if not losses[1].requires_grad:
            # Every layer it used frozen since: eagerly a backward gives no gradient
            # (it raises batched: the value was computed without grad).
            if eager_loss.requires_grad:
                opts[0].zero_grad(set_to_none=True)
                eager_loss.backward()
                assert all(p.grad is None for p in eager.parameters())
            continue
        for loss, opt in zip(losses, opts, strict=True):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            torch.testing.assert_close(p, q, rtol=0, atol=1e-10)


class _Scaled(bg.BatchedModule):
    """Reads a parameter directly in per-example code: recorded as a constant input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.scale).sum()


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 2**16),
       flags=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=4),
       scale=st.tuples(st.booleans(), st.booleans()))
def test_tensors_read_as_inputs_get_gradients_as_they_required_grad_when_recorded(
    seed: int, flags: list[tuple[bool, bool]], scale: tuple[bool, bool]
) -> None:
    """Inputs (and a parameter read directly) that require grad at recording or not,
    switched before compute: each gets a gradient iff it required grad both when its
    calls were made and at backward, as eagerly. Before, one switched on got a
    gradient (zeros, or the real one) wherever another input of its step required
    grad: the step stacking them ran with grad."""
    torch.manual_seed(seed)
    eager = _Scaled()
    model = copy.deepcopy(eager)
    xs = [[torch.randn(3, dtype=torch.float64, requires_grad=then) for then, _ in flags]
          for _ in range(2)]
    xs[1] = [x.detach().clone().requires_grad_(x.requires_grad) for x in xs[0]]
    for m in (eager, model):
        m.scale.requires_grad_(scale[0])
    eager_loss = sum(eager.f(x) for x in xs[0])
    with bg.BatchingPolicy() as policy:
        handles = [model.f(x) for x in xs[1]]
    for inputs in xs:
        for x, (_, now) in zip(inputs, flags, strict=True):
            x.requires_grad_(now)
    for m in (eager, model):
        m.scale.requires_grad_(scale[1])
    assert isinstance(eager_loss, torch.Tensor)
    sum(policy.compute(handles)).backward()
    eager_loss.backward()
    pairs = [*zip(xs[0], xs[1], strict=True),
             *zip(eager.parameters(), model.parameters(), strict=True)]
    for want, got in pairs:
        assert (want.grad is None) == (got.grad is None)
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-12)
