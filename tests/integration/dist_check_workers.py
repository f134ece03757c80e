"""Worker jobs for tests/integration/test_dist_step_checks.py (spawned gloo ranks).

What a training step refuses or warns about on the threads backend, asked of the
``torch.distributed`` one: each rank reports what it raised or warned, and whether the
pipeline still trains (gradients equal one device's) afterwards.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from tests.integration import dist_workers as W


class Argmax(nn.Module):
    """A last layer without an autograd graph: its outputs never require grad."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(-1, keepdim=True).double()


class Total(nn.Module):
    """A last layer that reduces over the batch: its output is 0-d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum()


def _last_with(layer: Callable[[], nn.Module]) -> nn.Module:
    return nn.Sequential(W.make_stage(1, 2), layer())


def _attempt(step: Callable[[], Any]) -> str:
    """``"ok"`` or the error's type and message; warnings turned into text, not errors."""
    try:
        step()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def job_refusals(rank: int, world: int) -> dict[str, Any]:
    """Steps the threads backend refuses before any work, then a good step on the same
    pipeline (which must still train as one device)."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch()
    first, last = rank == 0, rank == world - 1
    out: dict[str, Any] = {}

    def good(pipe: DistributedPipeline) -> float:
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x if first else None, y if last else None)
        return W._grad_error(pipe.stages, W.reference_grads(world))

    net = nn.Sequential(nn.Linear(W.DIM, W.DIM), nn.Tanh(), nn.Linear(W.DIM, W.OUT))
    net.register_forward_hook(lambda module, args, output: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedPipeline(net, stages=world, microbatches=2, timeout=20).close()
    out["hooks"] = [(str(w.message), w.filename) for w in caught]
    with DistributedPipeline(W.factories(world), stages=world, microbatches=4,
                             loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
        with torch.inference_mode():
            out["inference"] = _attempt(lambda: pipe.train_step(x if first else None,
                                                                y if last else None))  # fmt: skip
        out["inference_then"] = good(pipe)
        for p in pipe.parameters():
            p.requires_grad_(False)
        out["frozen"] = _attempt(lambda: pipe.train_step(x if first else None, y if last else None))
        for p in pipe.parameters():
            p.requires_grad_(True)
        out["frozen_then"] = good(pipe)
        x3, y3 = W.batch(3)
        out["small"] = _attempt(
            lambda: pipe.train_step(x3 if first else None, y3 if last else None)
        )
        out["small_then"] = good(pipe)
        # forward checks its inputs on every rank as train_step does (an evaluation's
        # last, smaller batch); under inference mode it runs.
        out["forward_small"] = _attempt(lambda: pipe.forward(x3 if first else None))
        out["forward_missing"] = _attempt(lambda: pipe.forward(None))
        with torch.inference_mode():
            outputs = pipe.forward(x if first else None)
        if last:
            with torch.no_grad():
                want = nn.Sequential(*[W.make_stage(s, world) for s in range(world)])(x)
            out["forward_then"] = (outputs - want).abs().max().item()  # type: ignore[operator]
        out["forward_then_train"] = good(pipe)
        # Rank 0 calls forward while the last rank calls train_step.
        out["mixed_calls"] = _attempt(
            lambda: pipe.forward(x) if first else pipe.train_step(None, y if last else None)
        )
        out["mixed_then"] = good(pipe)
    return out


def job_scalar_output(rank: int, world: int) -> dict[str, Any]:
    """A last stage that returns a 0-d tensor: train_step warns (last rank), forward is
    refused on the last rank only and the pipeline goes on."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch()
    first, last = rank == 0, rank == world - 1
    stages = [partial(W.make_stage, 0, 2), partial(_last_with, Total)]
    out: dict[str, Any] = {}
    with DistributedPipeline(stages, stages=2, microbatches=4, loss_fn=lambda o, t: o,
                             timeout=20) as pipe:  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe.train_step(x if first else None, y if last else None)
        out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
        out["forward"] = _attempt(lambda: pipe.forward(x if first else None))
        out["then"] = _attempt(lambda: pipe.train_step(x if first else None, y if last else None))
    return out


def job_no_gradient(rank: int, world: int) -> dict[str, Any]:
    """A last stage whose outputs have no autograd graph: every rank fails, naming it."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = W.batch()
    first, last = rank == 0, rank == world - 1
    stages = [partial(W.make_stage, 0, 2), partial(_last_with, Argmax)]
    with DistributedPipeline(stages, stages=2, microbatches=4, schedule="zb-h1",
                             loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
        return {"step": _attempt(lambda: pipe.train_step(x if first else None,
                                                         y[:, :1] if last else None))}  # fmt: skip
