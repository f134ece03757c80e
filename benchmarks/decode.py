"""Greedy GRU decoding: eager vs hand-batched vs batchgraph coroutines (1 and 2 groups).

Each example starts from its own encoder state (random here) and decodes greedily
until its own end token (value-dependent control flow) or ``--max-len``. Variants:

* ``eager``: the per-example coroutine run eagerly, one example at a time;
* ``hand``: hand-written batched decoding with padding and masks — the ceiling. One
  embedding, GRU cell, linear and argmax per step for the whole batch; finished rows
  are dropped from the batch (compaction) so no work is spent on them;
* ``floor``: about the most any coroutine batcher could reach in Python: per-example
  coroutines of the same shape (three calls, one await a step) whose calls only note
  their arguments, under a driver written for this one decoder that runs the
  hand-batched kernels each step. ``coro1`` against ``floor`` is batchgraph's own cost;
  ``floor`` against ``hand`` is what per-example coroutines cost at all;
* ``coro1`` / ``coro2``: the same per-example coroutine under ``bg.run_all`` with one
  group, and with two groups taking turns (``--overlap``, default ``auto``: on the CPU
  inline or one executor thread per group, as ``run_all`` measures the first steps);
* ``hand2``: ``hand`` on each half of the examples, the halves on two threads at once:
  what two groups could gain here with no Python cost at all (``hand2/hd``, the ceiling
  of ``2g/1g``). Two half batches cost more than one whole one, and they share the
  machine's cores and memory bandwidth with each other.

Before timing, all variants must produce identical token sequences in float64 (a
logic check that float32 near-ties cannot upset); the float32 timed runs then report
how many sequences agree. Repetitions are interleaved and medians reported. One
intra-op thread. Writes ``benchmarks/results/decode.json``.

Run: ``python benchmarks/decode.py`` (full) or ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch
from torch import nn

import batchgraph as bg
from batchgraph.releasing import StoreReleaser

BOS = 0
SIZES = {"tiny": (50, 64, 64), "realistic": (8000, 256, 512)}  # vocab, embed, hidden


class Decoder(bg.BatchedModule):
    def __init__(self, vocab: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.cell = nn.GRUCell(embed, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.eos = 1

    async def greedy(self, h: Any, max_len: int) -> list[int]:
        tok, out = BOS, []
        device = self.out.weight.device
        on_cpu, where = device.type == "cpu", _scalar_device(device)
        for _ in range(max_len):
            h = self.cell(self.embed(bg.batched_value(tok, device=where)), h)
            # On the CPU the example takes the argmax of its own row (measured faster at
            # the tiny size than recording it); on a GPU the argmax and the copy to the
            # host are recorded, so they run batched: one copy per batch, no sync per example.
            logits = self.out(h)
            if on_cpu:
                tok = int((await bg.value(logits)).argmax())
            else:
                tok = int(await bg.value(logits.argmax().cpu()))
            if tok == self.eos:
                break
            out.append(tok)
        return out


def hand_two_threads(model: Decoder, states: torch.Tensor, max_len: int) -> list[list[int]]:
    """``hand_batched`` on each half of ``states``, the halves on two threads at once."""
    halves = states.chunk(2)
    done: list[list[list[int]]] = [[] for _ in halves]

    def run(i: int) -> None:
        done[i] = hand_batched(model, halves[i], max_len)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(halves))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [seq for half in done for seq in half]


def _scalar_device(device: torch.device) -> torch.device | None:
    # On the CPU, Python ints stay ints until the batch is stacked (the fast path).
    return None if device.type == "cpu" else device


def run_eagerly(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("an eager example suspended")


def hand_batched(model: Decoder, states: torch.Tensor, max_len: int) -> list[list[int]]:
    """Padded batched greedy decoding; finished rows leave the batch."""
    count = states.shape[0]
    device = states.device
    rows = torch.arange(count, device=device)  # which example each live row is
    tokens = torch.full((count, max_len), -1, dtype=torch.long, device=device)  # -1: padding
    tok = torch.full((count,), BOS, dtype=torch.long, device=device)
    h = states
    for t in range(max_len):
        h = model.cell(model.embed(tok), h)
        tok = model.out(h).argmax(-1)
        tokens[rows, t] = tok
        ended = tok == model.eos
        if bool(ended.any()):
            keep = ~ended
            rows, tok, h = rows[keep], tok[keep], h[keep]
            if rows.numel() == 0:
                break
    mask = tokens >= 0
    ends = (tokens == model.eos) | ~mask
    lengths = torch.where(ends.any(1), ends.int().argmax(1), torch.tensor(max_len, device=device))
    return [row[:n] for row, n in zip(tokens.tolist(), lengths.tolist())]


class _Call:
    """A call in the floor driver's examples: it only notes its arguments."""

    __slots__ = ("args",)

    def __init__(self, *args: Any) -> None:
        self.args = args


class _Await:
    __slots__ = ("call",)

    def __init__(self, call: _Call) -> None:
        self.call = call

    def __await__(self) -> Any:
        return (yield self)


