"""Train a TreeLSTM on the Python standard library's own functions, batched by batchgraph.

Each example is one stdlib function definition, parsed with ``ast`` and binarized (see
``batchgraph.data.stdlib``); the label is the stdlib package it comes from (``asyncio``,
``email``, ``tkinter``...). The model is per-example code — ``model.logits(tree)``
recurses over one tree — and batchgraph runs a whole batch of it as batched calls:

    with bg.BatchingPolicy() as policy:
        handles = [model.logits(t) for t in batch]   # records
    logits = torch.stack(bg.compute(handles))         # batched, autograd intact

At the end the same code runs eagerly, one tree at a time, on the same batches, and the
script prints the measured speed-up.

Run: ``python examples/treelstm.py`` (``make demo``); ``--help`` lists the flags.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

import batchgraph as bg
from batchgraph.cli import at_least
from batchgraph.data import Tree, stdlib_function_trees
from batchgraph.models import TreeLSTMClassifier


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=at_least(0), default=8, help="training epochs (default 8)")
    p.add_argument("--batch-size", type=at_least(1), default=32, help="trees per batch (default 32)")
    p.add_argument("--limit", type=at_least(1), default=2000,
                   help="stdlib functions to use, train + test (default 2000)")
    p.add_argument("--hidden", type=at_least(1), default=64, help="TreeLSTM/embedding size (default 64)")
    p.add_argument("--lr", type=float, default=0.2,
                   help="SGD learning rate on the summed loss (default 0.2)")
    p.add_argument("--classes", type=at_least(2), default=8, help="stdlib packages to tell apart")
    p.add_argument("--scheduler", choices=["agenda", "depth"], default="agenda")
    p.add_argument("--threads", type=at_least(1), default=1, help="intra-op threads (default 1)")
    p.add_argument("--timing-batches", type=at_least(1), default=2,
                   help="batches timed eagerly and batched for the speed-up (default 2)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def batches(trees: Sequence[Tree], size: int) -> list[list[Tree]]:
    return [list(trees[i : i + size]) for i in range(0, len(trees), size)]


def labels_of(batch: Sequence[Tree]) -> torch.Tensor:
    return torch.tensor([t.label for t in batch])


def batched_logits(model: TreeLSTMClassifier, batch: Sequence[Tree], scheduler: str
                   ) -> torch.Tensor:
    """The batch's logits ``(B, classes)``, computed by batchgraph."""
    with bg.BatchingPolicy(scheduler=scheduler):
        handles = [model.logits(t) for t in batch]
    return torch.stack(bg.compute(handles))


def eager_logits(model: TreeLSTMClassifier, batch: Sequence[Tree]) -> torch.Tensor:
    """The same per-example code run eagerly: the unbatched reference."""
    return torch.stack([model.logits(t) for t in batch])


@torch.no_grad()
def accuracy(model: TreeLSTMClassifier, trees: Sequence[Tree], scheduler: str) -> float:
    if not trees:
        return float("nan")
    correct = 0
    for batch in batches(trees, 256):  # inference: bigger batches, fewer launches
        pred = batched_logits(model, batch, scheduler).argmax(dim=1)
        correct += int((pred == labels_of(batch)).sum())
    return correct / len(trees)


def train(args: argparse.Namespace, model: TreeLSTMClassifier, train_set: list[Tree],
          test_set: list[Tree]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    order = list(train_set)
    for epoch in range(1, args.epochs + 1):
        random.Random(args.seed + epoch).shuffle(order)
        total_loss, correct, seen = 0.0, 0, 0
        start = time.perf_counter()
        bar = tqdm(batches(order, args.batch_size), desc=f"epoch {epoch}/{args.epochs}",
                   unit="batch", leave=False, file=sys.stderr,
                   disable=None)  # None: no bar when stderr is not a terminal (CI logs)
        for batch in bar:
            logits = batched_logits(model, batch, args.scheduler)
            y = labels_of(batch)
            loss = F.cross_entropy(logits, y, reduction="sum")
            optimizer.zero_grad()
            loss.backward()
            # Summed loss: the step grows with the batch, so cap it to keep SGD stable.
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            total_loss += float(loss.detach())
            correct += int((logits.argmax(dim=1) == y).sum())
            seen += len(batch)
            bar.set_postfix(loss=f"{total_loss / seen:.3f}", acc=f"{correct / seen:.3f}")
        elapsed = time.perf_counter() - start
        test_acc = accuracy(model, test_set, args.scheduler)
        print(f"epoch {epoch}: loss/tree {total_loss / seen:.3f}  train acc {correct / seen:.3f}"
              f"  test acc {test_acc:.3f}  ({seen / elapsed:.0f} trees/s training)", flush=True)


def measure_speedup(args: argparse.Namespace, model: TreeLSTMClassifier,
                    timing: list[list[Tree]]) -> None:
    """Time forward + backward of the same batches, eagerly and batched, in turns.

    Both run once untimed first, then three alternating rounds; medians are compared.
    """

    def step(run_batch: str, batches: list[list[Tree]]) -> float:
        start = time.perf_counter()
        for batch in batches:
            logits = (batched_logits(model, batch, args.scheduler) if run_batch == "batched"
                      else eager_logits(model, batch))
            F.cross_entropy(logits, labels_of(batch), reduction="sum").backward()
        model.zero_grad()
        return time.perf_counter() - start

    trees = sum(len(b) for b in timing)
    times: dict[str, list[float]] = {"eager": [], "batched": []}
    for name in times:  # warm-up, untimed: first calls pay one-off costs
        step(name, timing[:1])
    for _ in range(3):  # alternate, so a noisy neighbour slows both alike
        for name in times:
            times[name].append(step(name, timing))
    eager, batched = (statistics.median(times[n]) for n in ("eager", "batched"))
    print(f"\nspeed-up on {len(timing)} training batches of {args.batch_size} "
          f"(forward + backward, {trees} trees, {args.threads} thread(s)):")
    print(f"  eager per-example: {trees / eager:8.1f} trees/s")
    print(f"  batchgraph       : {trees / batched:8.1f} trees/s")
    print(f"  speed-up         : {eager / batched:8.1f}x")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    data = stdlib_function_trees(limit=args.limit, seed=args.seed, classes=args.classes)
    sizes = [t.size for t in data.train]
    print(f"stdlib function trees: {len(data.train)} train, {len(data.test)} test, "
          f"{len(data.vocab)} tokens, mean size {statistics.mean(sizes):.0f} nodes "
          f"(parsed in {time.perf_counter() - start:.1f}s)")
    print(f"classes: {', '.join(data.classes)}")
    print(f"chance: majority class {data.majority_baseline():.3f} of test, "
          f"uniform {1 / len(data.classes):.3f}")
    model = TreeLSTMClassifier(len(data.vocab), len(data.classes), hidden=args.hidden)
    train(args, model, data.train, data.test)
    measure_speedup(args, model, batches(data.train, args.batch_size)[: args.timing_batches])


if __name__ == "__main__":
    main()
