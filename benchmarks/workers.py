"""TreeLSTM training with recording and scheduling moved to DataLoader workers.

Compares, on the same SST-like batches, weights, loss (summed cross-entropy) and SGD:

* ``hand-batched PyTorch``: one cell call per tree level (the ceiling);
* ``batchgraph in-process``: record, schedule and execute in the training process;
* ``batchgraph + N workers``: workers record and schedule (``GraphCollate``), the
  training process only binds, executes and runs backward.

Variants run interleaved in rounds and report trees/s, ratios, and the training
process's time per minibatch split into wait-for-worker / bind / execute /
backward+step. The workers variant runs all its rounds through one loader pass
(``bg.EpochStream``, a round per epoch) as training runs its epochs, so the pipeline
fill is paid once (in the untimed warm-up); its wait is split into that fill, the
first batches of each round (built while the other variants ran) and the rest (which
show whether the worker keeps ahead of the training process). Then the
effect of bucketing (``BucketBatchSampler(pool=...)``) on launches and throughput, and
the schedule cache's hit rate and savings. Prints tables and writes JSON.

    python benchmarks/workers.py                  # batch 64, hidden 128, 1 worker
    python benchmarks/workers.py --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tree_workload import (
    TreeLSTM,
    forward_logits,
    hand_batched_logits,
    leaves_of,
    sst_like,
)

import batchgraph as bg
from batchgraph.bucketing import padding_waste

Batch = list[int]
PREFETCHED = 2  # batches a one-worker DataLoader keeps in flight (prefetch_factor 2)


class Planned:
    """A batch sampler whose epoch ``e`` is the ``e``-th of a planned list of rounds."""

    def __init__(self, rounds: list[list[Batch]]) -> None:
        self.rounds = rounds
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.rounds[self.epoch])

    def __len__(self) -> int:
        return len(self.rounds[self.epoch])


class Variant(ABC):
    """One way to train; ``run`` trains on a list of batches and accumulates timings."""

    def __init__(self, name: str, model: TreeLSTM, data: list[tuple[Any, int]]) -> None:
        self.name = name
        self.model = model
        self.data = data
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.seconds = 0.0
        self.trees = 0
        self.split: dict[str, float] = {}
        self.batches = 0
        self.losses: list[float] = []

    def step(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        loss = F.cross_entropy(logits, labels, reduction="sum")
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.losses.append(loss.item())

    def add(self, part: str, seconds: float) -> None:
        self.split[part] = self.split.get(part, 0.0) + seconds

    def labels(self, batch: Batch) -> torch.Tensor:
        return torch.tensor([self.data[i][1] for i in batch])

    def run(self, batches: list[Batch], timed: bool = True) -> None:
        start = time.perf_counter()
        self.train(batches, timed)
        if timed:
            self.seconds += time.perf_counter() - start
            self.trees += sum(len(b) for b in batches)
            self.batches += len(batches)

    @abstractmethod
    def train(self, batches: list[Batch], timed: bool) -> None:
        """Train on ``batches``, adding to ``split`` when ``timed``."""


class Hand(Variant):
    def train(self, batches: list[Batch], timed: bool) -> None:
        for batch in batches:
            t0 = time.perf_counter()
            logits = hand_batched_logits(self.model, [self.data[i][0] for i in batch])
            t1 = time.perf_counter()
            self.step(logits, self.labels(batch))
            if timed:
                self.add("forward", t1 - t0)
                self.add("backward+step", time.perf_counter() - t1)


class InProcess(Variant):
    def train(self, batches: list[Batch], timed: bool) -> None:
        for batch in batches:
            t0 = time.perf_counter()
            with bg.BatchingPolicy() as policy:
                hs = [self.model.logits(self.data[i][0]) for i in batch]
            t1 = time.perf_counter()
            logits = torch.stack(policy.compute(hs))
            t2 = time.perf_counter()
            self.step(logits, self.labels(batch))
            if timed and policy.stats is not None:
                self.add("record", t1 - t0)
                self.add("schedule", policy.stats.schedule_seconds)
                self.add("execute", t2 - t1 - policy.stats.schedule_seconds)
                self.add("backward+step", time.perf_counter() - t2)


class Workers(Variant):
    """Trains on batches that ``workers`` DataLoader processes record and schedule.

    ``plan`` lists the rounds this variant will be asked to train on, in order: one
    loader pass runs over all of them (``bg.EpochStream``, a round per epoch), as one
    pass runs over a training run's epochs.
    """

    def __init__(self, name: str, model: TreeLSTM, data: list[Any], workers: int,
                 plan: list[list[Batch]]) -> None:
        super().__init__(name, model, data)
        self.plan = bg.EpochStream(Planned(plan), len(plan))
        collate = bg.GraphCollate(model, forward_logits, target=1)
        self.loader = bg.graph_loader(
            data, collate, self.plan, num_workers=workers, timeout=120 if workers > 0 else 0,
        )
        self.epochs: Iterator[Iterator[bg.PortableBatch]] | None = None
        self.binder = bg.Binder(model)
        self.launches: list[int] = []
        self.hits: list[bool] = []
        self.worker_split: dict[str, float] = {}
        self.worker_schedule: dict[bool, list[float]] = {True: [], False: []}
        self.waits: dict[str, list[float]] = {"fill": [], "prefetched": [], "steady": []}

    def train(self, batches: list[Batch], timed: bool) -> None:
        first_of_run = self.epochs is None
        if self.epochs is None:  # the workers start on the first request
            self.epochs = self.plan.epochs(self.loader)
        epoch = next(self.epochs)
        for i, indices in enumerate(batches):
            t0 = time.perf_counter()
            batch = next(epoch)
            t1 = time.perf_counter()
            assert batch.indices == indices, "the loader runs the planned rounds in order"
            stats = self.binder.stats
            bind_before, exec_before = stats.bind_seconds, stats.execute_seconds
            logits = self.binder.run(batch, stack=True)
            t2 = time.perf_counter()
            self.step(logits, batch.targets)
            # The run's first batch waits for a whole collate (the pipeline fill, once
            # per run); the next PREFETCHED of a round were built while the other
            # variants ran; the rest show whether the worker keeps ahead of training.
            kind = "fill" if first_of_run and not i else "prefetched" if i < PREFETCHED else "steady"
            if timed or kind == "fill":
                self.waits[kind].append(t1 - t0)
            if timed:
                self.add("wait-for-worker", t1 - t0)
                self.add("bind", stats.bind_seconds - bind_before)
                self.add("execute", stats.execute_seconds - exec_before)
                self.add("backward+step", time.perf_counter() - t2)
                for part, sec in (("record", batch.record_seconds),
                                  ("prune+schedule+export", batch.schedule_seconds)):
                    self.worker_split[part] = self.worker_split.get(part, 0.0) + sec
                self.launches.append(batch.launches)
                self.hits.append(batch.cache_hit)
                self.worker_schedule[batch.cache_hit].append(batch.schedule_seconds)


def chunks(order: list[int], size: int) -> list[Batch]:
    return [order[i : i + size] for i in range(0, len(order) - size + 1, size)]


def interleaved(variants: list[Variant], rounds: list[list[Batch]], warmup: list[Batch]) -> None:
    for v in variants:
        v.run(warmup, timed=False)
    for batches in rounds:
        for v in variants:
            v.run(batches)


def row(v: Variant, hand: float, inproc: float) -> dict[str, Any]:
    rate = v.trees / v.seconds
    return {
        "variant": v.name,
        "trees_per_s": round(rate, 1),
        "vs_hand": round(rate / hand, 2),
        "vs_in_process": round(rate / inproc, 2),
        "ms_per_batch": {k: round(1e3 * s / v.batches, 2) for k, s in v.split.items()},
        "final_loss": v.losses[-1],
    }


def print_table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    print(f"\n{title}")
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batches", type=int, default=12, help="batches per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/workers.json")
    parser.add_argument("--skip-extras", action="store_true", help="throughput table only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.rounds, args.hidden = 3, 1, 32
    torch.set_num_threads(1)
    size, per_round = args.batch_size, args.batches
    total = size * per_round * args.rounds
    data = sst_like(total + 3 * size, seed=0)
    torch.manual_seed(0)
    base = TreeLSTM(dim=args.hidden, hidden=args.hidden)
    make: Callable[[], TreeLSTM] = lambda: copy.deepcopy(base)  # noqa: E731
    order = list(range(total))
    rounds = [chunks(order[r * size * per_round :], size)[:per_round] for r in range(args.rounds)]
    warmup = [list(range(total + i * size, total + (i + 1) * size)) for i in range(3)]
    name = f"batchgraph + {args.workers} worker{'s' if args.workers != 1 else ''}"
    variants: list[Variant] = [
        Hand("hand-batched PyTorch", make(), data),
        InProcess("batchgraph in-process", make(), data),
        Workers(name, make(), data, args.workers, [warmup, *rounds]),
    ]
    interleaved(variants, rounds, warmup)
    hand_rate = variants[0].trees / variants[0].seconds
    in_rate = variants[1].trees / variants[1].seconds
    rows = [row(v, hand_rate, in_rate) for v in variants]
    for r in rows:
        r["split"] = " ".join(f"{k} {v}" for k, v in r["ms_per_batch"].items())
    print(f"TreeLSTM training, SST-like trees, batch {size}, hidden {args.hidden}, "
          f"1 intra-op thread, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; {args.rounds} rounds x {per_round} batches")
    print_table("throughput (main-process ms per batch split)", rows,
                ["variant", "trees_per_s", "vs_hand", "vs_in_process", "split"])
    losses = [v.losses[-1] for v in variants]
    print(f"final losses: {', '.join(f'{x:.6f}' for x in losses)}")
    worker = variants[2]
    assert isinstance(worker, Workers)
    rows[2]["worker_ms_per_batch"] = {
        k: round(1e3 * s / worker.batches, 2) for k, s in worker.worker_split.items()
    }
    print(f"worker ms per batch (in the worker process): {rows[2]['worker_ms_per_batch']}")
    rows[2]["wait_ms"] = {kind: round(1e3 * statistics.mean(w), 2) if w else None
                          for kind, w in worker.waits.items()}
    print(f"wait-for-worker ms per batch: {rows[2]['wait_ms']} (fill: the run's first batch, "
          f"in the untimed warm-up; prefetched: a round's first {PREFETCHED}, built while the "
          "other variants ran; steady: the rest)")

    result: dict[str, Any] = {
        "machine": {"processor": platform.processor(), "cores": os.cpu_count(),
                    "torch": torch.__version__, "threads": 1},
        "sizes": {"batch": size, "hidden": args.hidden, "workers": args.workers,
                  "rounds": args.rounds, "batches_per_round": per_round},
        "throughput": rows,
    }
    if not args.skip_extras:
        result.update(extras(args, data, make, warmup, rounds, total))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def extras(args: argparse.Namespace, data: list[Any], make: Callable[[], TreeLSTM],
           warmup: list[Batch], rounds: list[list[Batch]], total: int) -> dict[str, Any]:
    """Bucketing's effect on launches and throughput; the schedule cache's hit rate."""
    size, per_round = args.batch_size, args.batches
    # Bucketing: same examples, pools of increasing strictness, workers variant.
    sizes = [leaves_of(t) for t, _ in data[:total]]
    bucket_rows = []
    for pool in (1, 8, None):
        sampler = bg.BucketBatchSampler(sizes, size, pool=pool, seed=1, drop_last=True)
        batches = sampler.batches(0)[: per_round * args.rounds]
        v = Workers(f"pool={pool}", make(), data, args.workers, [warmup, batches])
        v.run(warmup, timed=False)
        v.run(batches)
        bucket_rows.append({
            "pool": str(pool),
            "padding_waste": round(padding_waste(batches, sizes), 3),
            "launches_per_batch": round(statistics.mean(v.launches), 1),
            "trees_per_s": round(v.trees / v.seconds, 1),
        })
    print_table("bucketing (workers variant)", bucket_rows,
                ["pool", "padding_waste", "launches_per_batch", "trees_per_s"])

    # Schedule cache: shuffled SST-like batches never repeat a structure; a repeated
    # epoch (same batches again, persistent workers) hits every time.
    cached = Workers("cache", make(), data, args.workers, [rounds[0], rounds[0]])
    cached.run(rounds[0])
    cached.run(rounds[0])
    miss, hit = cached.worker_schedule[False], cached.worker_schedule[True]
    cache = {
        "hit_rate_first_epoch": sum(cached.hits[:per_round]) / per_round,
        "hit_rate_repeated_epoch": sum(cached.hits[per_round:]) / per_round,
        "worker_schedule_ms_miss": round(1e3 * statistics.mean(miss), 2) if miss else None,
        "worker_schedule_ms_hit": round(1e3 * statistics.mean(hit), 2) if hit else None,
    }
    print(f"\nschedule cache: {cache}")
    return {"bucketing": bucket_rows, "cache": cache}


if __name__ == "__main__":
    main()
