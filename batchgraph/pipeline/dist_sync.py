"""Between replicas: buffers broadcast before a step (by DDP's rule, see
:class:`ReplicaBuffers`) and gradients all-reduced after it; and every rank's timeline
gathered to rank 0 after a step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.step_gradients import restore_gradients, stash_gradients
from batchgraph.pipeline.trace import TimelineEvent

__all__ = [
    "ReplicaBuffers",
    "TimelineGather",
    "allreduce_gradients",
    "broadcast_buffers",
    "gather_events",
    "gather_state",
    "restore_gradients",
    "stash_gradients",
    "step_timeline",
]


def gather_state(
    part: Mapping[str, Any], dst: int, group: Any, send: bool = True
) -> dict[str, Any] | None:
    """Every rank's ``part`` of a state_dict, merged on global rank ``dst`` as CPU tensors
    (``None`` elsewhere). Collective over ``group``. Ranks with ``send`` false add nothing
    (another replica of their stages sends the same values); so do tied copies, which
    are equal after every step.
    """
    mine = {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in part.items()}
    world = dist.get_world_size(group)
    parts: list[Any] | None = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(mine if send else {}, parts, dst=dst, group=group)
    if parts is None:
        return None
    return {k: v for got in parts for k, v in got.items()}


def broadcast_buffers(modules: Sequence[nn.Module], group: Any, src: int) -> None:
    """Copy rank ``src``'s buffers of ``modules`` (running statistics) to every rank of ``group``.

    What ``DistributedDataParallel(broadcast_buffers=True)`` (its default) does before a
    forward (see :class:`ReplicaBuffers` for which): each replica updates its own running statistics from its own shard, so
    without this ``BatchNorm``'s would drift apart across the replicas, and each rank's
    checkpoint and eval-mode outputs would be those of a different model. One flat
    broadcast per dtype (``num_batches_tracked`` is int64), not one per tensor.
    Collective over ``group``.

    Example (on every rank of ``group``, one per replica of these stages)::

        broadcast_buffers([stage.module for stage in stages], replica_group, src=first_rank)
    """
    buffers = list(dict.fromkeys(b for m in modules for b in m.buffers()))
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for b in buffers:
        by_dtype.setdefault(b.dtype, []).append(b)
    for group_buffers in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group_buffers])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for b in group_buffers:
            n = b.numel()
            with torch.no_grad():
                b.copy_(flat[offset : offset + n].view_as(b))
            offset += n


class ReplicaBuffers:
    """When the replicas' buffers become the first replica's: by ``DistributedDataParallel``'s rule.

    DDP broadcasts its buffers at the start of a forward when its previous forward ran
    with grad enabled (outside ``no_sync()``), or it is the first: ``_post_forward`` sets
    ``require_forward_param_sync`` to ``torch.is_grad_enabled()``, and
    ``will_sync_module_buffers`` reads it. So the first evaluation after training
    starts from the first replica's statistics, while an evaluation after another, and
    the training step after an evaluation, keep each replica's own (which a no-grad
    forward in train mode, updating ``BatchNorm``'s statistics per replica, makes
    differ). Here ``train_step`` is a forward with grad enabled and ``forward`` one
    without. Every rank of ``group`` makes the same calls, so all agree when to broadcast.

    Args:
        modules: this rank's stage modules.
        group: this rank's replica group (``None``: one replica, nothing to broadcast).
        src: the first replica's rank in ``group``.

    Example (every rank, at the start of each step)::

        buffers = ReplicaBuffers(stage_modules, replica_group, src=first_rank)
        buffers.begin(train=True, enabled=pipe.broadcast_buffers)   # broadcasts (first)
    """

    def __init__(self, modules: Sequence[nn.Module], group: Any, src: int) -> None:
        self.modules, self.group, self.src = list(modules), group, src
        self._due = True  # as DDP's first forward

    def begin(self, train: bool, enabled: bool) -> bool:
        """Start a step (``train``: ``train_step``); whether the buffers were broadcast."""
        due, self._due = self._due, train
        if not (due and enabled and self.group is not None):
            return False
        broadcast_buffers(self.modules, self.group, self.src)
        return True


def allreduce_gradients(
    params: Sequence[nn.Parameter], group: Any, saved: Sequence[Tensor | None]
) -> None:
    """Sum this step's gradients over ``group``, then add back the ``saved`` earlier ones.

    The loss is already weighted by each replica's share of the global batch (see
    :class:`~batchgraph.pipeline.dist_pipeline.DistributedPipeline`), so a plain sum gives
    the full-batch gradient. One flat buffer per dtype: one collective, not one per tensor.
    A parameter that got no gradient on any member (frozen, or unused by the step) keeps
    ``.grad`` as ``None``, as after a backward on one device: zeros would be stepped by an
    optimizer (weight decay, momentum) that skips parameters without a gradient.

    Example (on every rank of ``group``; ``b`` got no gradient anywhere)::

        allreduce_gradients([a, b], group, [None, None])
        a.grad  # the sum of every member's a.grad
        b.grad  # None
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    made: set[int] = set()
    for i, p in enumerate(params):
        if p.grad is None:
            # Every member must contribute the same layout, whichever got a gradient.
            p.grad = torch.zeros_like(p)
            made.add(i)
        by_dtype.setdefault(p.grad.dtype, []).append(i)
    for indices in by_dtype.values():
        grads = [params[i].grad for i in indices]
        first = params[indices[0]]
        # After the gradients, one count per parameter of the members that had one.
        had = torch.tensor([i not in made for i in indices], dtype=first.dtype, device=first.device)
        flat = torch.cat([g.reshape(-1) for g in grads if g is not None] + [had])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            assert g is not None
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
        if made.intersection(indices):  # a host read only where this rank had none
            counts = flat[offset:].tolist()
            for i, count in zip(indices, counts):
                if count == 0:
                    params[i].grad = None
    restore_gradients(params, saved)


