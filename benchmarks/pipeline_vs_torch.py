"""batchgraph's torch.distributed backend vs ``torch.distributed.pipelining``, side by side.

Run:  python benchmarks/pipeline_vs_torch.py          (a few minutes; --quick: fewer steps;
      --cases mlp,virtual and --schedules gpipe,1f1b,zb-h1 pick a subset)

Both run the same stage modules, batch, microbatches and schedule under gloo on this
machine, each in its own fresh set of spawned processes (so peak memory is per
implementation), one intra-op thread per rank:

(a) ``mlp``: an MLP with real compute (8 x Linear(512) + ReLU + Linear(512, 16), batch
    256, m = 8) on 2 ranks, one stage per rank.
(b) ``virtual``: "virtual device" stages whose F, I and W sleep a fixed time inside
    custom autograd functions (a full B sleeps I + W; see ``benchmarks/pipeline.py``),
    p = 4 ranks, m = 8. Sleeping releases the CPU, so the 4 ranks overlap on 2 cores like
    devices would. batchgraph's measured makespan (first action start to last action end
    over all ranks, from the timelines gathered to rank 0) is compared with
    ``simulate()``'s for the same costs. Across processes a message costs real time, so
    the simulator is given a transfer cost measured here, independently of either
    implementation, with plain gloo ``send``/``recv`` of one microbatch's activation
    tensor between each pair of neighbouring ranks, both ways: the one-way time into a
    receiver that has been blocked in its receive for one action's time, as a pipeline
    hop's receiver is (the sender sleeps ``unit``, then sends; one host, one clock, so
    the receiver's clock reading minus the sender's is the one-way time itself: the
    sender's call, the wire and the receiver's wake-up), median of 20, averaged over
    pairs and directions (printed, and stored as ``transfer_s``). A ping-pong between
    two busy processes (half the median round trip of 30, ``transfer_pingpong_s``)
    misses the receiver's wake-up and is several times shorter on a small VM; the ratio
    with it is printed too.
    Then every rank times its virtual stage alone, at the same time as the others (F, B,
    I, W after idle gaps; ``_stage_alone`` in ``benchmarks/pipeline.py``), and the
    simulator is run once more with those costs: the "alone" ratio is what is left for
    the runtime itself (the stage's own autograd bookkeeping runs slower right after a
    sleep, by more than a millisecond per action with four processes on two cores).
    Last, "replay": the simulator with each action's duration as measured inside the
    pipeline (from the gathered timelines) and the same transfer cost, median over the
    timed steps; measured / replay near 1 says the makespan is what the actions and the
    hops explain, and the gap to "alone" is in the actions themselves (each one's send
    call and receive handling run inside it).

Schedules compared: ``gpipe`` vs ``ScheduleGPipe``, ``1f1b`` vs ``Schedule1F1B``, and
``zb-h1`` vs ``ScheduleInterleavedZeroBubble`` with one stage per rank (its ZB-H1 case).
Step time: both implementations are built in the same processes (on copies of the same
stage) and take turns, step by step, so the machine's background load hits both alike;
each step is timed between two barriers (gradients zeroed outside), and the median over
the timed steps is reported (the slowest rank's). Peak memory: a separate launch per
implementation, the rise of each rank's maximum resident set size over the timed steps'
starting point (CPU: no allocator statistics), in MiB. batchgraph runs with its default
per-step stats gathering on.

Prints a table and writes ``benchmarks/results/pipeline_vs_torch.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable from a checkout
sys.path.insert(0, str(ROOT / "benchmarks"))

from pipeline import VirtualStage, _machine, _stage_alone  # noqa: E402  (benchmarks/pipeline.py)

from batchgraph.pipeline import ActionCosts, DistributedPipeline, make_schedule, simulate  # noqa: E402
from batchgraph.pipeline.timing import run_engine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "pipeline_vs_torch.json"
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
}


# -- models ---------------------------------------------------------------------------------


def mlp_stage(index: int, num_stages: int, width: int = 512, layers: int = 8) -> nn.Module:
    """Stage ``index`` of the MLP: its share of the layers, seeded (same in both runs)."""
    torch.manual_seed(index)
    per = layers // num_stages
    mods: list[nn.Module] = []
    for _ in range(per):
        mods += [nn.Linear(width, width), nn.ReLU()]
    if index == num_stages - 1:
        mods.append(nn.Linear(width, 16))
    return nn.Sequential(*mods)


def case_setup(case: str, rank: int, world: int, unit: float) -> tuple[nn.Module, Any, Any]:
    """This rank's stage module and the full batch (inputs, targets)."""
    if case == "mlp":
        torch.manual_seed(100)
        x, y = torch.randn(256, 512), torch.randn(256, 16)
        return mlp_stage(rank, world), x, y
    x = torch.zeros(16, 4)
    return VirtualStage(unit, unit, unit), x, x


