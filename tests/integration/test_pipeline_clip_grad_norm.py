"""``Pipeline.clip_grad_norm_`` equals ``torch.nn.utils.clip_grad_norm_`` on the unsplit model.

Threads backend: the stages train the model's own parameters, a layer shared by two
stages counted once; the returned total and every clipped gradient are one device's,
for any norm type, and a non-finite total raises torch's error with the gradients left
as they were. A process backend that holds only some stages and cannot compute the norm
over the others is refused rather than clipping by a part's norm.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchgraph.pipeline import BackendRequest, Pipeline, PipelineConfigError
from batchgraph.pipeline import pipeline as pipeline_module
from batchgraph.pipeline.coordinator import Coordinator
from batchgraph.pipeline.stage import Stage

NORMS = [2.0, 1.0, 3.0, 0.5, float("inf"), -float("inf"), 0.0]


def _stages(seed: int, tied: bool) -> list[nn.Module]:
    torch.manual_seed(seed)
    shared = nn.Linear(4, 4).double()
    last = shared if tied else nn.Linear(4, 4).double()
    return [
        nn.Sequential(shared, nn.Tanh()),
        nn.Sequential(nn.Linear(4, 4).double(), nn.Tanh()),
        nn.Sequential(last, nn.Tanh(), nn.Linear(4, 2).double()),
        nn.Sequential(nn.Linear(2, 2).double()),
    ]


@settings(max_examples=15, deadline=None)
@given(
    norm_type=st.sampled_from(NORMS),
    max_norm=st.floats(1e-3, 10.0),
    schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]),
    tied=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_clipping_equals_one_device(
    norm_type: float, max_norm: float, schedule: str, tied: bool, seed: int
) -> None:
    stages, twins = _stages(seed, tied), _stages(seed, tied)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    with Pipeline(stages, microbatches=4, schedule=schedule, chunks=chunks,
                  loss_fn=nn.MSELoss()) as pipe:  # fmt: skip
        pipe.train_step(x, y)
        total = pipe.clip_grad_norm_(max_norm, norm_type)
    twin = nn.Sequential(*twins)
    nn.MSELoss()(twin(x), y).backward()
    want = nn.utils.clip_grad_norm_(twin.parameters(), max_norm, norm_type)
    assert total.dtype == want.dtype
    assert torch.allclose(total, want, rtol=1e-12), (total, want)
    got_params = list(nn.Sequential(*stages).parameters())
    for i, (p, q) in enumerate(zip(got_params, twin.parameters(), strict=True)):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15), f"parameter {i}"


def test_a_nonfinite_norm_raises_torchs_error_and_keeps_the_gradients() -> None:
    stages = _stages(0, tied=True)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    with Pipeline(stages, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        pipe.train_step(x, y)
        weight = stages[1][0].weight
        assert weight.grad is not None
        weight.grad[0, 0] = float("inf")
        before = [p.grad.clone() for m in stages for p in m.parameters()]  # type: ignore[union-attr]
        with pytest.raises(RuntimeError, match=r"total norm of order 2.0 .* non-finite"):
            pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    after = [p.grad for m in stages for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before))


class _HalfRuntime(Coordinator):
    """A runtime that runs every stage but says it holds only the first (as a process
    backend's rank does) and has no clip_grad_norm_ of its own."""

    @property
    def own_modules(self) -> dict[int, nn.Module]:
        return {0: self.stages[0].module}


def _half_backend(request: BackendRequest) -> Any:
    stages = [Stage(m, i, len(request.modules)) for i, m in enumerate(request.modules)]
    return _HalfRuntime(stages, request.schedule, request.loss)


def test_a_backend_holding_some_stages_without_a_clip_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Registered for this test only (the registry is process-wide).
    monkeypatch.setitem(pipeline_module._BACKENDS, "test-half", _half_backend)
    stages = _stages(0, tied=False)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    with Pipeline(stages, microbatches=2, loss_fn=nn.MSELoss(), backend="test-half") as pipe:
        pipe.train_step(x, y)
        before = [p.grad.clone() for m in stages for p in m.parameters()]  # type: ignore[union-attr]
        with pytest.raises(PipelineConfigError, match=r"holds 1 of the 4 stages.*test-half"):
            pipe.clip_grad_norm_(1e-3)
    assert all(
        torch.equal(p.grad, b)  # type: ignore[arg-type]
        for p, b in zip((p for m in stages for p in m.parameters()), before)
    )