def gather_events(
    events: Sequence[tuple[float, float]],
    plans: Mapping[int, Sequence[Action]],
    group: Any,
    offsets: Sequence[float],
) -> list[TimelineEvent] | None:
    """Gather every rank's measured (start, end) per planned action to rank 0.

    Every rank knows every rank's plan (the schedule is data), so only the times travel:
    one float64 tensor per rank, padded to the longest plan, in a single ``gather``.

    Args:
        events: this rank's (start, end) per action of its plan, in order.
        plans: each rank's planned actions, by global rank.
        group: a group of all ranks (global rank 0 receives).
        offsets: each rank's clock offset from rank 0's (subtracted).

    Returns:
        On rank 0, every rank's events (``device`` is the global rank) with times
        relative to the earliest start; ``None`` on the other ranks.
    """
    length = max((len(p) for p in plans.values()), default=0)
    mine = torch.full((max(length, 1), 2), float("nan"), dtype=torch.float64)
    if events:
        mine[: len(events)] = torch.tensor(events, dtype=torch.float64)
    rank = dist.get_rank()
    bucket = [torch.empty_like(mine) for _ in plans] if rank == 0 else None
    dist.gather(mine, bucket, dst=0, group=group)
    if bucket is None:
        return None
    out: list[TimelineEvent] = []
    for r, times in enumerate(bucket):
        for action, (start, end) in zip(plans[r], times.tolist()):
            if start == start:  # not NaN: the action ran
                out.append(TimelineEvent(r, action, start - offsets[r], end - offsets[r]))
    t0 = min((e.start for e in out), default=0.0)
    return [TimelineEvent(e.device, e.action, e.start - t0, e.end - t0) for e in out]


def step_timeline(
    events: Sequence[tuple[float, float]],
    schedule: PipelineSchedule,
    rank: int,
    world: int,
    train: bool,
    group: Any | None,
    offsets: Sequence[float],
) -> list[TimelineEvent]:
    """The step's timeline: every rank's on rank 0 when ``group`` is given, else this rank's.

    Args:
        events: this rank's (start, end) per action it ran, in plan order.
        schedule: the schedule (rank ``r`` runs device ``r % devices``).
        rank: this rank; world: the number of ranks.
        train: whether the step ran backward actions (a forward step runs F only).
        group: a group of all ranks to gather over, or ``None`` to keep events local.
        offsets: per-rank clock offsets (see :func:`~batchgraph.pipeline.dist_topology.clock_offsets`).
    """
    plans = {
        r: [
            a for a in schedule.order[r % schedule.devices] if train or a.kind is ActionKind.FORWARD
        ]
        for r in range(world)
    }
    if group is not None:
        gathered = gather_events(events, plans, group, offsets)
        if gathered is not None:
            return gathered
    t0 = min((s for s, _ in events), default=0.0)
    return [TimelineEvent(rank, a, s - t0, e - t0) for a, (s, e) in zip(plans[rank], events)]


