"""Gradient accumulation over steps survives a failed step, as on one device.

A user accumulating gradients over several steps who catches a step's error (a bad
batch) and goes on: on one device the failing forward comes before ``backward``, so
``.grad`` keeps exactly the earlier steps' gradients. A pipeline step runs a backward per
microbatch, and before the fix the microbatches that finished before the failure left
their gradients added to ``.grad``, silently.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, StageError
from tests.integration.test_pipeline_faults import RaiseOnMicrobatch

SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2}


def _stages(seed: int, bad: int, where: int, total: int) -> list[nn.Module]:
    """``total`` float64 stages; stage ``where`` raises on its ``bad``-th forward once armed."""
    torch.manual_seed(seed)
    stages: list[nn.Module] = []
    for s in range(total):
        layer: nn.Module = nn.Linear(4, 4).double()
        if s == where:
            layer = RaiseOnMicrobatch(bad)
            layer.armed = False
        stages.append(nn.Sequential(layer, nn.Tanh()))
    return stages


def _grads(stages: list[nn.Module]) -> list[Tensor]:
    return [p.grad.clone() for m in stages for p in m.parameters()]  # type: ignore[union-attr]


@settings(max_examples=12, deadline=None)
@given(
    schedule=st.sampled_from(sorted(SCHEDULES)),
    bad=st.integers(0, 3),
    where=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_a_failed_step_keeps_the_gradients_of_earlier_steps(
    schedule: str, bad: int, where: int, seed: int
) -> None:
    chunks = SCHEDULES[schedule]
    total = 2 * chunks
    where %= total
    stages = _stages(seed, bad, where, total)
    twins = _stages(seed, bad, where, total)  # one device, unsplit
    fails = stages[where][0]
    assert isinstance(fails, RaiseOnMicrobatch)
    gen = torch.Generator().manual_seed(seed)
    batches = [
        (torch.randn(8, 4, generator=gen, dtype=torch.float64),
         torch.randn(8, 4, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]  # fmt: skip
    loss_fn = nn.MSELoss()
    with Pipeline(
        stages, microbatches=4, schedule=schedule, loss_fn=loss_fn, chunks=chunks
    ) as pipe:
        pipe.train_step(*batches[0])
        before = _grads(stages)
        held = [p.grad for m in stages for p in m.parameters()]
        fails.armed, fails.calls = True, 0
        with pytest.raises(StageError, match="boom on purpose"):
            pipe.train_step(*batches[1])
        after = _grads(stages)
        for i, (b, a) in enumerate(zip(before, after)):
            assert torch.equal(a, b), f"parameter {i}: the failed step changed .grad"
        fails.armed = False
        pipe.train_step(*batches[2])  # accumulation goes on from the earlier steps
    for x, y in (batches[0], batches[2]):
        loss_fn(nn.Sequential(*twins)(x), y).backward()
    got, want = _grads(stages), _grads(twins)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g, w, atol=1e-12), f"parameter {i}: {(g - w).abs().max()}"
    # As a backward into an existing .grad: the same tensors, summed in place.
    params = [p for m in stages for p in m.parameters()]
    assert all(p.grad is h for p, h in zip(params, held))


class _WeightedLoss(nn.Module):
    """A loss with a parameter of its own (a learned weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        return ((output - target) ** 2).mean() * self.weight


def test_a_failed_step_keeps_the_gradients_of_the_loss_module_s_parameters() -> None:
    # The loss's backwards add to its parameters per microbatch too: before, the
    # microbatches that finished before the failure left theirs in loss.weight.grad.
    stages = _stages(0, 2, 1, 2)
    fails = stages[1][0]
    assert isinstance(fails, RaiseOnMicrobatch)
    loss, twin_loss = _WeightedLoss(), _WeightedLoss()
    twins = _stages(0, 2, 1, 2)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=gen, dtype=torch.float64),
                torch.randn(8, 4, generator=gen, dtype=torch.float64)) for _ in range(3)]
    with Pipeline(stages, microbatches=4, schedule="1f1b", loss_fn=loss) as pipe:
        pipe.train_step(*batches[0])
        assert loss.weight.grad is not None
        before = loss.weight.grad.clone()
        fails.armed, fails.calls = True, 0
        with pytest.raises(StageError, match="boom on purpose"):
            pipe.train_step(*batches[1])
        assert torch.equal(loss.weight.grad, before)
        fails.armed = False
        pipe.train_step(*batches[2])
    for x, y in (batches[0], batches[2]):
        twin_loss(nn.Sequential(*twins)(x), y).backward()
    assert twin_loss.weight.grad is not None
    torch.testing.assert_close(loss.weight.grad, twin_loss.weight.grad, rtol=0, atol=1e-12)
