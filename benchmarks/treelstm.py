"""TreeLSTM throughput: eager per-example vs hand-batched vs batchgraph (agenda, by-depth).

For each data set (stdlib function ASTs; SST-like random trees) and batch size, four
variants run the same model (one ``state_dict`` copied into each), on the same batches,
with the same loss (summed cross-entropy), optimizer (SGD) and embedding:

- ``eager``:  ``TreeLSTMClassifier.logits`` per tree, no policy — the unbatched baseline;
- ``hand``:   ``HandBatchedTreeLSTM`` — one batched cell call per tree level (the ceiling);
- ``agenda``: the same per-example code under ``bg.BatchingPolicy(scheduler="agenda")``;
- ``depth``:  the same under ``scheduler="depth"``;
- ``workers``: the same per-example code recorded and scheduled in ``--workers``
  DataLoader worker processes (``bg.GraphCollate``); the timed process only binds,
  executes, and runs backward. One loader pass spans all rounds (``bg.EpochStream``,
  as one pass spans a training run's epochs), so the workers' pipeline fill is paid
  once, in the first round, and reported as ``fill_ms``; no schedule cache, as rounds
  repeat the same batches. While the other variants run, the workers build the next
  round's first two batches (what the loader keeps in flight); the wait for the
  later batches of each round (``late_wait_ms``) shows whether they keep ahead of
  the training process, as they must for that head start not to flatter the row.
  Where a round has no later batches (batch 256: one batch per round), the whole
  round was built ahead and the row is marked "NOT COMPARABLE".

Before timing, every variant's loss on the same batch must match eager's to 1e-5
(relative). Timing alternates the variants in rounds (the machine is shared and noisy)
and reports the median trees/s over rounds, for inference (forward under ``no_grad``)
and training (forward, loss, backward, SGD step); "best x hand" compares the variants'
fastest time for each batch over the rounds instead (steadier on a busy host). Also
reported, from ``policy.stats``: launches vs the lower bound (for the first batch), and recording + scheduling time in
microseconds per computed node (``stats.nodes``, after identical calls are merged) and
per recorded call (``stats.calls_recorded``).

Run: ``python benchmarks/treelstm.py`` (about 5-10 minutes) or ``--quick`` (well under a
minute); ``--workers 0`` leaves out the workers row. Prints a table and writes ``benchmarks/results/treelstm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import batchgraph as bg
from batchgraph.data import Tree, sst_like_trees, stdlib_function_trees
from batchgraph.models import HandBatchedTreeLSTM, TreeLSTMClassifier

VARIANTS = ("eager", "hand", "agenda", "depth", "workers")
MODES = ("inference", "training")
RESULTS = Path(__file__).resolve().parent / "results" / "treelstm.json"
PREFETCHED = 2  # batches a one-worker DataLoader keeps in flight (prefetch_factor 2)


@dataclass
class Row:
    """One (data set, mode, batch size, variant) measurement."""

    dataset: str
    mode: str
    batch: int
    variant: str
    trees_per_s: float
    rounds: list[float]
    vs_eager: float = 0.0
    vs_hand: float = 0.0
    # From each batch's fastest time over the rounds (see ``measure``).
    best_trees_per_s: float = 0.0
    best_vs_hand: float = 0.0
    launches: int | None = None
    lower_bound: int | None = None
    nodes: int | None = None
    record_schedule_us_per_node: float | None = None
    record_schedule_us_per_call: float | None = None
    fill_ms: float | None = None  # workers: the wait for the run's first batch
    late_wait_ms: float | None = None  # workers: mean wait, batches past the prefetched
    batches_per_round: int = 0


class BatchFeed:
    """The timed batches, recorded and scheduled by DataLoader workers.

    One loader pass spans every timed round (``bg.EpochStream``, each round an epoch
    of the same batches), as one pass spans a training run's epochs: the workers keep
    building across round boundaries, so the pipeline fill is paid once per run, in
    the first round (``fill_seconds``), not once per round. Other batches (the warm-up,
    the loss check) are built in this process by the same collate and bound the same way.
    """

    def __init__(self, model: TreeLSTMClassifier, pool: list[Tree], workers: int,
                 batches: list[list[Tree]], rounds: int) -> None:
        index = {id(t): i for i, t in enumerate(pool)}
        self.batches = batches
        self.indices = [[index[id(t)] for t in batch] for batch in batches]
        # Every round runs the same batches again; with the schedule cache on, the
        # worker would reuse their schedules from the second round on, which a shuffled
        # epoch of real training never does. (benchmarks/workers.py measures the cache.)
        self.collate = bg.GraphCollate(model, "logits", cache=False)
        self.stream_of_rounds = bg.EpochStream(self.indices, 2 * rounds)  # both modes
        self.loader = bg.graph_loader(pool, self.collate, self.stream_of_rounds,
                                      num_workers=workers, timeout=120)
        self.epochs: Iterator[Iterator[bg.PortableBatch]] | None = None
        self.binder = bg.Binder(model)
        self.fill_seconds: float | None = None
        # Waits for the batches of a round that the workers could not have built
        # while the other variants ran (the loader keeps PREFETCHED in flight): near
        # zero when the workers keep ahead of the training process, as in a long epoch.
        self.late_waits: list[float] = []

    def stream(self, batches: list[Sequence[Tree]]) -> Iterator[torch.Tensor]:
        """The logits of each batch, in order."""
        if batches is not self.batches:
            for batch in batches:
                yield self.binder.run(self.collate.build(batch), stack=True)
            return
        epoch = self._next_epoch()
        for position in range(len(batches)):
            start = time.perf_counter()
            portable = next(epoch)
            if position >= PREFETCHED:
                self.late_waits.append(time.perf_counter() - start)
            yield self.binder.run(portable, stack=True)

    def _next_epoch(self) -> Iterator[bg.PortableBatch]:
        if self.epochs is None:  # the run's first batch: the workers start now
            start = time.perf_counter()
            self.epochs = self.stream_of_rounds.epochs(self.loader)
            epoch = next(self.epochs)
            first = next(epoch)
            self.fill_seconds = time.perf_counter() - start
            yield first
            yield from epoch
        else:
            yield from next(self.epochs)


@dataclass
class Variant:
    """A model copy, its optimizer, and what ``policy.stats`` said while timing it."""

    name: str
    model: TreeLSTMClassifier
    hand: HandBatchedTreeLSTM
    optimizer: torch.optim.Optimizer
    feed: BatchFeed | None = None
    overhead_s: float = 0.0
    nodes: int = 0
    calls: int = 0
    last: bg.ScheduleStats | None = None  # only the last: stats keep their graph alive

    def reset(self) -> None:
        self.overhead_s, self.nodes, self.calls, self.last = 0.0, 0, 0, None

    def run(self, batches: list[Sequence[Tree]], mode: str) -> list[float]:
        """One pass over ``batches`` (inference without grad, or training steps); the
        seconds each batch took, from the end of the one before."""
        times = []
        with torch.set_grad_enabled(mode == "training"):
            # Logits come lazily, so each batch's time covers producing them too.
            pairs = (zip(batches, self.feed.stream(batches)) if self.feed is not None
                     else ((batch, self.logits(batch)) for batch in batches))
            start = time.perf_counter()
            for batch, logits in pairs:
                self.finish(batch, logits, mode)
                times.append(time.perf_counter() - start)
                start += times[-1]
        return times

    def finish(self, batch: Sequence[Tree], logits: torch.Tensor, mode: str) -> None:
        if mode == "training":
            labels = torch.tensor([t.label for t in batch])
            loss = F.cross_entropy(logits, labels, reduction="sum")
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()

    def logits(self, batch: Sequence[Tree]) -> torch.Tensor:
        if self.feed is not None:
            return next(self.feed.stream([batch]))
        if self.name == "eager":
            return torch.stack([self.model.logits(t) for t in batch])
        if self.name == "hand":
            return self.hand(batch)
        with bg.BatchingPolicy(scheduler=self.name) as policy:
            handles = [self.model.logits(t) for t in batch]
        out = torch.stack(bg.compute(handles))
        stats = policy.stats
        assert stats is not None
        self.overhead_s += stats.record_seconds + stats.schedule_seconds
        self.nodes += stats.nodes
        self.calls += stats.calls_recorded
        self.last = stats
        return out

    def loss(self, batch: Sequence[Tree]) -> torch.Tensor:
        labels = torch.tensor([t.label for t in batch])
        loss: torch.Tensor = F.cross_entropy(self.logits(batch), labels, reduction="sum")
        return loss


def make_variants(vocab: int, classes: int, hidden: int, lr: float, pool: list[Tree],
                  workers: int, batches: list[list[Tree]], rounds: int) -> list[Variant]:
    torch.manual_seed(0)
    state = TreeLSTMClassifier(vocab, classes, hidden=hidden, embed_dim=hidden).state_dict()
    variants = []
    for name in VARIANTS:
        if name == "workers" and workers < 1:
            continue
        model = TreeLSTMClassifier(vocab, classes, hidden=hidden, embed_dim=hidden)
        model.load_state_dict(state)  # one set of weights, copied into every variant
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        feed = BatchFeed(model, pool, workers, batches, rounds) if name == "workers" else None
        variants.append(Variant(name, model, HandBatchedTreeLSTM(model), optimizer, feed))
    return variants


def check_losses(variants: list[Variant], batch: Sequence[Tree], tol: float) -> float:
    """Every variant's loss on ``batch`` equals eager's to ``tol`` (relative); the worst."""
    ref = float(variants[0].loss(batch).detach())
    worst = 0.0
    for v in variants[1:]:
        got = float(v.loss(batch).detach())
        err = abs(got - ref) / max(1.0, abs(ref))
        if err > tol:
            raise SystemExit(
                f"loss mismatch before timing: {v.name} gives {got!r}, eager {ref!r} "
                f"(relative error {err:.2e} > {tol:.0e}) on a batch of {len(batch)} trees"
            )
        worst = max(worst, err)
    for v in variants:
        v.reset()
    return worst


def measure(variants: list[Variant], batches: list[list[Tree]], mode: str, rounds: int
            ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Trees/s per variant per round (variants alternate within each round), and the
    trees/s of each variant's fastest time for every batch over the rounds.

    The host is shared: other load slows whole rounds, unevenly between variants. A
    batch's fastest time over the rounds estimates what it takes on a quiet machine
    (as ``timeit`` takes the minimum), so the "best" figures are the steadier ones to
    compare between runs. The workers row's first round includes the pipeline fill.
    """
    trees = sum(len(b) for b in batches)
    speeds: dict[str, list[float]] = {v.name: [] for v in variants}
    fastest: dict[str, list[float]] = {v.name: [float("inf")] * len(batches) for v in variants}
    for v in variants:  # untimed warm-up on a few trees: first calls pay one-off costs
        v.run([batches[0][:16]], mode)
        v.reset()
    for r in range(rounds):
        # Rotate the order each round so no variant always runs first (cache, clocks).
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for v in order:
            start = time.perf_counter()
            times = v.run(batches, mode)
            speeds[v.name].append(trees / (time.perf_counter() - start))
            fastest[v.name] = list(map(min, fastest[v.name], times))
    return speeds, {name: trees / sum(times) for name, times in fastest.items()}


