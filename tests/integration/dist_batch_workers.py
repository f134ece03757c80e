"""Workers for the torch.distributed backend's batch semantics tests (spawned processes).

Each job builds small float64 models on every rank, trains one step with the
torch.distributed backend and reports what it compares with single-device training.
Launched with :func:`tests.integration.dist_workers.launch` (2 ranks, gloo).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

B, T, V, H = 8, 5, 7, 6


class TokenHead(nn.Module):
    """Logits of every token, flattened: (B, T, H) -> (B*T, V); dim 0 is not the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(H, V, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h).reshape(-1, V)


def token_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target.reshape(-1))


def _token_model() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(H, H, dtype=torch.float64), nn.Tanh()), TokenHead()]


def _grad_error(got: nn.Module, ref: nn.Module) -> float:
    err = 0.0
    for p, q in zip(got.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        err = max(err, (p.grad - q.grad).abs().max().item())
    return err


def job_output_not_batch(rank: int, world: int) -> dict[str, Any]:
    """(B*T, V) logits against (B, T) targets with a mean loss: the microbatch weights
    must count samples (B), not output rows (B*T)."""
    from batchgraph.pipeline import Pipeline

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    y = torch.randint(0, V, (B, T), generator=gen)
    ref = nn.Sequential(*_token_model())
    ref_loss = token_loss(ref(x), y)
    ref_loss.backward()
    mods = _token_model()
    # 3 microbatches of 8 samples: sizes 3, 3, 2, so unequal weights are exercised too.
    with Pipeline(mods, microbatches=3, schedule="1f1b", loss_fn=token_loss,
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
    return {
        "error": _grad_error(mods[rank], ref[rank]),
        "loss": None if loss is None else float(loss),
        "ref_loss": float(ref_loss),
    }


def job_batch_mismatch(rank: int, world: int) -> dict[str, Any]:
    """8 inputs but 4 targets: every rank refuses the step with the threads backend's
    error; the pipeline then trains a good batch exactly (nothing of the refused one left)."""
    from batchgraph.pipeline import Pipeline, PipelineConfigError

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64))
    mods = [nn.Linear(4, 4, dtype=torch.float64), nn.Linear(4, 4, dtype=torch.float64)]
    for m, r in zip(mods, ref):
        m.load_state_dict(r.state_dict())
    nn.MSELoss()(ref(x), y).backward()
    out: dict[str, Any] = {}
    with Pipeline(mods, microbatches=4, schedule="1f1b", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        try:
            pipe.train_step(x if rank == 0 else None, y[:4] if rank == world - 1 else None)
            out["refused"] = "no error"
        except PipelineConfigError as exc:
            out["refused"] = str(exc)
        try:
            pipe.train_step(x if rank == 0 else None, None)
            out["missing"] = "no error"
        except PipelineConfigError as exc:
            out["missing"] = str(exc)
        try:  # targets with a graph: refused, their gradient would be dropped
            y_grad = y.clone().requires_grad_(True) * 1
            pipe.train_step(x if rank == 0 else None, y_grad if rank == world - 1 else None)
            out["grad_targets"] = "no error"
        except PipelineConfigError as exc:
            out["grad_targets"] = str(exc)
        out["untouched"] = all(p.grad is None for p in mods[rank].parameters())
        pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
    out["error"] = _grad_error(mods[rank], ref[rank])
    return out


class Embed(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.emb(ids))


class TiedHead(nn.Module):
    """Logits from the embedding's own weight (tied input and output embeddings)."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb = emb
        self.scale = nn.Linear(H, H, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.scale(h) @ self.emb.weight.t()


def _tied_model() -> list[nn.Module]:
    torch.manual_seed(0)
    emb = nn.Embedding(V, H, dtype=torch.float64)
    return [Embed(emb), TiedHead(emb)]


def job_tied_across_ranks(rank: int, world: int) -> dict[str, Any]:
    """An embedding used by stage 0 (rank 0) and stage 1 (rank 1): after two zb-h1 steps
    (weight gradients in their own W actions) each rank's copy has the single-device
    gradient of both uses, accumulated; a tied model built on meta starts equal."""
    from batchgraph.pipeline import Pipeline

    ids = torch.arange(12) % V
    y = (ids + 1) % V
    ref = nn.Sequential(*_tied_model())
    for _ in range(2):
        nn.CrossEntropyLoss()(ref(ids), y).backward()
    mods = _tied_model()
    with Pipeline(mods, microbatches=3, schedule="zb-h1", loss_fn=nn.CrossEntropyLoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        for _ in range(2):
            pipe.train_step(ids if rank == 0 else None, y if rank == world - 1 else None)
    out: dict[str, Any] = {"error": _grad_error(mods[rank], ref[rank])}
    torch.manual_seed(rank)  # each rank initialises its stage differently
    with torch.device("meta"):
        emb = nn.Embedding(V, H, dtype=torch.float64)
        net = nn.Sequential(Embed(emb), TiedHead(emb))
    with Pipeline(net, stages=2, microbatches=2, loss_fn=nn.CrossEntropyLoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        (stage,) = pipe._runtime.stages.values()  # type: ignore[union-attr]
        out["meta_tied"] = stage.module.get_parameter("0.emb.weight").sum().item()
    return out


def job_counted_mean_over_replicas(rank: int, world: int) -> dict[str, Any]:
    """One stage, two data-parallel replicas with shards of 6 and 4 samples, and a mean
    cross-entropy with ignored targets: the count it divides by is the whole batch's."""
    from batchgraph.pipeline import DistributedPipeline

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, H, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2, 1, 0, 2, 2, 1, 0])  # shards: 3 of 6 ignored, 1 of 4
    out: dict[str, Any] = {}
    for name, loss_fn in (
        ("plain", nn.CrossEntropyLoss()),
        ("ignore_index", nn.CrossEntropyLoss(ignore_index=0)),
    ):
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, 3)).double()
        want = loss_fn(net(x), y)
        want.backward()
        ref_grads = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
        net.zero_grad(set_to_none=True)
        a, b = ((0, 6), (6, 10))[rank]
        with DistributedPipeline(net, stages=1, replicas=2, microbatches=2, loss_fn=loss_fn,
                                 timeout=20) as pipe:  # fmt: skip
            loss = pipe.train_step(x[a:b], y[a:b])
        grads = [p.grad for p in net.parameters()]
        out[name] = {
            "error": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),  # type: ignore[operator]
            "loss": float(loss) if loss is not None else None,
            "ref_loss": float(want),
        }
    return out


