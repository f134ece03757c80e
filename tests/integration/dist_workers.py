"""Worker functions for the multi-process pipeline tests (run in spawned processes).

Each worker initialises a gloo process group on 127.0.0.1, runs its part and reports a
small picklable result (or the error's type and message) through a queue. They live in
an importable module because ``spawn`` pickles the target by name.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DIM = 6
OUT = 3


def make_stage(index: int, num_stages: int) -> nn.Module:
    """Stage ``index`` of a small float64 MLP; seeded, so every process builds it alike."""
    gen = torch.Generator().manual_seed(1000 + index)
    last = index == num_stages - 1
    linear = nn.Linear(DIM, OUT if last else DIM, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen, dtype=torch.float64))
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen, dtype=torch.float64))
    return linear if last else nn.Sequential(linear, nn.Tanh())


def factories(num_stages: int) -> list[Callable[[], nn.Module]]:
    return [partial(make_stage, s, num_stages) for s in range(num_stages)]


def batch(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, DIM, generator=gen, dtype=torch.float64)
    y = torch.randn(n, OUT, generator=gen, dtype=torch.float64)
    return x, y


def reference_grads(num_stages: int, n: int = 12) -> dict[int, list[torch.Tensor]]:
    """Single-device gradients of every stage, for a mean MSE loss on the whole batch."""
    mods = [make_stage(s, num_stages) for s in range(num_stages)]
    x, y = batch(n)
    nn.MSELoss()(nn.Sequential(*mods)(x), y).backward()
    return {s: [p.grad.clone() for p in m.parameters()] for s, m in enumerate(mods)}  # type: ignore[union-attr]


def init(rank: int, world: int, port: int, timeout: float = 20.0) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def run(rank: int, world: int, port: int, job: Callable[[int, int], Any], queue: Any) -> None:
    """Process entry point: run ``job(rank, world)`` and put ``(rank, ok, result)``."""
    try:
        init(rank, world, port)
        result = job(rank, world)
        queue.put((rank, True, result))
    except BaseException as exc:
        queue.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