# -- one rank -------------------------------------------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _torch_step_fn(module: nn.Module, schedule: str, rank: int, world: int, m: int) -> Any:
    from torch.distributed import pipelining as pp

    stage = pp.PipelineStage(module, rank, world, torch.device("cpu"))
    loss = nn.MSELoss()
    if schedule == "gpipe":
        return pp.ScheduleGPipe(stage, n_microbatches=m, loss_fn=loss)
    if schedule == "1f1b":
        return pp.Schedule1F1B(stage, n_microbatches=m, loss_fn=loss)
    return pp.ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=loss)


def _steppers(job: dict[str, Any], rank: int, world: int) -> dict[str, tuple[Any, nn.Module]]:
    """One ``step()`` per implementation in ``job["impls"]``, each on its own copy of the stage."""
    module, x, y = case_setup(job["case"], rank, world, job["unit"])
    first, last, m = rank == 0, rank == world - 1, job["m"]
    out: dict[str, tuple[Any, nn.Module]] = {}
    if "batchgraph" in job["impls"]:
        mine = copy.deepcopy(module)
        pipe = DistributedPipeline(
            [mine if s == rank else nn.Identity for s in range(world)],
            stages=world, microbatches=m, schedule=job["schedule"], loss_fn=nn.MSELoss(),
            timeout=120,
        )  # fmt: skip

        def ours() -> tuple[float, list[Any]] | None:
            pipe.train_step(x if first else None, y if last else None)
            return (pipe.stats.makespan, pipe.timeline) if rank == 0 else None

        out["batchgraph"] = (ours, mine)
    if "torch" in job["impls"]:
        theirs = copy.deepcopy(module)
        sched = _torch_step_fn(theirs, job["schedule"], rank, world, m)

        def baseline() -> float | None:
            if first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=[])
            else:
                sched.step()
            return None

        out["torch"] = (baseline, theirs)
    return out


