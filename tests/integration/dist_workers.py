"""Worker functions for the multi-process pipeline tests (run in spawned processes).

Each worker initialises a gloo process group on 127.0.0.1, runs its part and reports a
small picklable result (or the error's type and message) through a queue. They live in
an importable module because ``spawn`` pickles the target by name.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from queue import Empty
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

DIM = 6
OUT = 3

# The marks of every test module that launches gloo ranks: skipped where
# torch.distributed or its gloo backend is missing.
MULTIPROCESS = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(),
        reason="needs torch.distributed with gloo",
    ),
]


def make_stage(index: int, num_stages: int) -> nn.Module:
    """Stage ``index`` of a small float64 MLP; seeded, so every process builds it alike."""
    gen = torch.Generator().manual_seed(1000 + index)
    last = index == num_stages - 1
    linear = nn.Linear(DIM, OUT if last else DIM, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen, dtype=torch.float64))
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen, dtype=torch.float64))
    return linear if last else nn.Sequential(linear, nn.Tanh())


def factories(num_stages: int) -> list[Callable[[], nn.Module]]:
    return [partial(make_stage, s, num_stages) for s in range(num_stages)]


def batch(n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, DIM, generator=gen, dtype=torch.float64)
    y = torch.randn(n, OUT, generator=gen, dtype=torch.float64)
    return x, y


def reference_grads(num_stages: int, n: int = 12) -> dict[int, list[torch.Tensor]]:
    """Single-device gradients of every stage, for a mean MSE loss on the whole batch."""
    mods = [make_stage(s, num_stages) for s in range(num_stages)]
    x, y = batch(n)
    nn.MSELoss()(nn.Sequential(*mods)(x), y).backward()
    return {s: [p.grad.clone() for p in m.parameters()] for s, m in enumerate(mods)}  # type: ignore[union-attr]


def init(rank: int, world: int, port: int, timeout: float = 20.0) -> None:
    """Join the launcher's store (hosted by the parent, like torchrun's agent) and the group."""
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=timeout)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )


def run(rank: int, world: int, port: int, job: Callable[[int, int], Any], queue: Any) -> None:
    """Process entry point: run ``job(rank, world)`` and put ``(rank, ok, result)``."""
    try:
        init(rank, world, port)
        result = job(rank, world)
        queue.put((rank, True, result))
    except BaseException as exc:
        queue.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# -- launching ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Launch:
    """What a launch left: each rank's report (``None`` if it sent none), exit codes, time."""

    reports: dict[int, tuple[bool, Any]]
    exitcodes: list[int | None]
    seconds: float

    def ok(self, rank: int) -> Any:
        ok, value = self.reports[rank]
        assert ok, f"rank {rank} failed: {value[2] if isinstance(value, tuple) else value}"
        return value

    def error(self, rank: int) -> tuple[str, str]:
        ok, value = self.reports[rank]
        assert not ok, f"rank {rank} did not fail: {value!r}"
        return value[0], value[1]


