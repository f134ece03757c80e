"""Pipeline runtime benchmark: measured vs simulated makespan, and I + W vs one backward.

Run:  python benchmarks/pipeline.py            (2-3 minutes; --quick: p=4 only, ~1 minute)
      python benchmarks/pipeline.py --unit-ms 50 (longer actions: the fixed per-action
                                                  cost weighs less)

(a) "Virtual device" stages: each stage's F, I and W sleep a fixed time inside custom
    autograd functions (a full B sleeps I + W). ``time.sleep`` releases the GIL, so 4-8
    stage threads run concurrently even on 2 cores, like devices would. For every
    schedule at p=4, m=8 and p=8, m=32 the measured makespan (first action start to last
    action end) is compared with the simulator's for the same costs; the difference is
    the runtime's own overhead (thread hand-offs, autograd bookkeeping, sleep overshoot).
    A "replay" column feeds the simulator the measured duration of every action, which
    isolates the hand-off (coordination) overhead from the per-action overhead.
    An "alone" column feeds it instead what one virtual stage takes run by itself, no
    pipeline: F and a plain B, and I and W of a two-stage backward, each timed after an
    idle gap as long as one action (code that runs right after a sleep runs slower than in
    a tight loop, on this kind of machine several times slower, so the stage's own
    autograd bookkeeping costs a good part of a millisecond per action). What is left
    between that and the measured makespan is the pipeline runtime's own overhead.
    With F = I = W the ZB-H1 bubble is compared with 1F1B's.
(b) Two-stage backprop on an MLP (8 x Linear(1024) + ReLU, batch 256, 1 intra-op
    thread): I + W time vs one full ``backward()``, plus the naive split (``autograd.grad``
    for the input with ``retain_graph``, then again for the parameters) for contrast.

Prints tables and writes ``benchmarks/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# Runnable from a checkout without installing the package (the Makefile installs it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchgraph.pipeline import (
    SCHEDULE_NAMES,
    ActionCosts,
    Pipeline,
    PipelineSchedule,
    TimelineEvent,
    TwoStageBackward,
    make_schedule,
    simulate,
)
from batchgraph.pipeline.timing import run_engine

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"


# -- (a) virtual device stages ---------------------------------------------------------


class _SleepInput(torch.autograd.Function):
    """Forward sleeps F; backward (the input-gradient path) sleeps I."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, f: float, i: float) -> Tensor:
        ctx.i = i
        time.sleep(f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.i)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """Contributes zero to the output; its backward (the weight path) sleeps W."""

    @staticmethod
    def forward(ctx: Any, w: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return torch.zeros_like(w)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class _WeightUnit(nn.Module):
    """Owns the parameter; the backward of its weight path sleeps W."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(()))
        self.w = w

    def forward(self, x: Tensor) -> Tensor:
        return x + _SleepWeight.apply(self.weight, self.w)


class VirtualStage(nn.Module):
    """A stage whose F, I and W take fixed times; a full backward takes I + W.

    The sleeping input path runs in the stage's chain *after* the parameter-owning unit,
    so the input-gradient half (I) sleeps on every stage, stage 0 included (where no
    gradient for the stage input itself is needed), and W only wakes the weight path.
    """

    def __init__(self, f: float, i: float, w: float) -> None:
        super().__init__()
        self.unit = _WeightUnit(w)
        self.f, self.i = f, i

    def forward(self, x: Tensor) -> Tensor:
        return _SleepInput.apply(self.unit(x), self.f, self.i)


def _sleep_overshoot(seconds: float, n: int = 20) -> float:
    """Mean extra time ``time.sleep(seconds)`` takes on this machine right now."""
    extra = []
    for _ in range(n):
        start = time.perf_counter()
        time.sleep(seconds)
        extra.append(time.perf_counter() - start - seconds)
    return statistics.mean(extra)


def _stage_alone(unit: float, n: int = 12) -> dict[str, float]:
    """Mean time of each action of one virtual stage run alone (no pipeline), in seconds.

    F and a plain ``backward`` (B), then F recorded for a two-stage backward and its I and
    W; each action starts after an idle gap of ``unit``, as in a pipeline.
    """
    stage = VirtualStage(unit, unit, unit)
    split = TwoStageBackward(stage)
    x0 = torch.zeros(1, 4)
    times: dict[str, list[float]] = {k: [] for k in "FBIW"}
    for rep in range(n + 2):
        x = x0.detach().requires_grad_(True)
        time.sleep(unit)
        t0 = time.perf_counter()
        y = stage(x)
        t1 = time.perf_counter()
        g = torch.ones_like(y)
        time.sleep(unit)
        t2 = time.perf_counter()
        torch.autograd.backward([y], [g])
        t3 = time.perf_counter()
        x = x0.detach().requires_grad_(True)
        with split.record() as tape:
            y = stage(x)
        time.sleep(unit)
        t4 = time.perf_counter()
        tape.backward_input([y], [g], [x])
        t5 = time.perf_counter()
        time.sleep(unit)
        t6 = time.perf_counter()
        tape.backward_weight()
        t7 = time.perf_counter()
        if rep >= 2:  # two warm-up rounds
            for k, v in zip("FBIW", (t1 - t0, t3 - t2, t5 - t4, t7 - t6)):
                times[k].append(v)
    split.close()
    return {k: statistics.mean(v) for k, v in times.items()}


def _replay(schedule: PipelineSchedule, events: list[TimelineEvent]) -> float:
    """The simulator's makespan with each action's *measured* duration.

    What is left between this and the measured makespan is the runtime's coordination
    overhead alone (hand-offs between threads), with the actions' own inflation (sleep
    overshoot, autograd bookkeeping, CPU contention) taken out.
    """
    durations = {e.action: e.end - e.start for e in events}
    run = run_engine(schedule, lambda a: durations[a], lambda producer, consumer: 0.0)
    return run.makespan


def _virtual_run(
    schedule: str, p: int, m: int, unit: float, repeat: int, alone: dict[str, float]
) -> dict[str, Any]:
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    stages = [VirtualStage(unit, unit, unit) for _ in range(p * chunks)]
    x = torch.zeros(m, 4)
    costs = ActionCosts(forward=unit, backward=2 * unit, backward_input=unit, backward_weight=unit)
    plan = make_schedule(schedule, stages=p, microbatches=m, chunks=chunks)
    sim = simulate(plan, costs)
    sim_alone = simulate(
        plan,
        ActionCosts(
            forward=alone["F"],
            backward=alone["B"],
            backward_input=alone["I"],
            backward_weight=alone["W"],
        ),
    ).makespan
    makespans, walls, bubbles, utils, replayed = [], [], [], [], []
    durations: dict[str, list[float]] = {}
    with Pipeline(
        stages, microbatches=m, schedule=schedule, loss_fn=nn.MSELoss(), chunks=chunks, timeout=120
    ) as pipe:
        pipe.train_step(x, x)  # warm-up: threads started, shapes probed
        for _ in range(repeat):
            start = time.perf_counter()
            pipe.train_step(x, x)
            walls.append(time.perf_counter() - start)
            makespans.append(pipe.stats.makespan)
            replayed.append(_replay(pipe.schedule, pipe.timeline))
            for e in pipe.timeline:
                durations.setdefault(e.action.kind.value, []).append(e.end - e.start)
            bubbles.append(pipe.stats.bubble_time)
            utils.append(pipe.stats.utilization)
    makespan = statistics.median(makespans)
    return {
        "schedule": schedule,
        "stages_p": p,
        "microbatches_m": m,
        "chunks_v": chunks,
        "simulated_makespan_s": sim.makespan,
        "measured_makespan_s": makespan,
        "measured_step_wall_s": statistics.median(walls),
        "makespan_ratio": makespan / sim.makespan,
        "simulated_with_measured_durations_s": statistics.median(replayed),
        "coordination_ratio": makespan / statistics.median(replayed),
        "simulated_with_stage_alone_s": sim_alone,
        "runtime_ratio": makespan / sim_alone,
        "simulated_bubble_s": sim.bubble_time,
        "measured_bubble_s": statistics.median(bubbles),
        "simulated_bubble_fraction": sim.bubble_fraction,
        "measured_utilization": statistics.median(utils),
        "mean_action_s": {k: statistics.mean(v) for k, v in sorted(durations.items())},
    }


# -- (b) I + W vs one backward --------------------------------------------------------------


def _mlp(width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


def _split_backward(width: int, layers: int, batch: int, repeat: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = _mlp(width, layers)
    params = list(net.parameters())
    x = torch.randn(batch, width, requires_grad=True)
    grad = torch.randn(batch, width)
    full, forward_plain, forward_rec, i_times, w_times, naive_i, naive_w = ([] for _ in range(7))
    split = TwoStageBackward(net)
    for rep in range(repeat + 2):  # two warm-up rounds
        keep = rep >= 2
        # Full backward (accumulating into .grad like every variant below).
        t0 = time.perf_counter()
        y = net(x)
        t1 = time.perf_counter()
        y.backward(grad)
        t2 = time.perf_counter()
        # Two-stage: I then W.
        with split.record() as tape:
            t3 = time.perf_counter()
            y = net(x)
            t4 = time.perf_counter()
        tape.backward_input([y], [grad], [x])
        t5 = time.perf_counter()
        tape.backward_weight()
        t6 = time.perf_counter()
        # Naive split: W re-walks the whole chain.
        y = net(x)
        t7 = time.perf_counter()
        torch.autograd.grad([y], [x], [grad], retain_graph=True)
        t8 = time.perf_counter()
        gs = torch.autograd.grad([y], params, [grad])
        for p, g in zip(params, gs):
            p.grad.add_(g)  # type: ignore[union-attr]
        t9 = time.perf_counter()
        if keep:
            forward_plain.append(t1 - t0)
            full.append(t2 - t1)
            forward_rec.append(t4 - t3)
            i_times.append(t5 - t4)
            w_times.append(t6 - t5)
            naive_i.append(t8 - t7)
            naive_w.append(t9 - t8)
    split.close()
    med = statistics.median
    return {
        "model": f"{layers} x (Linear({width}, {width}) + ReLU)",
        "batch": batch,
        "intra_op_threads": torch.get_num_threads(),
        "repeats": repeat,
        "forward_s": med(forward_plain),
        "forward_recorded_s": med(forward_rec),
        "full_backward_s": med(full),
        "I_s": med(i_times),
        "W_s": med(w_times),
        "I_plus_W_over_full": (med(i_times) + med(w_times)) / med(full),
        "naive_I_s": med(naive_i),
        "naive_W_s": med(naive_w),
        "naive_I_plus_W_over_full": (med(naive_i) + med(naive_w)) / med(full),
    }


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit-ms", type=float, default=20.0, help="F = I = W sleep, ms")
    parser.add_argument("--repeat", type=int, default=2, help="measured steps per schedule")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    unit = args.unit_ms / 1000
    machine = _machine()
    print(
        f"machine: {machine['cpu']}, {machine['logical_cpus']} logical CPUs, torch {machine['torch']}"
    )
    print("intra-op threads: 1; stage threads: one per pipeline device\n")

    configs = [(4, 8)] if args.quick else [(4, 8), (8, 32)]
    print(
        f"(a) virtual stages, F = I = W = {args.unit_ms:g} ms, B = I + W; "
        f"median of {args.repeat} steps"
    )
    alone = _stage_alone(unit)
    print(
        "one virtual stage alone (no pipeline), after an idle gap: "
        + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in alone.items())
        + " ms (the 'alone' columns simulate with these)"
    )
    header = (
        f"{'schedule':>17} {'p':>2} {'m':>3} {'v':>2} {'simulated s':>12} "
        f"{'measured s':>11} {'ratio':>6} {'replay s':>9} {'ratio':>6} {'alone s':>8} "
        f"{'ratio':>6} {'sim bubble':>11} {'meas bubble':>12} {'util':>6}"
    )
    print(header)
    virtual = []
    for p, m in configs:
        for name in SCHEDULE_NAMES:
            r = _virtual_run(name, p, m, unit, args.repeat, alone)
            virtual.append(r)
            print(
                f"{name:>17} {p:>2} {m:>3} {r['chunks_v']:>2} {r['simulated_makespan_s']:12.4f} "
                f"{r['measured_makespan_s']:11.4f} {r['makespan_ratio']:6.3f} "
                f"{r['simulated_with_measured_durations_s']:9.4f} {r['coordination_ratio']:6.3f} "
                f"{r['simulated_with_stage_alone_s']:8.4f} {r['runtime_ratio']:6.3f} "
                f"{r['simulated_bubble_s']:11.4f} {r['measured_bubble_s']:12.4f} "
                f"{r['measured_utilization']:6.1%}"
            )
    zb_vs_1f1b = {}
    for p, m in configs:
        by = {r["schedule"]: r for r in virtual if (r["stages_p"], r["microbatches_m"]) == (p, m)}
        ratio = by["zb-h1"]["measured_bubble_s"] / by["1f1b"]["measured_bubble_s"]
        zb_vs_1f1b[f"p{p}_m{m}"] = ratio
        print(
            f"ZB-H1 / 1F1B measured bubble at p={p}, m={m}: {ratio:.3f} "
            f"(simulated {by['zb-h1']['simulated_bubble_s'] / by['1f1b']['simulated_bubble_s']:.3f})"
        )
    worst = max(abs(r["makespan_ratio"] - 1) for r in virtual)
    coord = max(abs(r["coordination_ratio"] - 1) for r in virtual)
    kinds: dict[str, list[float]] = {}
    for r in virtual:
        for k, v in r["mean_action_s"].items():
            kinds.setdefault(k, []).append(v)
    nominal = {"F": unit, "B": 2 * unit, "I": unit, "W": unit}
    overshoot = _sleep_overshoot(unit)
    print(
        "mean measured action time vs nominal: "
        + ", ".join(
            f"{k} {statistics.mean(v) * 1e3:.2f}/{nominal[k] * 1e3:g} ms"
            for k, v in sorted(kinds.items())
        )
        + f"; a bare time.sleep({args.unit_ms:g} ms) overshoots by {overshoot * 1e3:.3f} ms here"
    )
    runtime = max(abs(r["runtime_ratio"] - 1) for r in virtual)
    print(f"largest |measured / simulated - 1|: {worst:.2%} (target <= 5%)")
    print(
        f"largest |measured / alone - 1|: {runtime:.2%} (alone: the simulator fed what one "
        "stage takes by itself; the rest is the pipeline runtime's own overhead)"
    )
    print(
        f"largest |measured / replay - 1|: {coord:.2%} (replay: the simulator fed the "
        "measured action durations; the rest is thread hand-off overhead)\n"
    )

    width, layers, batch = (512, 4, 128) if args.quick else (1024, 8, 256)
    reps = 5 if args.quick else 15
    b = _split_backward(width, layers, batch, reps)
    print(
        f"(b) two-stage backprop, {b['model']}, batch {batch}, {b['intra_op_threads']} "
        f"intra-op thread, median of {reps}"
    )
    print(
        f"  forward {b['forward_s'] * 1e3:.2f} ms (recorded for I/W: "
        f"{b['forward_recorded_s'] * 1e3:.2f} ms)"
    )
    print(f"  full backward {b['full_backward_s'] * 1e3:.2f} ms")
    print(
        f"  I {b['I_s'] * 1e3:.2f} ms + W {b['W_s'] * 1e3:.2f} ms = "
        f"{b['I_plus_W_over_full']:.3f}x full backward (target <= 1.15x)"
    )
    print(
        f"  naive split (autograd.grad twice): I {b['naive_I_s'] * 1e3:.2f} ms + W "
        f"{b['naive_W_s'] * 1e3:.2f} ms = {b['naive_I_plus_W_over_full']:.3f}x"
    )

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": machine,
                "settings": {"unit_ms": args.unit_ms, "repeat": args.repeat, "quick": args.quick},
                "virtual_stages": virtual,
                "zb_h1_over_1f1b_bubble": zb_vs_1f1b,
                "worst_makespan_error": worst,
                "worst_coordination_error": coord,
                "stage_alone_s": alone,
                "worst_runtime_error": runtime,
                "sleep_overshoot_s": overshoot,
                "two_stage_backward": b,
            },
            indent=2,
        )
    )
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
