"""A batched program whose schedule and values ``test_hash_seed`` compares across
``PYTHONHASHSEED`` values: run as a script, it prints each compute's steps (key
label and the nodes of each launch, in order) and the bytes of every value.

It mixes what could be ordered by hashing: string arguments (einsum equations, pad
modes, reduction names, keyword names), modules and functions as keys, identical
calls merged, examples of several lengths, and coroutine examples; and the property
tests' modules (``Modules``), which must start the same in every process for a
failure they find to reproduce."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import batchgraph as bg
from tests.property.tensor_programs import Modules

# Built before any seeding, as the property tests build theirs at import.
FUZZED = Modules().double()
torch.manual_seed(0)
LIN = nn.Linear(4, 4).double()
NORM = nn.LayerNorm(4).double()
CELL = nn.GRUCell(4, 4).double()
EMBED = nn.Embedding(10, 4).double()
CONV = nn.Conv1d(4, 2, 2).double()


@bg.batched_func
def _mix(x: torch.Tensor, *, scale: float, mode: str) -> torch.Tensor:
    padded = F.pad(x.unsqueeze(0), (1, 1), mode=mode).squeeze(0)
    return torch.einsum("i,i->", padded, padded) * scale + x


def _example(i: int, x: torch.Tensor) -> Any:
    h = NORM(LIN(x))
    for step in range(1 + i % 3):
        h = CELL(h.unsqueeze(0), LIN(x).unsqueeze(0)).squeeze(0)
        h = _mix(h, scale=0.5 + step, mode="reflect" if step % 2 else "replicate")
    token = EMBED(torch.tensor(i % 10))
    seq = torch.stack([h, token, x])
    mixed = CONV(seq.t()).flatten()
    loss = F.mse_loss(mixed, x, reduction="sum")
    return {"loss": loss, "h": NORM(h), "sum": h.sum(dim=-1, keepdim=True)}


async def _coroutine(i: int, x: torch.Tensor) -> torch.Tensor:
    h = await bg.value(LIN(x))
    if float(h.detach().sum()) > 0:
        h = await bg.value(NORM(h + 1))
    return await bg.value(_mix(h, scale=1.5, mode="replicate"))


def _steps(policy: bg.BatchingPolicy) -> list[str]:
    schedule = policy.last_schedule
    assert schedule is not None
    keys = policy.graph.keys
    return [f"{keys[s.key].label} {s.nodes}" for s in schedule.steps]


def main() -> None:
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, generator=gen, dtype=torch.float64) for _ in range(7)]
    xs.append(xs[2].clone())  # identical calls: merged
    lines: list[str] = []
    with bg.BatchingPolicy() as policy:
        results = bg.compute([_example(i, x) for i, x in enumerate(xs)])
        lines += _steps(policy)
    for result in results:
        for name in sorted(result):
            lines.append(f"{name} {result[name].detach().numpy().tobytes().hex()}")
    for value in bg.run_all([_coroutine(i, x) for i, x in enumerate(xs)]):
        lines.append(value.detach().numpy().tobytes().hex())
    lines += [p.detach().numpy().tobytes().hex() for p in FUZZED.parameters()]
    norm = bg.batched_func(FUZZED.norm)
    with bg.BatchingPolicy():  # a LayerNorm of nearly constant rows (1 ulp apart)
        rows = bg.compute([norm(FUZZED.lin(x) * 1e-3 + 1) for x in xs])
    lines += [row.detach().numpy().tobytes().hex() for row in rows]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