def launch(
    job: Callable[[int, int], Any],
    world: int,
    limit: float = 60.0,
    wait_for: Sequence[int] | None = None,
) -> Launch:
    """Run ``job`` on ``world`` spawned ranks; kill whatever is still alive after ``limit`` s
    (or, with ``wait_for``, as soon as those ranks have exited)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # The parent hosts the store, as torchrun's agent does: it outlives any rank, so the
    # ranks that fail later can still read why the first one failed.
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    procs = [ctx.Process(target=run, args=(r, world, port, job, queue)) for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    reports: dict[int, tuple[bool, Any]] = {}
    while time.monotonic() - start < limit:
        with contextlib.suppress(Empty):
            rank, ok, value = queue.get(timeout=0.2)
            reports[rank] = (ok, value)
        watched = procs if wait_for is None else [procs[r] for r in wait_for]
        if all(p.exitcode is not None for p in watched):
            break
    elapsed = time.monotonic() - start
    for p in procs:
        if p.exitcode is None:
            p.kill()  # a hung rank: the test fails on its exit code, it must not stall
        p.join(5)
    with contextlib.suppress(Empty):
        while True:
            rank, ok, value = queue.get(timeout=0.2)
            reports[rank] = (ok, value)
    del store
    return Launch(reports, [p.exitcode for p in procs], elapsed)


# -- jobs -----------------------------------------------------------------------------


def _grad_error(
    stages: dict[int, Any], ref: dict[int, list[torch.Tensor]], scale: float = 1.0
) -> float:
    err = 0.0
    for s, stage in stages.items():
        for p, g in zip(stage.module.parameters(), ref[s]):
            err = max(err, (p.grad - scale * g).abs().max().item())
    return err


def reference_loss(num_stages: int, n: int = 12) -> float:
    mods = [make_stage(s, num_stages) for s in range(num_stages)]
    x, y = batch(n)
    with torch.no_grad():
        return float(nn.MSELoss()(nn.Sequential(*mods)(x), y))


def job_schedules(rank: int, world: int) -> dict[str, Any]:
    """Every schedule on ``world`` ranks: gradient error vs one device, loss, mismatch check."""
    from batchgraph.pipeline import DistributedPipeline, Pipeline, PipelineConfigError

    x, y = batch()
    out: dict[str, Any] = {}
    for name, chunks in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2)):
        stages = world * chunks
        ref = reference_grads(stages)
        with DistributedPipeline(
            factories(stages), stages=world, microbatches=4, schedule=name, chunks=chunks,
            loss_fn=nn.MSELoss(), timeout=20,
        ) as pipe:  # fmt: skip
            steps = 2 if name == "1f1b" else 1  # two steps: gradients accumulate like backward
            for _ in range(steps):
                loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
            out[name] = {
                "error": _grad_error(pipe.stages, ref, scale=steps),
                "loss": None if loss is None else float(loss),
                "ref_loss": reference_loss(stages),
                "devices": sorted(pipe.stats.devices) if rank == 0 else None,
            }
            # A smaller batch next: the messages' shapes change between steps.
            for p in pipe.parameters():
                p.grad = None
            x9, y9 = batch(9)
            pipe.train_step(x9 if rank == 0 else None, y9 if rank == world - 1 else None)
            out[name]["error_new_shapes"] = _grad_error(pipe.stages, reference_grads(stages, 9))
    # A Loss that computes its own gradient: the last stage keeps the separate pass for
    # dL/d(outputs) (the default Loss's backward starts from the loss itself).
    from batchgraph.pipeline import Loss

    class OwnGradient(Loss):
        def compute_gradient(
            self, loss: torch.Tensor, output: Any, *, weight: float = 1.0
        ) -> tuple[torch.Tensor | None, ...]:
            return super().compute_gradient(loss, output, weight=weight)

    for loss_fn in (nn.MSELoss(), OwnGradient(nn.MSELoss())):
        with DistributedPipeline(
            factories(world), stages=world, microbatches=4, schedule="1f1b",
            loss_fn=loss_fn, timeout=20,
        ) as pipe:  # fmt: skip
            loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
            out["fused" if isinstance(loss_fn, nn.Module) else "own_gradient"] = {
                "error": _grad_error(pipe.stages, reference_grads(world)),
                "loss": None if loss is None else float(loss),
                "fused": pipe._fused_loss,
            }
    # A mean over counted targets (ignored padding, class weights): exact, as one device.
    counted = nn.CrossEntropyLoss(
        weight=torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64), ignore_index=0
    )
    labels = torch.tensor([0, 0, 0, 1, 2, 1, 0, 2, 2, 1, 0, 0])  # microbatch 0: all ignored
    mods = [make_stage(s, world) for s in range(world)]
    want = counted(nn.Sequential(*mods)(x), labels)
    want.backward()
    with DistributedPipeline(
        factories(world), stages=world, microbatches=4, schedule="zb-h1",
        loss_fn=counted, timeout=20,
    ) as pipe:  # fmt: skip
        loss = pipe.train_step(x if rank == 0 else None, labels if rank == world - 1 else None)
        out["counted"] = {
            "error": _grad_error(
                pipe.stages, {s: [p.grad for p in m.parameters()] for s, m in enumerate(mods)}
            ),
            "loss": None if loss is None else float(loss),
            "ref_loss": float(want),
        }
    # Complex outputs under zb-h1: the loss's leaves on them must require grad.
    from tests.pipeline_models import complex_loss, complex_model

    model, twin = complex_model(DIM), complex_model(DIM)
    y_abs = torch.cat([y, y], dim=1)  # a target per output magnitude
    complex_loss(twin(x), y_abs).backward()
    with Pipeline(model, stages=world, microbatches=3, schedule="zb-h1", loss_fn=complex_loss,
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        pipe.train_step(x if rank == 0 else None, y_abs if rank == world - 1 else None)
        out["complex"] = _own_grad_error(pipe, model, twin)
    # The façade, with real modules on every rank (each uses only its own).
    mods = [make_stage(s, world) for s in range(world)]
    with Pipeline(mods, microbatches=3, schedule="1f1b", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
        fwd = pipe.forward(x if rank == 0 else None)
    ref = reference_grads(world)
    out["facade"] = {
        "error": max(
            (p.grad - g).abs().max().item() for p, g in zip(mods[rank].parameters(), ref[rank])
        ),
        "untouched": all(
            p.grad is None for s, m in enumerate(mods) if s != rank for p in m.parameters()
        ),
        "loss": None if loss is None else float(loss),
        "forward": None if fwd is None else tuple(fwd.shape),  # type: ignore[union-attr]
    }
    # A model returning (h,) and targets given as (y,): the loss gets the tuples, as on
    # one device (given the bare tensors, out[0] and targets[0] were the first rows).
    def first_of_each(out: Any, targets: Any) -> torch.Tensor:
        return nn.functional.mse_loss(out[0], targets[0])

    def tupled() -> list[nn.Module]:  # seeded: every call builds the same weights
        mods = [make_stage(s, world) for s in range(world)]
        mods[-1] = nn.Sequential(mods[-1], _InTuple())
        return mods

    mods, twin = tupled(), nn.Sequential(*tupled())
    want = first_of_each(twin(x), (y,))
    want.backward()
    with Pipeline(mods, microbatches=3, schedule="1f1b", loss_fn=first_of_each,
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        loss = pipe.train_step(x if rank == 0 else None, (y,) if rank == world - 1 else None)
        fwd = pipe.forward(x if rank == 0 else None)
        error = _own_grad_error(pipe, nn.Sequential(*mods), twin)
    out["one_element_tuples"] = {
        "error": error,
        "loss": None if loss is None else float(loss),
        "ref_loss": float(want),
        "forward": None if fwd is None else type(fwd).__name__,
    }
    # Ranks that disagree on m fail together at construction.
    try:
        DistributedPipeline(
            factories(world), stages=world, microbatches=3 + rank, loss_fn=nn.MSELoss()
        )
        out["mismatch"] = "no error"
    except PipelineConfigError as exc:
        out["mismatch"] = str(exc)
    return out


def _own_grad_error(pipe: Any, model: nn.Module, twin: nn.Module) -> float:
    """The largest gradient difference between ``model``'s parameters that this rank's
    stages own and the same parameters of ``twin``, trained on one device (inf for a
    parameter that got no gradient)."""
    mine = [p for m in pipe.own_modules.values() for p in m.parameters()]
    return max(
        float("inf") if p.grad is None else (p.grad - q.grad).abs().max().item()  # type: ignore[operator]
        for p, q in zip(model.parameters(), twin.parameters())
        if any(p is r for r in mine)
    )


class _InTuple(nn.Module):
    """A last layer returning its input in a tuple of one."""

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (h,)


def job_data_parallel(rank: int, world: int) -> dict[str, Any]:
    """2 stages x 2 replicas with uneven shards, then one 4-stage pipeline; vs one device."""
    from batchgraph.pipeline import DistributedPipeline, Pipeline

    n = 14
    x, y = batch(n)
    a, b = ((0, 8), (8, 14))[rank // 2]  # replica shards of 8 and 6 samples
    out: dict[str, Any] = {}
    with torch.device("meta"):
        net = nn.Sequential(*[make_stage(s, 2) for s in range(2)])
    with Pipeline(net, stages=2, microbatches=3, schedule="1f1b", loss_fn=nn.MSELoss(),
                  backend="torch.distributed", timeout=20) as pipe:  # fmt: skip
        runtime = pipe._runtime
        assert isinstance(runtime, DistributedPipeline)
        for s, stage in runtime.stages.items():  # replace fresh init by the reference weights
            stage.module.load_state_dict(nn.Sequential(make_stage(s, 2)).state_dict())
        dev = rank % 2
        loss = pipe.train_step(x[a:b] if dev == 0 else None, y[a:b] if dev == 1 else None)
        out["dp"] = {
            "error": _grad_error(runtime.stages, reference_grads(2, n)),
            "loss": None if loss is None else float(loss),
            "ref_loss": reference_loss(2, n),
            "meta_elsewhere": all(
                p.is_meta for s in range(2) if s != dev for p in net[s].parameters()
            ),
        }
    with DistributedPipeline(factories(4), stages=4, microbatches=6, schedule="zb-h1",
                             loss_fn=nn.MSELoss(), timeout=20) as pipe4:  # fmt: skip
        loss = pipe4.train_step(x if rank == 0 else None, y if rank == 3 else None)
        out["p4"] = {"error": _grad_error(pipe4.stages, reference_grads(4, n)),
                     "loss": None if loss is None else float(loss), "ref_loss": reference_loss(4, n)}  # fmt: skip
    return out


def job_fault(rank: int, world: int, *, bad_rank: int, mode: str, timeout: float = 20.0) -> Any:
    """``mode``: "raise" (an exception in the bad rank's forward of microbatch 1), "kill"
    (the bad rank's process exits abruptly) or "hang" (it sleeps far past the timeout)."""
    from batchgraph.pipeline import DistributedPipeline

    x, y = batch()
    with DistributedPipeline(factories(world), stages=world, microbatches=4, schedule="1f1b",
                             loss_fn=nn.MSELoss(), timeout=timeout) as pipe:  # fmt: skip
        if rank == bad_rank:
            calls = [0]

            def fault(module: nn.Module, args: Any) -> None:
                if args[0].is_meta:
                    return  # the stage's check on meta tensors (kept_inputs), not a microbatch
                calls[0] += 1
                if calls[0] == 2:  # microbatch 1
                    if mode == "raise":
                        raise ValueError("injected failure")
                    if mode == "kill":
                        os._exit(9)
                    time.sleep(120)

            pipe.stages[rank].module.register_forward_pre_hook(fault)
        pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None)
    return "finished"


def _signature_payloads(step: int, mb: int) -> tuple[torch.Tensor | None, ...]:
    """Payloads whose signatures change from step to step: small ones (one transfer with
    their header), one past the one-transfer limit, several dtypes, absent tensors."""
    gen = torch.Generator().manual_seed(100 * step + mb)
    kind = step % 6
    if kind in (0, 1):
        return (torch.randn(2, 4, generator=gen),)
    if kind == 2:
        return (
            torch.randn(3, 5, generator=gen, dtype=torch.float64),
            None,
            torch.randint(0, 9, (7,), generator=gen),
        )
    if kind in (3, 4):
        return (torch.randn(300, 300, generator=gen),)  # 360 KB: header + tensor transfers
    return (
        None,
        torch.rand(3, generator=gen) > 0.5,
        torch.tensor(float(step)),
        torch.randn(2, generator=gen, dtype=torch.complex64),
    )


def job_message_signatures(rank: int, world: int) -> list[int]:
    """Rank 0 sends, rank 1 receives, 14 steps of changing signatures; rank 1 returns the
    steps where a received message differed from what was sent (none expected)."""
    from batchgraph.pipeline.comm import MessageKey, MessageKind
    from batchgraph.pipeline.dist_comm import DistCommunicator

    comm = DistCommunicator({0: 0, 1: 1}.__getitem__, default_timeout=20.0)
    keys = [MessageKey(MessageKind.ACTIVATION, 0, 1, mb) for mb in range(3)]
    wrong: list[int] = []
    for step in range(1, 15):
        comm.begin_step(step, 2)
        if rank == 1:
            comm.prefetch(keys)
            comm.prefetch(keys[:2], payload=True)
        for mb, key in enumerate(keys):
            want = _signature_payloads(step, mb)
            if rank == 0:
                comm.send(key, want)
                continue
            got = comm.recv(key)
            same = len(got) == len(want) and all(
                (a is None and b is None)
                or (a is not None and b is not None and a.dtype == b.dtype and torch.equal(a, b))
                for a, b in zip(got, want)
            )
            if not same:
                wrong.append(step)
        comm.wait_sends()
    comm.close()
    return wrong


def job_reused_send_buffer(rank: int, world: int) -> list[int]:
    """Rank 0 sends one small key every step; its one-transfer buffer is reused only once
    the last send from it was waited. Steps 3 and 4 skip ``wait_sends``, so their sends
    must each get a buffer of their own; rank 1 returns the steps whose message differed
    from what was sent (none expected)."""
    from batchgraph.pipeline.comm import MessageKey, MessageKind
    from batchgraph.pipeline.dist_comm import DistCommunicator

    comm = DistCommunicator({0: 0, 1: 1}.__getitem__, default_timeout=20.0)
    key = MessageKey(MessageKind.ACTIVATION, 0, 1, 0)
    wrong: list[int] = []
    for step in range(1, 7):
        comm.begin_step(step, 2)
        want = (torch.full((3, 5), float(step)), torch.arange(4) * step)
        if rank == 0:
            comm.send(key, want)
            if step == 4:
                # Overwrite the sent tensors: the message must already hold its own copy.
                want[0].fill_(-1.0)
        else:
            got = comm.recv(key)
            expect = (torch.full((3, 5), float(step)), torch.arange(4) * step)
            if not all(torch.equal(a, b) for a, b in zip(got, expect)):
                wrong.append(step)
        if step not in (3, 4):
            comm.wait_sends()
    comm.close()
    return wrong


def job_shape_change_after_early_posts(rank: int, world: int) -> dict[str, Any]:
    """Two 1F1B steps of width DIM (from step 2 on, rank 1 posts the one-transfer buffers
    of that width early, while it waits for the fill), then a step of width DIM + 2 that
    stage 1 cannot take: the messages still arrive as sent, and the stage's error is
    the one reported."""
    from batchgraph.pipeline import DistributedPipeline

    early: list[int] = []
    with DistributedPipeline([nn.Tanh, partial(make_stage, 1, 2)], stages=2, microbatches=4,
                             schedule="1f1b", loss_fn=nn.MSELoss(), timeout=20) as pipe:  # fmt: skip
        prefetch = pipe.comm.prefetch

        def counted(keys: Any, *, payload: bool = False) -> None:
            keys = list(keys)
            if not payload:  # only the fill's posts leave the payload out
                early.append(len(keys))
            prefetch(keys, payload=payload)

        pipe.comm.prefetch = counted  # type: ignore[method-assign]
        _, y = batch()
        for width in (DIM, DIM, DIM + 2):
            xs = torch.randn(12, width, dtype=torch.float64)
            try:
                pipe.train_step(xs if rank == 0 else None, y if rank == 1 else None)
            except Exception as exc:
                return {"width": width, "error": type(exc).__name__, "message": str(exc),
                        "early": early}  # fmt: skip
    return {"width": None, "early": early}