async def _floor_example(h: Any, max_len: int, eos: int) -> list[int]:
    # The shape of Decoder.greedy (three calls and one await a step), with calls that
    # cost nothing but a small object each.
    tok, out = BOS, []
    for _ in range(max_len):
        h = _Call(_Call(tok), h)
        tok = await _Await(_Call(h))
        if tok == eos:
            break
        out.append(tok)
    return out


def floor_driver(model: Decoder, states: torch.Tensor, max_len: int) -> list[list[int]]:
    """About the most a coroutine batcher could reach here in Python: a driver written
    for this one decoder. Each step reads every waiting example's token, runs the
    hand-batched kernels on the live rows (argmax included) and sends each example its
    token as an int; no graph, no scheduling, nothing general."""
    count = states.shape[0]
    coros = [_floor_example(i, max_len, model.eos) for i in range(count)]
    waits = [c.send(None) for c in coros]
    live = list(range(count))
    row_of = list(range(count))  # each example's row in h
    results: list[list[int]] = [[] for _ in range(count)]
    h = states
    while live:
        tokens = [waits[i].call.args[0].args[0].args[0] for i in live]
        if len(live) < h.shape[0]:  # some ended: keep the rows of those still running
            h = h.index_select(0, torch.tensor([row_of[i] for i in live], device=h.device))
        h = model.cell(model.embed(torch.tensor(tokens, device=h.device)), h)
        chosen = model.out(h).argmax(-1).tolist()
        still = []
        for j, i in enumerate(live):
            row_of[i] = j
            try:
                waits[i] = coros[i].send(chosen[j])
                still.append(i)
            except StopIteration as stop:
                results[i] = stop.value
        live = still
    return results


class _PeakReleaser(StoreReleaser):
    """A policy's releaser that first notes the most bytes its stores hold at the end
    of a compute (before the values nothing needs any more are released)."""

    def __init__(self, graph: Any) -> None:
        super().__init__(graph)
        self.peak = 0

    def step(self) -> None:
        held = sum(t.numel() * t.element_size() for store in self.graph.stores
                   for t in store if isinstance(t, torch.Tensor))
        self.peak = max(self.peak, held)
        super().step()


class _Measured(bg.BatchingPolicy):
    """A lane's policy whose releaser notes its stores' peak."""

    def __init__(self) -> None:
        super().__init__()
        self.releaser = self.peak_releaser = _PeakReleaser(self.graph)


@torch.no_grad()
def peak_store_mib(model: Decoder, states: list[torch.Tensor], max_len: int) -> float:
    """The most memory one group's stored values take at once during a run (MiB)."""
    made: list[_Measured] = []

    def make() -> bg.BatchingPolicy:
        made.append(_Measured())
        return made[-1]

    bg.run_all([model.greedy(h, max_len) for h in states], make_policy=make)
    return made[0].peak_releaser.peak / 2**20


@torch.no_grad()
def calibrate(model: Decoder, states: list[torch.Tensor], max_len: int, rate: float) -> None:
    """Bias the end token so that about ``rate`` of decode steps end (random weights
    almost never predict it otherwise)."""
    gaps = []
    for h in states:
        tok = BOS
        for _ in range(max_len):
            h = model.cell(model.embed(torch.tensor(tok, device=h.device)), h)
            logits = model.out(h)
            others = logits.clone()
            others[model.eos] = -float("inf")
            tok = int(others.argmax())
            gaps.append(float(others[tok] - logits[model.eos]))
    model.out.bias[model.eos] += torch.tensor(gaps).quantile(rate).item()


def variants(model: Decoder, states: list[torch.Tensor], max_len: int, overlap: str = "auto"
             ) -> dict[str, Callable[[], list[list[int]]]]:
    stacked = torch.stack(states)
    return {
        "eager": lambda: [run_eagerly(model.greedy(h, max_len)) for h in states],
        "hand": lambda: hand_batched(model, stacked, max_len),
        "hand2": lambda: hand_two_threads(model, stacked, max_len),
        "floor": lambda: floor_driver(model, stacked, max_len),
        "coro1": lambda: bg.run_all([model.greedy(h, max_len) for h in states]),
        "coro2": lambda: bg.run_all([model.greedy(h, max_len) for h in states], groups=2,
                                    overlap=overlap),
    }


@torch.no_grad()
def check_identical(model: Decoder, states: list[torch.Tensor], max_len: int,
                    overlap: str) -> int:
    model64 = Decoder(*SIZES_OF[id(model)])
    model64.load_state_dict(model.state_dict())
    model64 = model64.double().to(model.out.weight.device)
    runs = {k: f() for k, f in variants(model64, [s.double() for s in states], max_len, overlap).items()}
    for name, seqs in runs.items():
        if seqs != runs["eager"]:
            raise AssertionError(f"{name} token sequences differ from eager (float64)")
    return sum(len(s) for s in runs["eager"])


SIZES_OF: dict[int, tuple[int, int, int]] = {}