def gloo_one_way(sample: torch.Tensor, rank: int, world: int, rounds: int = 30) -> float:
    """Mean over neighbouring rank pairs of the one-way gloo latency of ``sample`` (seconds).

    Plain ``dist.send``/``dist.recv`` ping-pong, one pair at a time (the others wait at a
    barrier); a collective, every rank calls it and gets the same value.
    """
    buf = torch.empty_like(sample)
    mine: list[float] = []
    for a in range(world - 1):
        dist.barrier()
        if rank not in (a, a + 1):
            continue
        peer = a + 1 if rank == a else a
        trips = []
        for i in range(rounds + 5):
            start = time.perf_counter()
            if rank == a:
                dist.send(sample, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(sample, peer)
            if i >= 5:
                trips.append(time.perf_counter() - start)
        if rank == a:
            mine.append(statistics.median(trips) / 2)
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    pairs = [v for part in gathered for v in part]
    return statistics.mean(pairs) if pairs else 0.0


def gloo_idle_one_way(
    sample: torch.Tensor, rank: int, world: int, idle: float, rounds: int = 20
) -> float:
    """Mean over neighbouring rank pairs and both directions of the one-way gloo latency of
    ``sample`` into a receiver that has been waiting ``idle`` seconds (seconds).

    The regime of a pipeline hop: the receiver sits in a blocking receive while its
    neighbour computes, then the message has to wake it. The sender sleeps ``idle``,
    reads the clock, sends ``sample`` with plain ``dist.send``, then sends that reading;
    the receiver reads the clock when its ``dist.recv`` returns. All ranks run on one
    host, so both readings come from the same monotonic clock and the difference is the
    one-way time itself (sender's call, wire, receiver's wake-up), not half a round trip
    between two busy processes. Median of ``rounds`` after 3 warm-up ones per pair and
    direction; one pair at a time (the others wait at a barrier); a collective.
    """
    buf = torch.empty_like(sample)
    stamp = torch.zeros(1, dtype=torch.float64)
    mine: list[float] = []
    for a in range(world - 1):
        for src, dst in ((a, a + 1), (a + 1, a)):
            dist.barrier()
            if rank not in (src, dst):
                continue
            lat = []
            for i in range(rounds + 3):
                if rank == src:
                    time.sleep(idle)
                    stamp[0] = time.perf_counter()
                    dist.send(sample, dst)
                    dist.send(stamp, dst)
                else:
                    dist.recv(buf, src)
                    arrived = time.perf_counter()
                    dist.recv(stamp, src)
                    if i >= 3:
                        lat.append(arrived - float(stamp[0]))
            if rank == dst:
                mine.append(statistics.median(lat))
    dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    pairs = [v for part in gathered for v in part]
    return statistics.mean(pairs) if pairs else 0.0


def _replay(job: dict[str, Any], world: int, timeline: list[Any], transfer: float) -> float:
    """The simulator's makespan with each action's duration as measured in the pipeline
    (``timeline``) and ``transfer`` per hop: what is left between it and the measured
    makespan is the runtime's coordination beyond its actions and the hops (waits that
    the dependencies do not explain); the actions' own inflation is taken out."""
    plan = make_schedule(job["schedule"], stages=world, microbatches=job["m"])
    durations = {e.action: e.end - e.start for e in timeline}
    return run_engine(plan, durations.__getitem__, lambda producer, consumer: transfer).makespan


def worker(rank: int, world: int, port: int, job: dict[str, Any], queue: Any) -> None:
    """Run ``job``: time the implementations step by step in turn (so the machine's load
    hits both alike), or, with one implementation, measure its peak memory."""
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        transfer, pingpong, alone = None, None, None
        if job["case"] == "virtual" and "torch" in job["impls"]:
            _, x, _ = case_setup(job["case"], rank, world, job["unit"])
            sample = torch.tensor_split(x, job["m"])[0].contiguous()
            pingpong = gloo_one_way(sample, rank, world)
            transfer = gloo_idle_one_way(sample, rank, world, job["unit"])
            dist.barrier()
            per_rank: list[Any] = [None] * world
            dist.all_gather_object(per_rank, _stage_alone(job["unit"]))
            alone = {k: statistics.mean(r[k] for r in per_rank) for k in per_rank[0]}
        steppers = _steppers(job, rank, world)
        times: dict[str, list[float]] = {k: [] for k in steppers}
        makespans: list[float] = []
        timelines: list[list[Any]] = []
        base = _rss_mib()
        for i in range(job["warmup"] + job["repeat"]):
            if i == job["warmup"]:
                base = _rss_mib()
            for name, (step, module) in steppers.items():
                for p in module.parameters():
                    p.grad = None
                dist.barrier()
                start = time.perf_counter()
                measured = step()
                dist.barrier()
                if i >= job["warmup"]:
                    times[name].append(time.perf_counter() - start)
                    if measured is not None:
                        makespans.append(measured[0])
                        timelines.append(measured[1])
        result = {
            "step_s": {k: statistics.median(v) for k, v in times.items()},
            "peak_mib": max(0.0, _peak_mib() - base),
            "makespan_s": statistics.median(makespans) if makespans else None,
            "replayed_makespan_s": (
                statistics.median(_replay(job, world, tl, transfer) for tl in timelines)
                if timelines and transfer is not None
                else None
            ),
            "transfer_s": transfer,
            "transfer_pingpong_s": pingpong,
            "stage_alone_s": alone,
        }
        dist.destroy_process_group()
        queue.put((rank, result))
    except BaseException as exc:
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))
        raise