def job_inputs_from_the_callers_graph(rank: int, world: int) -> dict[str, Any]:
    """Inputs computed by a layer run before the pipeline (on the first rank): its
    gradient arrives once, as one device's backward gives it."""
    from batchgraph.pipeline import Pipeline

    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 10, (8,), generator=gen)
    y = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    torch.manual_seed(5)
    embed = nn.Embedding(10, H, dtype=torch.float64)
    mods = [nn.Sequential(nn.Linear(H, H, dtype=torch.float64), nn.Tanh()),
            nn.Linear(H, 2, dtype=torch.float64)]  # fmt: skip
    nn.MSELoss()(nn.Sequential(*mods)(embed(ids) * 2), y).backward()
    ref = [p.grad.clone() for p in embed.parameters()]  # type: ignore[union-attr]
    ref_own = [p.grad.clone() for p in mods[rank].parameters()]  # type: ignore[union-attr]
    for p in [*embed.parameters(), *mods[rank].parameters()]:
        p.grad = None
    with Pipeline(mods, microbatches=4, schedule="1f1b", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        x = embed(ids) * 2 if rank == 0 else None
        pipe.train_step(x, y if rank == world - 1 else None)
    got = [*embed.parameters()] if rank == 0 else []
    return {
        "error": max(
            (p.grad - g).abs().max().item()  # type: ignore[operator]
            for p, g in [*zip(got, ref), *zip(mods[rank].parameters(), ref_own)]
        )
    }