def bench_dataset(name: str, pool: list[Tree], vocab: int, classes: int,
                  args: argparse.Namespace) -> tuple[list[Row], float]:
    rows: list[Row] = []
    worst = 0.0
    for size in args.batch_sizes:
        n_batches = max(1, -(-args.trees_per_round // size))
        if n_batches * size > len(pool):
            raise SystemExit(f"{name}: {n_batches} batches of {size} need more than "
                             f"the {len(pool)} trees available; lower --trees-per-round")
        batches = [pool[i * size:(i + 1) * size] for i in range(n_batches)]
        variants = make_variants(vocab, classes, args.hidden, args.lr, pool, args.workers,
                                 batches, args.rounds)
        worst = max(worst, check_losses(variants, batches[0], 1e-5))
        for mode in MODES:
            t0 = time.perf_counter()
            speeds, best = measure(variants, batches, mode, args.rounds)
            med = {v: statistics.median(s) for v, s in speeds.items()}
            for v in variants:
                row = Row(name, mode, size, v.name, med[v.name], speeds[v.name],
                          med[v.name] / med["eager"], med[v.name] / med["hand"],
                          best[v.name], best[v.name] / best["hand"])
                if v.last is not None:
                    row.record_schedule_us_per_node = 1e6 * v.overhead_s / max(1, v.nodes)
                    row.record_schedule_us_per_call = 1e6 * v.overhead_s / max(1, v.calls)
                    # Launches depend on the batch only: read them (and the lazily computed
                    # bound) from one untimed run of the first batch.
                    with torch.no_grad():
                        v.logits(batches[0])
                    assert v.last is not None
                    row.launches, row.lower_bound, row.nodes = (
                        v.last.launches, v.last.lower_bound, v.last.nodes)
                    v.reset()
                if v.feed is not None and v.feed.fill_seconds is not None:
                    row.fill_ms = 1e3 * v.feed.fill_seconds
                    late = v.feed.late_waits
                    row.late_wait_ms = 1e3 * statistics.mean(late) if late else None
                    late.clear()
                row.batches_per_round = len(batches)
                rows.append(row)
            print(f"  {name:8s} {mode:9s} batch {size:4d}: "
                  + "  ".join(f"{v} {s:7.1f}/s" for v, s in med.items())
                  + f"  ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    return rows, worst


def machine(threads: int) -> dict[str, object]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "intra_op_threads": threads,
    }


def print_table(rows: list[Row]) -> None:
    head = (f"{'data':8s} {'mode':9s} {'batch':>5s} {'variant':7s} {'trees/s':>9s} "
            f"{'x eager':>8s} {'x hand':>7s} {'best x hand':>11s} {'launches':>8s} {'bound':>6s} {'l/b':>5s} "
            f"{'rec+sch us/node':>15s} {'us/call':>7s}")
    print(head)
    print("-" * len(head))
    for r in rows:
        launch = (f"{r.launches:8d} {r.lower_bound:6d} {r.launches / max(1, r.lower_bound):5.2f}"
                  if r.launches is not None and r.lower_bound is not None else f"{'':21s}")
        us = (f"{r.record_schedule_us_per_node:15.1f} {r.record_schedule_us_per_call:7.1f}"
              if r.record_schedule_us_per_node is not None
              and r.record_schedule_us_per_call is not None else "")
        fill = "" if r.fill_ms is None else (
            f"  (pipeline fill once per run {r.fill_ms:.0f} ms; wait past the prefetched "
            f"{r.late_wait_ms:.1f} ms/batch)" if r.late_wait_ms is not None else
            f"  (NOT COMPARABLE: a round of {r.batches_per_round} batch(es) is all built while "
            "the other variants run)")
        print(f"{r.dataset:8s} {r.mode:9s} {r.batch:5d} {r.variant:7s} {r.trees_per_s:9.1f} "
              f"{r.vs_eager:8.2f} {r.vs_hand:7.2f} {r.best_vs_hand:11.2f} {launch} {us}{fill}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: batches 16 and 64, 2 rounds, 64 trees per round")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--hidden", type=int, default=128, help="hidden and embedding size")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--trees-per-round", type=int, default=256,
                   help="trees each variant runs per round and batch size (whole batches)")
    p.add_argument("--datasets", nargs="+", choices=["stdlib", "sst"], default=["stdlib", "sst"])
    p.add_argument("--sst-vocab", type=int, default=5000, help="SST-like vocabulary size")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    p.add_argument("--workers", type=int, default=1,
                   help="DataLoader workers of the 'workers' row (0: leave it out)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.rounds, args.trees_per_round = [16, 64], 2, 64
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine(args.threads)
    print(f"machine: {info['platform']}, {info['processor']}, {info['cpu_count']} CPUs; "
          f"python {info['python']}, torch {info['torch']}, {args.threads} intra-op thread(s)")
    print(f"model: TreeLSTM hidden {args.hidden}, embedding {args.hidden}; batches "
          f"{args.batch_sizes}; {args.trees_per_round} trees/round/variant; "
          f"{args.rounds} rounds; SGD lr {args.lr}; summed cross-entropy; "
          f"workers row: {args.workers} DataLoader worker(s)")
    rows: list[Row] = []
    data_info: dict[str, object] = {}
    worst = 0.0
    for name in args.datasets:
        if name == "stdlib":
            data = stdlib_function_trees()
            pool, vocab, classes = data.train, len(data.vocab), len(data.classes)
        else:
            pool, vocab, classes = sst_like_trees(2000, seed=0, vocab_size=args.sst_vocab), \
                args.sst_vocab, 5
        nodes = statistics.mean(t.size for t in pool)
        leaves = statistics.mean(t.num_leaves for t in pool)
        data_info[name] = {"trees": len(pool), "vocab": vocab, "classes": classes,
                           "mean_nodes": nodes, "mean_leaves": leaves,
                           "max_depth": max(t.depth for t in pool)}
        print(f"{name}: {len(pool)} trees, mean {nodes:.1f} nodes ({leaves:.1f} leaves), "
              f"vocab {vocab}, {classes} classes")
        got, err = bench_dataset(name, pool, vocab, classes, args)
        rows += got
        worst = max(worst, err)
    print(f"losses agree with eager before timing: worst relative difference {worst:.1e}\n")
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": info, "config": {k: (str(v) if isinstance(v, Path) else v)
                                           for k, v in vars(args).items()},
               "data": data_info, "loss_max_relative_diff": worst,
               "rows": [asdict(r) for r in rows]}
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