def launch(job: dict[str, Any], world: int, limit: float = 240.0) -> list[dict[str, Any]]:
    """Spawn ``world`` ranks for ``job``; each rank's result, in rank order."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, job, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + limit
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, res = queue.get(timeout=1.0)
            results[rank] = res
        except Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(10)
        if p.exitcode is None:
            p.kill()
    return [results.get(r, {"error": "no result (timed out or crashed)"}) for r in range(world)]


# -- driver ---------------------------------------------------------------------------------


def run_case(
    case: str,
    world: int,
    m: int,
    unit: float,
    warmup: int,
    repeat: int,
    schedules: tuple[str, ...] = tuple(SCHEDULES),
) -> list[dict[str, Any]]:
    rows = []
    for schedule, torch_name in SCHEDULES.items():
        if schedule not in schedules:
            continue
        row: dict[str, Any] = {"case": case, "ranks": world, "microbatches": m, "schedule": schedule,
                               "torch_schedule": torch_name}  # fmt: skip
        job = {"case": case, "impls": ("batchgraph", "torch"), "schedule": schedule, "m": m,
               "unit": unit, "warmup": warmup, "repeat": repeat}  # fmt: skip
        timed = launch(job, world)
        errors = [r["error"] for r in timed if "error" in r]
        for impl in ("batchgraph", "torch"):
            if errors:
                row[impl] = {"error": errors[0]}
                continue
            # Peak memory: a launch of its own per implementation, a few steps.
            alone = launch({**job, "impls": (impl,), "warmup": 1, "repeat": 2}, world)
            row[impl] = {
                "step_s": max(r["step_s"][impl] for r in timed),
                "peak_mib_per_rank": [round(r.get("peak_mib", float("nan")), 1) for r in alone],
            }
        ok = not errors
        row["ratio"] = row["batchgraph"]["step_s"] / row["torch"]["step_s"] if ok else None
        if case == "virtual" and ok:
            transfer = timed[0]["transfer_s"]
            plan = make_schedule(schedule, stages=world, microbatches=m)
            costs = ActionCosts(
                forward=unit, backward=2 * unit, backward_input=unit, backward_weight=unit
            )
            sim_free = simulate(plan, costs).makespan
            sim = simulate(plan, replace(costs, transfer=transfer)).makespan
            pingpong = timed[0]["transfer_pingpong_s"]
            sim_pingpong = simulate(plan, replace(costs, transfer=pingpong)).makespan
            alone = timed[0]["stage_alone_s"]
            sim_alone = simulate(
                plan,
                ActionCosts(
                    forward=alone["F"],
                    backward=alone["B"],
                    backward_input=alone["I"],
                    backward_weight=alone["W"],
                    transfer=transfer,
                ),
            ).makespan
            row["stage_alone_s"] = alone
            row["simulated_makespan_stage_alone_s"] = sim_alone
            row["makespan_vs_alone"] = timed[0]["makespan_s"] / sim_alone
            measured = timed[0]["makespan_s"]
            row["batchgraph"]["makespan_s"] = measured
            row["transfer_s"] = transfer
            row["transfer_pingpong_s"] = pingpong
            row["simulated_makespan_no_transfer_s"] = sim_free
            row["simulated_makespan_pingpong_s"] = sim_pingpong
            row["makespan_vs_sim_pingpong"] = measured / sim_pingpong
            row["simulated_makespan_s"] = sim
            row["makespan_vs_sim"] = measured / sim
            replayed = timed[0]["replayed_makespan_s"]
            row["replayed_makespan_s"] = replayed
            row["makespan_vs_replay"] = measured / replayed
        rows.append(row)
        print(_format(row), flush=True)
    return rows


def _format(row: dict[str, Any]) -> str:
    def cell(impl: str) -> str:
        r = row[impl]
        if "error" in r:
            return f"{'error':>9} {'':>15}"
        mem = "/".join(f"{v:.0f}" for v in r["peak_mib_per_rank"])
        return f"{r['step_s'] * 1e3:8.1f}ms {mem:>15}"

    ratio = f"{row['ratio']:.3f}" if row.get("ratio") else "  -  "
    sim = ""
    if row.get("makespan_vs_sim"):
        sim = (
            f"  makespan {row['batchgraph']['makespan_s'] * 1e3:.1f} / sim "
            f"{row['simulated_makespan_s'] * 1e3:.1f} ms = {row['makespan_vs_sim']:.3f} "
            f"(transfer {row['transfer_s'] * 1e3:.3f} ms, gloo one-way into an idle rank; "
            f"with the ping-pong's {row['transfer_pingpong_s'] * 1e3:.3f} ms: "
            f"{row['makespan_vs_sim_pingpong']:.3f}; sim without transfer "
            f"{row['simulated_makespan_no_transfer_s'] * 1e3:.1f} ms); vs alone "
            f"{row['simulated_makespan_stage_alone_s'] * 1e3:.1f} ms = {row['makespan_vs_alone']:.3f}"
            f"; vs replay {row['replayed_makespan_s'] * 1e3:.1f} ms = "
            f"{row['makespan_vs_replay']:.3f}"
        )
    return f"{row['case']:>7} {row['schedule']:>6} {cell('batchgraph')} {cell('torch')} {ratio:>6}{sim}"


def main() -> None:
    parser = argparse.ArgumentParser(description="batchgraph vs torch.distributed.pipelining")
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--unit-ms", type=float, default=10.0, help="virtual stage action time")
    parser.add_argument("--cases", default="mlp,virtual")
    parser.add_argument(
        "--schedules",
        default=",".join(SCHEDULES),
        help="comma-separated subset of " + ", ".join(SCHEDULES),
    )
    args = parser.parse_args()
    schedules = tuple(args.schedules.split(","))
    warmup, repeat = (2, 5) if args.quick else (3, 15)
    unit = args.unit_ms / 1e3
    print(f"{'case':>7} {'sched':>6} {'batchgraph':>9} {'peak MiB/rank':>15} {'torch':>9} "
          f"{'peak MiB/rank':>15} {'ratio':>6}")  # fmt: skip
    rows: list[dict[str, Any]] = []
    cases = args.cases.split(",")
    if "mlp" in cases:
        rows += run_case("mlp", 2, 8, unit, warmup, repeat, schedules)
    if "virtual" in cases:
        rows += run_case("virtual", 4, 8, unit, warmup, repeat, schedules)
    out = {
        "machine": _machine(),
        "backend": "gloo",
        "intra_op_threads_per_rank": 1,
        "warmup_steps": warmup,
        "timed_steps": repeat,
        "virtual_unit_s": unit,
        "rows": rows,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
