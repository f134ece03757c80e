"""The threads backend carries the caller's per-thread autograd state to the stage threads.

``torch.autograd.graph.saved_tensors_hooks`` (``save_on_cpu``, activation offloading)
and ``disable_saved_tensors_hooks`` are per thread, as autocast is; the stages run on
device threads of their own, so a ``with`` block around ``train_step`` reached none of
them: no pack hook ran, activations stayed where they were, silently.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError, StageError, thread_state
from tests.pipeline_models import assert_grads_equal, mlp, reference


class _Packed:
    """What the counting pack hook stores instead of the tensor."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class _CountingHooks:
    """Pack and unpack hooks that count their calls and note the threads they ran on."""

    def __init__(self) -> None:
        self.packs = 0
        self.unpacks = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def pack(self, tensor: Tensor) -> _Packed:
        with self._lock:
            self.packs += 1
            self.threads.add(threading.current_thread().name)
        return _Packed(tensor.detach().clone())

    def unpack(self, packed: _Packed) -> Tensor:
        with self._lock:
            self.unpacks += 1
        return packed.tensor

    def __call__(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_saved_tensors_hooks_run_on_stage_threads(schedule: str) -> None:
    m = 4
    model = mlp(layers=4)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    # One device: the hooks pack every tensor the forward and the loss save.
    single = _CountingHooks()
    with single():
        want_loss = loss_fn(model(x), y)
    want_loss.backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    assert single.packs == single.unpacks > 0

    hooks = _CountingHooks()
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    with Pipeline(
        model, stages=2, microbatches=m, schedule=schedule, loss_fn=loss_fn, chunks=chunks,
        timeout=30,
    ) as pipe:  # fmt: skip
        with hooks():
            loss = pipe.train_step(x, y)
        # Each microbatch's forward and loss save what one device's do (none were
        # packed before: the hooks stayed in the caller's thread).
        assert hooks.packs == m * single.packs
        assert threading.current_thread().name not in hooks.threads
        if schedule == "zb-h1":
            # I and W each read the saved tensors they need from a retained graph.
            assert hooks.unpacks >= hooks.packs
        else:
            assert hooks.unpacks == hooks.packs
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-10, atol=1e-10)
        assert_grads_equal(model, want)
        # The hooks end with the caller's block: the reused threads do not keep them.
        model.zero_grad(set_to_none=True)
        packs = hooks.packs
        pipe.train_step(x, y)
        assert hooks.packs == packs
        assert_grads_equal(model, want)


def test_save_on_cpu_and_checkpoint_inside_a_stage() -> None:
    """save_on_cpu around the step, a non-reentrant checkpoint (its own hooks, innermost)
    inside a stage: gradients as on one device, for the split backward too."""

    class Checkpointed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Tensor) -> Tensor:
            out: Tensor = torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)
            return out

    base = mlp(layers=4)
    model = nn.Sequential(base[:3], Checkpointed(base[3:5]), base[5:])
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    loss_fn = nn.MSELoss()
    with torch.autograd.graph.save_on_cpu():
        want_loss, want = reference(model, x, y, loss_fn)
    for schedule in ["1f1b", "zb-h1"]:
        with (
            Pipeline([model[0], model[1:]], microbatches=3, schedule=schedule, loss_fn=loss_fn,
                     timeout=30) as pipe,
            torch.autograd.graph.save_on_cpu(),
        ):  # fmt: skip
            loss = pipe.train_step(x, y)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
        assert_grads_equal(model, want)
        model.zero_grad(set_to_none=True)


class _PushesHooks(nn.Module):
    """A layer that enters saved-tensors hooks itself (as activation offloading or a
    non-reentrant checkpoint inside a model does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out: Tensor = self.lin(x)
        return out


def test_disabled_saved_tensors_hooks_are_disabled_on_stage_threads() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _PushesHooks())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    message = "saved tensors hooks are off in this training loop"
    with (
        torch.autograd.graph.disable_saved_tensors_hooks(message),
        pytest.raises(RuntimeError, match=message),
    ):
        model(x)  # one device refuses
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        with (
            torch.autograd.graph.disable_saved_tensors_hooks(message),
            pytest.raises(StageError, match=f"stage 1 .*{message}"),
        ):
            pipe.train_step(x, y)
        pipe.reset()
        pipe.train_step(x, y)  # outside the block the layer's hooks work again


def test_a_torch_that_cannot_read_the_hooks_refuses_them(monkeypatch: Any) -> None:
    monkeypatch.setattr(thread_state, "_read_hooks", None)
    model = mlp(layers=2)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        with (
            torch.autograd.graph.save_on_cpu(),
            pytest.raises(PipelineConfigError, match=r"cannot read the hooks.*upgrade torch"),
        ):
            pipe.train_step(x, y)
        pipe.train_step(x, y)  # without hooks nothing needs reading
        with torch.autograd.graph.disable_saved_tensors_hooks("off"):
            pipe.train_step(x, y)  # disabled: no pair can be in force


class _NanGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * float("nan")


class _NanLayer(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = _NanGradient.apply(x)  # type: ignore[no-untyped-call]
        return out


def test_detect_anomaly_reaches_stage_threads() -> None:
    """Anomaly mode is global in torch (not per thread): a NaN gradient is caught on the
    stage that made it, as on one device."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), _NanLayer(), nn.Linear(4, 4))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with (
        Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe,
        pytest.warns(UserWarning),  # anomaly mode's own warnings (tracebacks)
        torch.autograd.detect_anomaly(),
        pytest.raises(StageError, match=r"stage 1 .*returned nan values"),
    ):
        pipe.train_step(x, y)


def test_torch_modes_around_a_step_warn() -> None:
    """Function and dispatch modes are per thread and not safe to enter on several
    threads at once: they stay behind, and say so (FlopCounterMode counted nothing)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = mlp(layers=2)
    x, y = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        with (
            pytest.warns(RuntimeWarning, match=r"\(_?FlopCounterMode.*threads of their own"),
            FlopCounterMode(display=False),
        ):
            pipe.train_step(x, y)
        with (
            pytest.warns(RuntimeWarning, match=r"\(DeviceContext.*threads of their own"),
            torch.device("cpu"),
        ):
            pipe.forward(x)


def test_set_num_threads_after_building_reaches_the_stages() -> None:
    seen: list[int] = []

    class Threads(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            if x.device.type != "meta":
                seen.append(torch.get_num_threads())
            return x

    before = torch.get_num_threads()
    with Pipeline([nn.Linear(3, 3), Threads()], microbatches=2, timeout=30) as pipe:
        try:
            torch.set_num_threads(1 if before > 1 else 2)
            pipe.forward(torch.randn(4, 3))
            assert seen == [torch.get_num_threads()] * 2
        finally:
            torch.set_num_threads(before)
