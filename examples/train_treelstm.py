"""Train a TreeLSTM on the standard library's own function ASTs, recording in DataLoader workers.

Each example is one function of the Python standard library, parsed with ``ast`` and
binarized (node type names are the tokens); its label is the stdlib package it comes
from. Worker processes record and schedule each minibatch (``bg.GraphCollate``); the
training process only runs the schedules with the real weights and does backward.
Batches are bucketed by tree size (``bg.BucketBatchSampler``), and one loader pass
spans all epochs (``bg.EpochStream``), so the workers never wait at an epoch's end.
Checkpoints are written with ``torch.save`` after every epoch and read back with
``torch.load(weights_only=True)``.

    python examples/train_treelstm.py --workers 1 --epochs 3
    python examples/train_treelstm.py --workers 1 --epochs 5 --resume   # continues
    python examples/train_treelstm.py --in-process --epochs 3           # same final loss
"""

from __future__ import annotations

import argparse
import ast
import sys
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import batchgraph as bg
from batchgraph.cli import at_least

PACKAGES = ("asyncio", "email", "json", "http", "unittest", "xml", "concurrent", "importlib")
MAX_LEAVES = 64


def binarize(node: ast.AST, vocab: dict[str, int]) -> Any:
    """An AST as a binary tree: a node's type token, then its children folded in."""
    tree: Any = vocab.setdefault(type(node).__name__, len(vocab))
    for child in ast.iter_child_nodes(node):
        tree = (tree, binarize(child, vocab))
    return tree


def leaves(tree: Any) -> int:
    return 1 if isinstance(tree, int) else leaves(tree[0]) + leaves(tree[1])


def stdlib_trees(limit: int) -> tuple[list[tuple[Any, int]], dict[str, int]]:
    """Up to ``limit`` (tree, package label) pairs, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    vocab: dict[str, int] = {}
    per_package = max(1, limit // len(PACKAGES))
    data: list[tuple[Any, int]] = []
    for label, package in enumerate(PACKAGES):
        found = 0
        for path in sorted((root / package).rglob("*.py")):
            if found == per_package:
                break
            try:
                module = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(module):
                if isinstance(node, ast.FunctionDef) and found < per_package:
                    tree = binarize(node, vocab)
                    if leaves(tree) <= MAX_LEAVES:
                        data.append((tree, label))
                        found += 1
    return data, vocab


class LeafCell(nn.Module):
    batch_key = bg.StackKey  # works on a leading batch dimension: plain stacking

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.proj(x).chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c


class BinaryCell(nn.Module):
    batch_key = bg.StackKey

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * dim, 5 * dim)

    def forward(self, hl: torch.Tensor, cl: torch.Tensor, hr: torch.Tensor, cr: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        i, fl, fr, o, u = self.proj(torch.cat([hl, hr], dim=-1)).chunk(5, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeLSTM(bg.BatchedModule):
    """Per-example code: encode one tree, classify its root."""

    def __init__(self, vocab: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.leaf = LeafCell(dim)
        self.cell = BinaryCell(dim)
        self.out = nn.Linear(dim, classes)

    def encode(self, tree: Any) -> Any:
        if isinstance(tree, int):
            return self.leaf(self.embed(bg.batched_value(tree)))
        (hl, cl), (hr, cr) = self.encode(tree[0]), self.encode(tree[1])
        return self.cell(hl, cl, hr, cr)

    def logits(self, item: tuple[Any, int]) -> Any:
        h, _ = self.encode(item[0])
        return self.out(h)


def batches_in_process(model: TreeLSTM, data: list[Any], sampler: Any) -> Any:
    """The reference path: record, schedule and execute in this process."""
    for indices in sampler:
        with bg.BatchingPolicy() as policy:
            hs = [model.logits(data[i]) for i in indices]
        yield torch.stack(policy.compute(hs)), torch.tensor([data[i][1] for i in indices])


def batches_from_workers(epoch: Any, binder: bg.Binder) -> Any:
    """Workers recorded and scheduled ``epoch``'s batches; here we only bind and execute."""
    for batch in epoch:
        if len(batch):
            # stack=True (one gather) is faster; stacking the list like the in-process
            # path keeps even the gradient summation order of merged duplicate trees
            # identical, so both paths end on bitwise the same loss.
            yield torch.stack(binder.run(batch)), batch.targets


def main(argv: list[str] | None = None) -> float:
    """Train; returns the last minibatch's loss (for comparing the two paths)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=at_least(0), default=1)
    parser.add_argument("--in-process", action="store_true", help="record in this process")
    parser.add_argument("--epochs", type=at_least(0), default=3)
    parser.add_argument("--batch-size", type=at_least(1), default=64)
    parser.add_argument("--limit", type=at_least(1), default=2000, help="number of trees")
    parser.add_argument("--dim", type=at_least(1), default=64)
    parser.add_argument("--pool", type=at_least(1), default=8, help="bucketing pool, in batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="treelstm.pt")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data, vocab = stdlib_trees(args.limit)
    torch.manual_seed(args.seed)
    model = TreeLSTM(len(vocab), args.dim, len(PACKAGES))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    checkpoint = Path(args.checkpoint)
    if args.resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["epoch"])
    sampler = bg.BucketBatchSampler(
        [leaves(t) for t, _ in data], args.batch_size, pool=args.pool, seed=args.seed
    )
    # Workers hold the model's structure only: weights loaded above never travel.
    collate = bg.GraphCollate(model, "logits", target=1, skip_errors=True)
    # One loader pass over every epoch left: the workers build the next epoch's first
    # batches while this epoch ends, instead of starting after each epoch.
    stream = bg.EpochStream(sampler, max(0, args.epochs - start), start_epoch=start)
    loader = bg.graph_loader(
        data, collate, stream, num_workers=args.workers, timeout=300 if args.workers else 0
    )
    binder = bg.Binder(model)
    from_workers = None if args.in_process else stream.epochs(loader)
    loss = torch.zeros(())
    for epoch in range(start, args.epochs):
        if from_workers is None:
            sampler.set_epoch(epoch)
            batches = batches_in_process(model, data, sampler)
        else:
            batches = batches_from_workers(next(from_workers), binder)
        total, seen = 0.0, 0
        bar = tqdm(total=len(data), unit="tree", desc=f"epoch {epoch}", disable=True if args.quiet else None)
        for logits, labels in batches:
            loss = F.cross_entropy(logits, labels, reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
            seen += len(labels)
            bar.update(len(labels))
            bar.set_postfix(loss=f"{total / seen:.4f}")
        bar.close()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "epoch": epoch + 1}, checkpoint)
    if binder.stats.skipped:
        print(f"skipped {binder.stats.skipped} examples whose recording failed")
    print(f"final minibatch loss {loss.item():.6f}")
    return loss.item()


if __name__ == "__main__":
    main()