@torch.no_grad()
def bench(size: str, counts: list[int], reps: int, max_len: int, check: int,
          device: torch.device, overlap: str) -> list[dict[str, Any]]:
    vocab, embed, hidden = SIZES[size]
    torch.manual_seed(0)
    model = Decoder(vocab, embed, hidden).eval().to(device)
    SIZES_OF[id(model)] = (vocab, embed, hidden)
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randn(hidden, generator=gen).to(device) for _ in range(max(counts))]
    calibrate(model, pool[:8], max_len, rate=0.1)
    check_identical(model, pool[:check], max_len, overlap)
    rows = []
    for count in counts:
        states = pool[:count]
        runs = variants(model, states, max_len, overlap)
        outputs = {k: f() for k, f in runs.items()}  # warm-up, and the float32 agreement
        agree = min(sum(a == b for a, b in zip(outputs[k], outputs["eager"])) for k in runs)
        times: dict[str, list[float]] = {k: [] for k in runs}
        for rep in range(reps):
            for name, fn in runs.items():
                if name == "eager" and rep >= max(1, reps // 2) and size == "realistic":
                    continue  # eager at realistic size is slow and steady: fewer repetitions
                start = time.perf_counter()
                fn()  # every variant ends with token ids on the host: nothing left queued
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        example_steps = sum(min(len(s) + 1, max_len) for s in outputs["eager"])
        batched_steps = max(min(len(s) + 1, max_len) for s in outputs["eager"])
        overhead = med["coro1"] - med["hand"]
        peak_mib = peak_store_mib(model, states, max_len)
        rows.append({
            "size": size, "concurrent": count, "agree_float32": f"{agree}/{count}",
            "seconds": med, "seq_per_s": {k: count / v for k, v in med.items()},
            "example_steps": example_steps, "batched_steps": batched_steps,
            "overhead_us_per_example_step": overhead / example_steps * 1e6,
            "overhead_us_per_batched_step": overhead / batched_steps * 1e6,
            "coro1_vs_hand": med["hand"] / med["coro1"],
            "coro2_vs_coro1": med["coro1"] / med["coro2"],
            "floor_vs_hand": med["hand"] / med["floor"],
            "hand2_vs_hand": med["hand"] / med["hand2"],
            "hand_vs_eager": med["eager"] / med["hand"],
            "coro1_vs_eager": med["eager"] / med["coro1"],
            "coro1_peak_store_mib": peak_mib,
        })
        print(_row(rows[-1]), flush=True)
    return rows


def _row(r: dict[str, Any]) -> str:
    s = r["seq_per_s"]
    return (f"{r['size']:10} {r['concurrent']:5} {s['eager']:9.0f} {s['hand']:9.0f} "
            f"{s['coro1']:9.0f} {s['coro2']:9.0f} {r['hand_vs_eager']:7.1f}x "
            f"{r['coro1_vs_eager']:7.1f}x {r['floor_vs_hand']:7.2f}x {r['coro1_vs_hand']:7.2f}x "
            f"{r['coro2_vs_coro1']:7.2f}x {r['hand2_vs_hand']:7.2f}x "
            f"{r['overhead_us_per_example_step']:8.1f} {r['coro1_peak_store_mib']:7.1f} "
            f"{r['agree_float32']:>8}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="greedy decoding throughput")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--max-len", type=int, default=30)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "decode.json"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    parser.add_argument("--counts", type=int, nargs="+", help="concurrent examples")
    parser.add_argument("--overlap", default="auto", choices=["auto", "inline", "parallel", "thread"],
                        help="how coro2's two groups overlap (run_all's overlap=)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    counts = args.counts or ([16, 64] if args.quick else [16, 64, 256])
    reps = 2 if args.quick else args.reps
    print(f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus; "
          f"torch {torch.__version__}; intra-op threads {torch.get_num_threads()}; "
          f"max_len {args.max_len}; medians of {reps} interleaved repetitions; "
          f"coro2 overlap {args.overlap}; "
          f"device {device}" + (f" ({torch.cuda.get_device_name(device)})"
                                if device.type == "cuda" else ""))
    print(f"{'size':10} {'conc':>5} {'eager/s':>9} {'hand/s':>9} {'coro1/s':>9} {'coro2/s':>9} "
          f"{'hand/eg':>8} {'coro/eg':>8} {'floor/hd':>8} {'coro/hd':>8} {'2g/1g':>8} {'hand2/hd':>8} "
          f"{'ovh us':>8} "
          f"{'MiB':>7} {'agree':>8}")
    rows = []
    for size in args.sizes:
        rows += bench(size, counts, reps, args.max_len, 8 if args.quick else 16, device,
                      args.overlap)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": 1, "device": str(device)},
        "max_len": args.max_len, "reps": reps, "overlap": args.overlap, "rows": rows,
    }, indent=2))
    print(f"(sequences/s; floor/hd = the minimal driver written for this decoder vs "
          f"hand-batched; coro/hd = coroutines vs hand-batched; 2g/1g = two groups vs one; "
          f"hand2/hd = hand-batched halves on two threads vs hand-batched (the ceiling of "
          f"2g/1g); "
          f"ovh us = (coro1 - hand) time per example step; MiB = most memory coro1's stored "
          f"values took at once; agree = float32 sequences equal "
          f"to eager; all variants identical in float64)\nwrote {out}")


if __name__ == "__main__":
    main()