def _plans(schedule: PipelineSchedule, world: int, train: bool) -> dict[int, list[Action]]:
    """What every rank runs in a step (rank ``r`` runs device ``r % devices``)."""
    return {
        r: [
            a for a in schedule.order[r % schedule.devices] if train or a.kind is ActionKind.FORWARD
        ]
        for r in range(world)
    }


class TimelineGather:
    """Gathers every rank's measured (start, end) times to rank 0, step after step.

    The same data as :func:`gather_events`, moved with point-to-point messages instead of
    a collective, so no rank waits for another at the end of a step: rank 0 posts one
    receive per rank during the step (the times land while it still computes), every
    other rank sends its times when its step ends and returns at once; that send's handle
    and buffer are kept until the rank's next step begins (or :meth:`close`). Rank 0
    waits for the receives when its own step ends, by then usually complete.

    Args:
        schedule: the schedule (every rank knows every rank's plan, so only times travel).
        rank: this rank; world: the number of ranks (all in ``group``, rank 0 receives).
        group: a group of all ranks, used for nothing else point-to-point.
        offsets: per-rank clock offsets (see
            :func:`~batchgraph.pipeline.dist_topology.clock_offsets`).
        timeout: seconds any wait may take.
    """

    _TAG = 1

    def __init__(
        self,
        schedule: PipelineSchedule,
        rank: int,
        world: int,
        group: Any,
        offsets: Sequence[float],
        timeout: float,
    ) -> None:
        self.schedule, self.rank, self.world = schedule, rank, world
        self.group, self.offsets = group, list(offsets)
        self.timeout = timedelta(seconds=timeout)
        self._plans = {train: _plans(schedule, world, train) for train in (True, False)}
        self._recvs: list[tuple[int, Any, Tensor]] = []
        self._send: tuple[Any, Tensor] | None = None
        self._train = True

    def begin(self, train: bool) -> None:
        """Start a step: the ranks but 0 finish their last send (rank 0 posts its
        receives with :meth:`post_receives`, when it is idle, or in :meth:`finish`)."""
        self._train = train
        self._recvs = []
        if self.rank != 0:
            self._finish_send()

    def post_receives(self) -> None:
        """Rank 0: post the step's receives of the other ranks' times (once a step).

        Any time in the step will do: a rank's send of its times waits for it, and is
        only waited when that rank begins its next step, which needs rank 0 anyway.
        """
        if self.rank != 0 or self._recvs:
            return
        train = self._train
        for r in range(1, self.world):
            buf = torch.empty((max(len(self._plans[train][r]), 1), 2), dtype=torch.float64)
            work = dist.irecv(buf, src=r, group=self.group, tag=self._TAG)
            self._recvs.append((r, work, buf))

    def finish(self, events: Sequence[tuple[float, float]]) -> list[TimelineEvent]:
        """End a step: every rank's timeline on rank 0, this rank's own elsewhere."""
        plans = self._plans[self._train]
        if self.rank != 0:
            length = max(len(plans[self.rank]), 1)
            mine = torch.full((length, 2), float("nan"), dtype=torch.float64)
            if events:
                mine[: len(events)] = torch.tensor(events, dtype=torch.float64)
            work = dist.isend(mine, dst=0, group=self.group, tag=self._TAG)
            self._send = (work, mine)
            t0 = min((s for s, _ in events), default=0.0)
            return [
                TimelineEvent(self.rank, a, s - t0, e - t0)
                for a, (s, e) in zip(plans[self.rank], events)
            ]
        out = [
            TimelineEvent(0, a, s - self.offsets[0], e - self.offsets[0])
            for a, (s, e) in zip(plans[0], events)
        ]
        self.post_receives()
        recvs, self._recvs = self._recvs, []
        for r, work, buf in recvs:
            work.wait(self.timeout)
            for action, (start, end) in zip(plans[r], buf.tolist()):
                if start == start:  # not NaN: the action ran
                    out.append(
                        TimelineEvent(r, action, start - self.offsets[r], end - self.offsets[r])
                    )
        out.sort(key=lambda e: e.device)
        t0 = min((e.start for e in out), default=0.0)
        return [TimelineEvent(e.device, e.action, e.start - t0, e.end - t0) for e in out]

    def _finish_send(self) -> None:
        if self._send is not None:
            work, _ = self._send
            self._send = None
            work.wait(self.timeout)

    def release(self) -> None:
        """Forget the group and every transfer in flight, without waiting (after a failure)."""
        self.group, self._recvs, self._send = None, [], None

    def close(self) -> None:
        """Wait for this rank's last send (bounded); drop receives that never completed."""
        try:
            self._finish_send()
        finally:
            self._recvs = []
