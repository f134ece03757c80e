"""Loss scaling over uneven microbatches, microbatch splitting, and the stats convention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import Action, Loss, PipelineStats, split_microbatches
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.microbatch import merge_microbatches


@given(n=st.integers(1, 12), m=st.integers(1, 12), reduction=st.sampled_from(["mean", "sum"]))
def test_weighted_microbatch_gradients_sum_to_full_batch(n: int, m: int, reduction: str) -> None:
    m = min(m, n)
    out = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    tgt = torch.randn(n, 3, dtype=torch.float64)
    fn = nn.MSELoss(reduction=reduction)
    (full,) = torch.autograd.grad(fn(out, tgt), out)
    loss = Loss(fn)
    assert loss.reduction == reduction
    pieces = []
    total = torch.zeros((), dtype=torch.float64)
    for o, t in zip(split_microbatches(out.detach(), m), split_microbatches(tgt, m)):
        leaf = o[0].clone().requires_grad_(True)
        value = loss.compute_loss(leaf, t[0])
        w = loss.weight(leaf.shape[0], n)
        (g,) = loss.compute_gradient(value, leaf, weight=w)
        pieces.append(g)
        total = total + w * value.detach()
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-12, atol=1e-12)  # type: ignore[arg-type]
    torch.testing.assert_close(total, fn(out, tgt).detach(), rtol=1e-12, atol=1e-12)


def test_loss_reduction_detection_and_errors() -> None:
    assert Loss(torch.nn.functional.mse_loss).reduction == "mean"
    assert Loss(lambda o, t: (o - t).sum(), reduction="sum").weight(3, 10) == 1.0
    with pytest.raises(PipelineConfigError, match="'none' is not supported"):
        Loss(nn.MSELoss(reduction="none"))
    kl = Loss(nn.KLDivLoss(reduction="batchmean"))
    assert kl.reduction == "batchmean" and kl.weight(3, 10) == 0.3
    with pytest.raises(ValueError, match="must return a scalar"):
        Loss(lambda o, t: o - t).compute_loss(torch.ones(2), torch.ones(2))


def test_split_sizes_and_merge() -> None:
    parts = split_microbatches((torch.arange(10), torch.arange(10) * 2), 4)
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert torch.equal(merge_microbatches([(p[1],) for p in parts]), torch.arange(10) * 2)  # type: ignore[arg-type]
    with pytest.raises(PipelineConfigError, match="same size in dimension 0"):
        split_microbatches((torch.zeros(3), torch.zeros(4)), 1)


def _ev(device: int, action: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(device=device, action=Action.parse(action), start=start, end=end)


def test_stats_convention_by_hand() -> None:
    # dev0: F0 [0,1] F1 [1,2] idle [2,4] B0 [4,6] idle [6,7] B1 [7,9]
    # dev1: idle [0,1] F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7] idle [7,9]
    events = [
        _ev(0, "0F0", 0, 1),
        _ev(0, "0F1", 1, 2),
        _ev(0, "0B0", 4, 6),
        _ev(0, "0B1", 7, 9),
        _ev(1, "1F0", 1, 2),
        _ev(1, "1B0", 2, 4),
        _ev(1, "1F1", 4, 5),
        _ev(1, "1B1", 5, 7),
    ]
    s = PipelineStats.from_events(events)
    assert s.makespan == 9
    d0, d1 = s.devices[0], s.devices[1]
    assert (d0.forward_busy, d0.backward_busy, d0.forward_bubble, d0.backward_bubble) == (
        2,
        4,
        0,
        3,
    )
    assert (d1.forward_busy, d1.backward_busy, d1.forward_bubble, d1.backward_bubble) == (
        2,
        4,
        1,
        2,
    )
    assert s.forward_time + s.backward_time == 18
    assert s.utilization == pytest.approx(12 / 18)
    assert s.stage_forward == {0: 2, 1: 2} and s.stage_backward == {0: 4, 1: 4}
    assert "makespan" in s.summary()


def test_stats_idle_device_and_empty() -> None:
    s = PipelineStats.from_events([_ev(0, "0F0", 0, 1)], devices=2)
    assert s.devices[1].forward_bubble == 1 and s.utilization == 0.5
    assert PipelineStats.from_events([]).utilization == 0.0


def test_compute_loss_keeps_a_scalar_as_it_is_and_flattens_a_one_element_loss() -> None:
    out = torch.ones(2, 3, requires_grad=True)
    scalar = Loss(lambda o, t: (o - t).square().mean())
    value = scalar.compute_loss(out, torch.zeros(2, 3))
    assert value.dim() == 0 and value.grad_fn is not None
    assert type(value.grad_fn).__name__ == "MeanBackward0"  # no reshape node on top
    one = Loss(lambda o, t: (o - t).sum().reshape(1, 1), reduction="sum").compute_loss(out, out)
    assert one.shape == ()
