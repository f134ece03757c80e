"""Small per-example models shared by the property tests (float64 throughout)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import batchgraph as bg

Tree = Any  # an int token (leaf) or a (left, right) pair


class LeafCell(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.proj(x).chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c


class BinaryCell(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * dim, 5 * dim)

    def forward(self, hl: torch.Tensor, cl: torch.Tensor, hr: torch.Tensor, cr: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        i, fl, fr, o, u = self.proj(torch.cat([hl, hr], dim=-1)).chunk(5, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeModel(bg.BatchedModule):
    def __init__(self, vocab: int = 20, dim: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.leaf = LeafCell(dim)
        self.cell = BinaryCell(dim)
        self.out = nn.Linear(dim, classes)

    def encode(self, tree: Tree) -> Any:
        if isinstance(tree, int):
            return self.leaf(self.embed(bg.batched_value(tree)))
        (hl, cl), (hr, cr) = self.encode(tree[0]), self.encode(tree[1])
        return self.cell(hl, cl, hr, cr)

    def logits(self, tree: Tree) -> Any:
        h, _ = self.encode(tree)
        return self.out(h)


def scaled_softplus(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """No fast rule: batched through vmap."""
    return torch.nn.functional.softplus(x * s.sum())


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x), x * 0.5


class DagModel(bg.BatchedModule):
    """Executes a DAG description: each node applies an op to earlier nodes."""

    OPS = ("linear", "tanh", "add", "mul", "cell", "lstm", "vmap", "pair", "index", "scale")

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.dim = dim
        self.inp = nn.Linear(dim, dim)
        self.lin = nn.Linear(dim, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.lstm = nn.LSTMCell(dim, dim)
        self.pair = Pair()
        self.softplus = bg.batched_func(scaled_softplus)

    def run(self, x: Any, dag: list[tuple[str, list[int]]]) -> Any:
        values = [self.inp(x)]
        for op, parents in dag:
            a, b = values[parents[0]], values[parents[-1]]
            if op == "linear":
                v = self.lin(a)
            elif op == "tanh":
                v = torch.tanh(a)
            elif op == "add":
                v = a + b
            elif op == "mul":
                v = a * b * 0.5
            elif op == "cell":
                v = self.mix(torch.cat([a, b], dim=-1))
            elif op == "lstm":
                v, _ = self.lstm(a, (b, a))
            elif op == "vmap":
                v = self.softplus(a, b)
            elif op == "pair":
                first, second = self.pair(a)
                v = first - second
            elif op == "index":
                v = a * a[0]
            else:
                v = a.sum() * b / self.dim
            values.append(v)
        return values[-1]
