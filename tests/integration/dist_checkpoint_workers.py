"""Worker jobs for tests/integration/test_dist_checkpoint.py (spawned gloo ranks).

Each rank builds the model on ``meta``, loads a single-device checkpoint into its
stages, trains a few steps beside the same single-device training (float64), and
reports how its part, the gathered whole and reloaded copies compare with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.integration import dist_workers as W


class Scale(nn.Module):
    """A buffer in the checkpoint: ``x * scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, W.DIM))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale


def model(world: int) -> nn.Sequential:
    """``world`` blocks of Linear, Scale, Tanh and a head; seeded where not on ``meta``."""
    torch.manual_seed(5)
    layers: list[nn.Module] = []
    for _ in range(world):
        layers += [nn.Linear(W.DIM, W.DIM), Scale(), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(W.DIM, W.OUT)).double()


def _error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in got)


def _attempt(step: Any) -> str:
    try:
        step()
    except RuntimeError as exc:
        return str(exc)
    return "ok"


def _train(params: list[nn.Parameter], step: Any, steps: int = 3) -> None:
    opt = torch.optim.SGD(params, lr=0.2, momentum=0.5)
    for i in range(steps):
        x, y = W.batch(12 - i)  # batch sizes 12, 11, 10
        step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)


def job_facade(rank: int, world: int) -> dict[str, Any]:
    """The façade on a meta-built nn.Sequential: load, train, save, gather, reload."""
    from batchgraph.pipeline import Pipeline

    first, last = rank == 0, rank == world - 1
    interleaved = world == 2
    options: dict[str, Any] = dict(
        stages=world, microbatches=4 if interleaved else 3, loss_fn=nn.MSELoss(),
        schedule="interleaved-1f1b" if interleaved else "1f1b", chunks=2 if interleaved else 1,
        backend="torch.distributed", timeout=20,
    )  # fmt: skip
    single = model(world)
    with torch.no_grad():  # buffers that differ from a fresh model's
        for m in single.modules():
            if isinstance(m, Scale):
                m.scale.mul_(-2.0)
    start = {k: v.clone() for k, v in single.state_dict().items()}
    out: dict[str, Any] = {}
    with torch.device("meta"):
        net = model(world)
    with Pipeline(net, **options) as pipe:
        out["model_state_dict"] = _attempt(net.state_dict)
        out["loaded"] = tuple(pipe.load_state_dict(start))
        params = [p for m in pipe.own_modules.values() for p in m.parameters()]
        _train(params, lambda x, y: pipe.train_step(x if first else None, y if last else None))
        _train(list(single.parameters()), lambda x, y: nn.MSELoss()(single(x), y).backward())
        want = single.state_dict()
        part = pipe.state_dict()
        out["own_stages"] = sorted(pipe.own_modules)
        out["part_keys"] = list(part)
        out["part_error"] = _error(part, want)
        out["part_meta"] = any(t.is_meta for t in part.values())
        whole = pipe.gather_state_dict()
        out["whole_keys"] = None if whole is None else list(whole)
        out["want_keys"] = list(want)
        if whole is not None:
            out["whole_error"] = _error(whole, want)
            fresh = model(world)
            fresh.load_state_dict(whole)  # strict: every key of the unsplit model
            x = W.batch(7)[0]
            with torch.no_grad():
                out["fresh_output_error"] = (fresh(x) - single(x)).abs().max().item()
    # A fresh pipeline resumes from this rank's own part alone (a file per rank).
    with torch.device("meta"):
        net2 = model(world)
    with Pipeline(net2, **options) as pipe2:
        out["reloaded"] = tuple(pipe2.load_state_dict(part))
        x = W.batch(7)[0]
        y = pipe2.forward(x if first else None)
        if y is not None:
            with torch.no_grad():
                out["reloaded_output_error"] = (y - single(x)).abs().max().item()  # type: ignore[operator]
        own_key = list(part)[-1]
        out["missing"] = _attempt(
            lambda: pipe2.load_state_dict({k: v for k, v in want.items() if k != own_key})
        )
        out["missing_key"] = own_key
        out["unexpected"] = _attempt(lambda: pipe2.load_state_dict(want | {"head.bias": x}))
        out["after_errors"] = _error(pipe2.state_dict(), want)  # nothing was copied
    return out


def job_stage_list(rank: int, world: int) -> dict[str, Any]:
    """DistributedPipeline given a list: named like nn.Sequential(*stages)."""
    from batchgraph.pipeline import DistributedPipeline

    out: dict[str, Any] = {}
    want = nn.Sequential(*[W.make_stage(s, world) for s in range(world)]).state_dict()
    with DistributedPipeline(W.factories(world), stages=world, microbatches=3,
                             loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
        part = pipe.state_dict()
        out["part_keys"] = list(part)
        out["part_error"] = _error(part, want)
        whole = pipe.gather_state_dict(dst=world - 1)
        out["whole_keys"] = None if whole is None else list(whole)
        out["want_keys"] = list(want)
        bogus = torch.zeros(1)
        out["own_bogus"] = _attempt(lambda: pipe.load_state_dict(want | {f"{rank}.bogus": bogus}))
        other = (rank + 1) % world  # another rank's stage: its keys are known there only
        out["other_bogus"] = _attempt(lambda: pipe.load_state_dict(want | {f"{other}.x": bogus}))
        out["no_stage"] = _attempt(lambda: pipe.load_state_dict(want | {f"{world}.x": bogus}))
    mods = [W.make_stage(s, world) for s in range(world)]
    with DistributedPipeline(mods, stages=world, microbatches=3, loss_fn=nn.MSELoss(),
                             timeout=20) as pipe:  # fmt: skip
        out["own_module"] = _attempt(mods[rank].state_dict)
        out["other_module"] = _attempt(mods[(rank + 1) % world].state_dict)
    return out


def job_replicas(rank: int, world: int) -> dict[str, Any]:
    """2 stages x 2 replicas trained on halves of each batch: every replica's part, and
    the whole gathered from the first replica, equal single-device training."""
    from batchgraph.pipeline import Pipeline

    device, replica = rank % 2, rank // 2
    single = model(2)
    with torch.device("meta"):
        net = model(2)
    with Pipeline(net, stages=2, microbatches=2, loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        pipe.load_state_dict(single.state_dict())

        def step(x: Tensor, y: Tensor) -> None:
            half = slice(0, len(x) // 2) if replica == 0 else slice(len(x) // 2, None)
            pipe.train_step(x[half] if device == 0 else None, y[half] if device == 1 else None)

        _train([p for m in pipe.own_modules.values() for p in m.parameters()], step)
        _train(list(single.parameters()), lambda x, y: nn.MSELoss()(single(x), y).backward())
        want = single.state_dict()
        whole = pipe.gather_state_dict()
        return {
            "part_error": _error(pipe.state_dict(), want),
            "whole_keys": None if whole is None else list(whole),
            "want_keys": list(want),
            "whole_error": None if whole is None else _error(whole, want),
        }
