"""Recording cost per call, by how the call is written.

Per-example code reaches batchgraph in several ways: a wrapped module or function
(``bg.batched_func``), a tensor method on a handle (``h.argmax()``), an operator
(``h * 2.0``), or a ``torch`` function (``torch.tanh(h)``, through
``__torch_function__``). Each records one node; this prints what each costs while
recording (nothing is computed), as the best of ``--reps`` rounds of 64 x 20 calls,
next to the eager call of the same operation on a tensor for scale. One intra-op
thread. Writes ``benchmarks/results/recording.json``.

Run: ``python benchmarks/recording.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import batchgraph as bg

EXAMPLES, ROUNDS = 64, 20


def _styles() -> dict[str, Callable[[Any], Any]]:
    argmax = bg.batched_func(torch.argmax)
    return {
        "batched_func(torch.argmax)(h)": argmax,
        "h.argmax()": lambda h: h.argmax(),
        "h.tanh()": lambda h: h.tanh(),
        "h * 2.0": lambda h: h * 2.0,
        "torch.tanh(h)": lambda h: torch.tanh(h),
    }


def per_call_ns(fn: Callable[[Any], Any], reps: int, recording: bool) -> float:
    """Best time per call of ``fn`` on 64 per-example values, recorded or eager."""
    lin = bg.batched_func(nn.Linear(8, 8))
    xs = [torch.randn(8) for _ in range(EXAMPLES)]
    best = float("inf")
    with torch.no_grad():
        for _ in range(reps):
            policy = bg.BatchingPolicy()
            with policy if recording else contextlib.nullcontext():
                values = [lin(x) for x in xs]
                start = time.perf_counter()
                for _ in range(ROUNDS):
                    for v in values:
                        fn(v)
                best = min(best, time.perf_counter() - start)
    return best / (EXAMPLES * ROUNDS) * 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="recording cost per call")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "recording.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(f"{'call':32} {'recorded ns':>12} {'eager ns':>10}")
    for name, fn in _styles().items():
        row = {"call": name, "recorded_ns": per_call_ns(fn, args.reps, True),
               "eager_ns": per_call_ns(fn, args.reps, False)}
        rows.append(row)
        print(f"{name:32} {row['recorded_ns']:12.0f} {row['eager_ns']:10.0f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "threads": 1, "rows": rows}, indent=2))
    print(f"(best of {args.reps} rounds of {EXAMPLES} x {ROUNDS} calls; wrote {out})")


if __name__ == "__main__":
    main()
