"""Pipeline threads backend with stages on CUDA: equal to single-device training (skipped without CUDA).

Stage threads share the device's default stream, so kernels run in the order the
threads issue them (a stage issues its kernels only after it received its input); the
autograd engine runs CUDA backwards on its device thread, re-entrant calls (the
two-stage backprop junctions) included.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchgraph.pipeline import SCHEDULE_NAMES, Pipeline
from tests.pipeline_models import assert_grads_equal, mlp, reference

pytestmark = pytest.mark.gpu


def _chunks(schedule: str) -> int:
    return 2 if schedule == "interleaved-1f1b" else 1


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize(("p", "m", "n"), [(2, 4, 10), (4, 8, 19)])
def test_cuda_stages_equal_single_device(schedule: str, p: int, m: int, n: int) -> None:
    model = mlp(layers=8).cuda()
    x = torch.randn(n, 5, dtype=torch.float64, device="cuda")
    y = torch.randn(n, 3, dtype=torch.float64, device="cuda")
    loss_fn = nn.MSELoss()
    want_loss, want_grads = reference(model, x, y, loss_fn)
    with Pipeline(
        model,
        stages=p,
        microbatches=m,
        schedule=schedule,
        loss_fn=loss_fn,
        chunks=_chunks(schedule),
        devices=["cuda:0"] * p,
        timeout=60,
    ) as pipe:
        for stage in pipe.stage_modules:
            assert all(q.is_cuda for q in stage.parameters())
        loss = pipe.train_step(x, y)
        assert loss.is_cuda
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
        assert_grads_equal(model, want_grads)
        assert all(q.grad is not None and q.grad.is_cuda for q in model.parameters())
        with torch.no_grad():
            torch.testing.assert_close(pipe.forward(x), model(x), rtol=1e-10, atol=1e-10)
        # A second step accumulates, like a second backward() would.
        pipe.train_step(x, y)
        assert_grads_equal(model, [None if g is None else 2 * g for g in want_grads])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_cpu_inputs_are_moved_to_the_first_stage(schedule: str) -> None:
    model = mlp(layers=4).cuda()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64, device="cuda")
    loss_fn = nn.MSELoss()
    want_loss, want_grads = reference(model, x.cuda(), y, loss_fn)
    with Pipeline(
        model,
        stages=2,
        microbatches=3,
        schedule=schedule,
        loss_fn=loss_fn,
        devices=["cuda:0", "cuda:0"],
        timeout=60,
    ) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, want_grads)


class _NotesCurrentDevice(nn.Module):
    """Notes the thread's current CUDA device whenever it runs."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.cuda.current_device())
        out: torch.Tensor = self.lin(x)
        return out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_each_stage_thread_runs_with_its_gpu_current() -> None:
    first: list[int] = []
    second: list[int] = []
    model = nn.Sequential(_NotesCurrentDevice(first), _NotesCurrentDevice(second))
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(),
                  devices=["cuda:0", "cuda:1"], timeout=60) as pipe:
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4, device="cuda:1"))
    assert set(first) == {0} and set(second) == {1}
