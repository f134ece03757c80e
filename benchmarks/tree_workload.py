"""The TreeLSTM workload of ``benchmarks/workers.py``: SST-like trees, the per-example
model, and the same model hand-batched (one cell call per tree level: the ceiling).

Trees are nested tuples (an ``int`` token is a leaf, a pair is a node) so they pickle
cheaply to DataLoader workers. Leaf counts follow SST's sentence lengths (gamma, mean
19, sd 9, at most 56), bracketing is uniformly random, tokens uniform over the vocab.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

import batchgraph as bg

Tree = Any  # int | tuple[Tree, Tree]


def sst_like(n: int, seed: int = 0, vocab: int = 5000, classes: int = 5) -> list[tuple[Tree, int]]:
    """``n`` (tree, label) pairs shaped like SST parse trees."""
    rng = random.Random(seed)
    shape, scale = (19.0 / 9.0) ** 2, 81.0 / 19.0

    def bracket(leaves: int) -> Tree:
        if leaves == 1:
            return int(rng.random() * vocab)
        split = 1 + int(rng.random() * (leaves - 1))
        return (bracket(split), bracket(leaves - split))

    out = []
    for _ in range(n):
        leaves = 0
        while not 1 <= leaves <= 56:
            leaves = max(1, round(rng.gammavariate(shape, scale)))
        out.append((bracket(leaves), int(rng.random() * classes)))
    return out


def leaves_of(tree: Tree) -> int:
    return 1 if isinstance(tree, int) else leaves_of(tree[0]) + leaves_of(tree[1])


class LeafCell(nn.Module):
    batch_key = bg.StackKey  # takes a leading batch dimension: plain stacking

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 3 * hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.proj(x).chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c


class BinaryCell(nn.Module):
    batch_key = bg.StackKey

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * hidden, 5 * hidden)

    def forward(
        self, hl: torch.Tensor, cl: torch.Tensor, hr: torch.Tensor, cr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i, fl, fr, o, u = self.proj(torch.cat([hl, hr], dim=-1)).chunk(5, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeLSTM(bg.BatchedModule):
    """Binary TreeLSTM classifier written for one tree."""

    def __init__(self, vocab: int = 5000, dim: int = 128, hidden: int = 128, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.leaf = LeafCell(dim, hidden)
        self.cell = BinaryCell(hidden)
        self.out = nn.Linear(hidden, classes)

    def encode(self, tree: Tree) -> Any:
        if isinstance(tree, int):
            return self.leaf(self.embed(bg.batched_value(tree)))
        (hl, cl), (hr, cr) = self.encode(tree[0]), self.encode(tree[1])
        return self.cell(hl, cl, hr, cr)

    def logits(self, tree: Tree) -> Any:
        h, _ = self.encode(tree)
        return self.out(h)


def forward_logits(model: TreeLSTM, item: tuple[Tree, int]) -> Any:
    """The per-example function the workers record: logits of the item's tree."""
    return model.logits(item[0])


def hand_batched_logits(model: TreeLSTM, trees: list[Tree]) -> torch.Tensor:
    """The same model batched by hand: all leaves at once, then one cell call per height.

    States live in a frontier *pool* ``[h | c]`` of nodes whose parent has not run: each
    level does one ``index_select`` (left children, right children, still-pending rows)
    and one ``cat`` (pending rows, new states), so it copies the frontier only, not
    every state computed so far. Index lists are built by one pass of plain Python.
    """
    tokens: list[int] = []
    leaf_ids: list[int] = []
    levels: list[list[tuple[int, int, int]]] = []  # per height >= 1: (id, left, right)
    count = [0]

    def walk(tree: Tree) -> tuple[int, int]:  # -> (height, node id)
        if isinstance(tree, int):
            tokens.append(tree)
            leaf_ids.append(count[0])
            count[0] += 1
            return 0, count[0] - 1
        (hl, left), (hr, right) = walk(tree[0]), walk(tree[1])
        height = 1 + max(hl, hr)
        while len(levels) < height:
            levels.append([])
        count[0] += 1
        levels[height - 1].append((count[0] - 1, left, right))
        return height, count[0] - 1

    roots = [walk(t)[1] for t in trees]
    hidden = model.out.in_features
    h, c = model.leaf(model.embed(torch.tensor(tokens)))
    pool = torch.cat([h, c], dim=1)
    pool_ids = leaf_ids
    for level in levels:
        row = {node: r for r, node in enumerate(pool_ids)}
        used = {x for _, a, b in level for x in (a, b)}
        pending = [node for node in pool_ids if node not in used]
        index = [row[a] for _, a, _ in level] + [row[b] for _, _, b in level]
        index += [row[node] for node in pending]
        rows = pool.index_select(0, torch.tensor(index))
        n = len(level)
        left, right = rows[:n], rows[n : 2 * n]
        hn, cn = model.cell(left[:, :hidden], left[:, hidden:], right[:, :hidden], right[:, hidden:])
        pool = torch.cat([rows[2 * n :], torch.cat([hn, cn], dim=1)])
        pool_ids = pending + [node for node, _, _ in level]
    row = {node: r for r, node in enumerate(pool_ids)}
    logits: torch.Tensor = model.out(
        pool.index_select(0, torch.tensor([row[r] for r in roots]))[:, :hidden]
    )
    return logits
