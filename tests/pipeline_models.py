"""Small models and a single-device reference for pipeline tests."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def mlp(layers: int = 8, width: int = 6, inputs: int = 5, outputs: int = 3) -> nn.Sequential:
    """A float64 MLP with ``layers`` Linear layers (each followed by tanh but the last)."""
    mods: list[nn.Module] = []
    sizes = [inputs] + [width] * (layers - 1) + [outputs]
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        mods.append(nn.Linear(a, b))
        if i < layers - 1:
            mods.append(nn.Tanh())
    return nn.Sequential(*mods).double()


def reference(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]
) -> tuple[Tensor, list[Tensor | None]]:
    """Loss and parameter gradients of one normal full-batch step (grads left zeroed)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def microbatch_reference(model: nn.Module, x: Tensor, y: Tensor, microbatches: int
                         ) -> tuple[Tensor, list[Tensor | None]]:
    """Loss and gradients of one device running ``model`` a microbatch at a time (as a
    pipeline splits ``x``), each microbatch's MSE weighted by its rows: what a pipeline
    step gives where a forward draws or updates state per call (BatchNorm's statistics,
    a generator of its own)."""
    from batchgraph.pipeline.microbatch import split_microbatches

    model.zero_grad(set_to_none=True)
    loss = torch.zeros((), dtype=x.dtype)
    for (part,), (target,) in zip(split_microbatches(x, microbatches),
                                  split_microbatches(y, microbatches), strict=True):
        mb_loss = nn.functional.mse_loss(model(part), target) * len(part) / len(x)
        mb_loss.backward()
        loss += mb_loss.detach()
    return loss, [p.grad for p in model.parameters()]


def assert_grads_equal(model: nn.Module, expected: list[Tensor | None]) -> None:
    for i, (p, g) in enumerate(zip(model.parameters(), expected)):
        assert (p.grad is None) == (g is None), f"parameter {i}: grad presence differs"
        if p.grad is not None and g is not None:
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


def stacked(blocks: int, layer: Callable[[], nn.Module]) -> nn.Sequential:
    """``blocks`` of a float64 Linear(4, 4) and ``layer()``, seeded alike every time."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(blocks):
        mods += [nn.Linear(4, 4, dtype=torch.float64), layer()]
    return nn.Sequential(*mods)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float, back: float) -> Tensor:
        ctx.back = back
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.back)
        return grad, None, None


class SleepLayer(nn.Module):
    """A layer whose forward and backward take fixed times (sleep releases the GIL)."""

    def __init__(self, forward: float, backward: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones((), dtype=torch.float64))
        self.forward_s = forward
        self.backward_s = backward

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s) * self.weight


class _Complexify(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.complex(x, x.flip(-1))


class _ComplexLinear(nn.Module):
    def __init__(self, width: int, generator: torch.Generator) -> None:
        super().__init__()
        w = torch.randn(width, width, dtype=torch.complex128, generator=generator) / 3
        self.w = nn.Parameter(w)

    def forward(self, z: Tensor) -> Tensor:
        return z @ self.w


def complex_model(width: int = 5, seed: int = 0) -> nn.Sequential:
    """A float64 linear layer, then complex128 layers: its outputs are complex
    (train it with :func:`complex_loss`); seeded, so every process builds it alike."""
    gen = torch.Generator().manual_seed(seed)
    first = nn.Linear(width, width, dtype=torch.float64)
    with torch.no_grad():
        first.weight.copy_(torch.randn(width, width, generator=gen, dtype=torch.float64))
        first.bias.copy_(torch.randn(width, generator=gen, dtype=torch.float64))
    layers = [first, _Complexify(), _ComplexLinear(width, gen), _ComplexLinear(width, gen)]
    return nn.Sequential(*layers)


def complex_loss(out: Tensor, target: Tensor) -> Tensor:
    """A real loss of complex outputs: the mean squared error of their magnitudes."""
    return (out.abs() - target).pow(2).mean()


# Every schedule of a step, and a grid of pipelines to draw from (hypothesis: given(**GRID)).
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def grid() -> dict[str, Any]:
    """Strategies for (stages, microbatches, schedule) of small pipelines."""
    from hypothesis import strategies as st

    return {"stages": st.integers(1, 3), "microbatches": st.integers(1, 4),
            "schedule": st.sampled_from(SCHEDULES)}


def chunks_for(schedule: str) -> int:
    """The chunks per device a grid's schedule runs: 2 interleaved, else 1."""
    return 2 if schedule == "interleaved-1f1b" else 1


def step_per_microbatch(make: Callable[[int], nn.Module], state: Callable[[nn.Module], Any],
                        stages: int, microbatches: int, schedule: str) -> nn.Module:
    """One pipeline ``train_step`` of ``make(blocks)`` (a block per stage and chunk):
    asserts its loss and gradients are one device's on the whole batch, and that
    ``state`` of it is what the unsplit model's forwards keep run on each microbatch in
    turn. Returns the pipelined model."""
    from batchgraph.pipeline import Pipeline
    from batchgraph.pipeline.microbatch import split_microbatches

    blocks = stages * chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss, grads = reference(make(blocks), x, y, nn.MSELoss())
    kept = make(blocks)
    with torch.no_grad():
        for (part,) in split_microbatches(x, microbatches):
            kept(part.clone())
    model = make(blocks)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks_for(schedule)) as pipe:
        torch.testing.assert_close(pipe.train_step(x, y), loss, rtol=1e-10, atol=1e-10)
    assert_grads_equal(model, grads)
    assert state(model) == state(kept)
    return model


def refused_or_one_device(layer: Callable[[], nn.Module], stages: int, microbatches: int,
                          schedule: str, match: str) -> None:
    """A step of :func:`stacked` blocks of ``layer``: one device's with one microbatch,
    else refused before any work (``PipelineConfigError`` matching ``match``, no
    gradient)."""
    import pytest

    from batchgraph.pipeline import Pipeline, PipelineConfigError

    if microbatches == 1:
        step_per_microbatch(lambda blocks: stacked(blocks, layer), lambda m: None,
                            stages, microbatches, schedule)
        return
    chunks = chunks_for(schedule)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    model = stacked(stages * chunks, layer)
    with Pipeline(model, stages=stages, microbatches=microbatches, schedule=schedule,
                  loss_fn=nn.MSELoss(), chunks=chunks) as pipe, pytest.raises(
            PipelineConfigError, match=match):
        pipe.train_step(x, y)
    assert all(p.grad is None for p in model.parameters())
