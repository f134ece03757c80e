"""Dropout (any draw from the CPU generator) in the threads backend is reproducible under a
fixed seed, whatever the thread timing: stage threads once raced on the one generator."""

from __future__ import annotations

import copy
import random
import time
import warnings

import pytest
import torch
from torch import nn

from batchgraph.pipeline import Pipeline


class _Jitter(nn.Module):
    """Sleeps a random time (Python's generator, not torch's): changes the thread timing."""

    def __init__(self, timing: random.Random) -> None:
        super().__init__()
        self.timing = timing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.timing.random() * 0.002)
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 2))


def _stages(model: nn.Sequential, timing: random.Random | None) -> list[nn.Module]:
    parts = [model[0:3], model[3:6], model[6:9], model[9:]]
    if timing is None:
        return parts
    return [nn.Sequential(_Jitter(timing), part) for part in parts]


def _run(
    base: nn.Sequential, schedule: str, seed: int, timing: random.Random | None
) -> list[torch.Tensor]:
    model = copy.deepcopy(base)
    x, y = torch.randn(12, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(12, 2)
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    torch.manual_seed(seed)
    with Pipeline(
        _stages(model, timing),
        stages=4 // chunks,
        microbatches=6,
        schedule=schedule,
        chunks=chunks,
        loss_fn=nn.MSELoss(),
        timeout=30,
    ) as pipe:
        losses = [pipe.train_step(x, y) for _ in range(2)]
        out = pipe.forward(x)
    assert isinstance(out, torch.Tensor)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    # The caller's stream goes on from the same state too.
    return [*losses, out, *grads, torch.rand(3)]  # type: ignore[list-item]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_same_seed_is_bit_identical_whatever_the_timing(schedule: str) -> None:
    base = _model()
    first = _run(base, schedule, 0, random.Random(1))
    for timing in (random.Random(2), None):
        again = _run(base, schedule, 0, timing)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)
    other = _run(base, schedule, 1, random.Random(1))
    assert not torch.equal(first[0], other[0])  # another seed, other masks
    assert not torch.equal(first[2], other[2])


class _LateNoise(nn.Module):
    """Draws random numbers only once told to (a data-dependent draw)."""

    def __init__(self) -> None:
        super().__init__()
        self.noisy = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.randn_like(x) if self.noisy else x


def test_a_draw_where_none_was_seen_warns_and_locks_every_stage() -> None:
    noise = _LateNoise()
    x = torch.randn(4, 3)
    with Pipeline(
        [nn.Linear(3, 3), noise, nn.Linear(3, 1)],
        microbatches=2,
        loss_fn=nn.MSELoss(),
        timeout=30,
    ) as pipe:
        pipe.train_step(x, x[:, :1])
        pipe.train_step(x, x[:, :1])  # the noise stage was found quiet: it runs unlocked
        noise.noisy = True
        with pytest.warns(RuntimeWarning, match="drew random numbers"):
            pipe.train_step(x, x[:, :1])
        # Locked from here on: the stage draws from its own generator state, so the
        # caller's stream is left alone (no warning) and a seed decides the step.
        # (Before, this step only ran: a pipeline that never locked passed.)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            losses = []
            for _ in range(2):
                torch.manual_seed(5)
                losses.append(pipe.train_step(x, x[:, :1]))
        assert torch.equal(losses[0], losses[1])
