"""The rank runner: one process per pipeline device, under ``torchrun``.

Every rank builds the same :class:`DistributedPipeline` and calls ``train_step`` each
step; each runs only its own device's actions of the schedule::

    rank of stage 0              middle ranks              rank of the last stage
    ──────────────               ────────────              ──────────────────────
    train_step(inputs, None)     train_step(None, None)    train_step(None, targets)
    split inputs into m                                    split targets into m
    F, B, ... in schedule order  F, B, ...                 F ─► loss ─► dL/dy ─► B ...
                     activations ──►            ──►
                     ◄── gradients              ◄──
    returns None                 returns None              returns the batch loss

The coordinator's role is split: the first rank feeds stage 0 from its own inputs and the
last rank computes each microbatch's loss right after the last stage's forward, so no
rank ever holds the whole model or the whole batch's outputs. With ``replicas > 1`` each
pipeline takes its own shard of the batch; the loss weights use the global batch size,
so summing gradients over the replicas of each stage gives exactly the full-batch
gradient of a mean (or sum) loss.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.checkpoint import CheckpointMethods, StateNames, guard_split
from batchgraph.pipeline.comm import COORDINATOR, MessageKey, MessageKind, Payload
from batchgraph.pipeline.dist_build import StageSpec, build_local_stages, sync_replicas
from batchgraph.pipeline.dist_comm import DistCommunicator
from batchgraph.pipeline.dist_failing import RankFailures
from batchgraph.pipeline.dist_loss import StepLoss, count_over_replicas, start_loss_replicas
from batchgraph.pipeline.dist_posting import FillPosts, StepPlan, plan_step
from batchgraph.pipeline.dist_sync import ReplicaBuffers, allreduce_gradients, gather_state
from batchgraph.pipeline.dist_tied import TiedGradients, describe_ties, ties_of
from batchgraph.pipeline.dist_timeline import RankTimeline
from batchgraph.pipeline.dist_topology import (
    ProcessGroups,
    Topology,
    check_same_config,
    describe_schedule,
)
from batchgraph.pipeline.errors import PipelineConfigError, StageError
from batchgraph.pipeline.grad_clip import RankClipping
from batchgraph.pipeline.grad_scaling import agree_on_scale, spread_overflow
from batchgraph.pipeline.loss import Loss
from batchgraph.pipeline.microbatch import (
    Batch,
    CallerGraph,
    merge_microbatches,
    split_microbatches,
)
from batchgraph.pipeline.schedule_counts import schedule_counts
from batchgraph.pipeline.schedules import make_schedule
from batchgraph.pipeline.splitting import warn_whole_model_hooks
from batchgraph.pipeline.stats import PipelineStats
from batchgraph.pipeline.step_checks import check_timeout, scalar_output_warning
from batchgraph.pipeline.step_gradients import (
    discard_step_gradients,
    restore_gradients,
    stash_gradients,
)
from batchgraph.pipeline.trace import TimelineEvent
from batchgraph.pipeline.validate import validate_schedule

__all__ = ["DistributedPipeline", "StageSpec"]

_ACT, _GRAD = MessageKind.ACTIVATION, MessageKind.GRADIENT


class DistributedPipeline(CheckpointMethods, RankClipping, RankFailures, RankTimeline):
    """Pipeline training across processes: this rank's share of a pipeline (x replicas).

    Call it the same way on every rank of an initialised process group of
    ``stages * replicas`` processes (``torchrun --nproc-per-node N``).

    Args:
        module: the model as an ``nn.Sequential`` (split into ``stages * chunks`` parts by
            parameter count; build it under ``torch.device("meta")`` so no rank
            materialises it, this rank's parts are then allocated and initialised with
            ``reset_parameters``: a floating parameter or buffer that none sets is
            NaN, and a warning names it), or one entry per model stage, each an
            ``nn.Module`` or a zero-argument factory that only the rank running that
            stage calls.
        stages: devices per pipeline p (ranks per pipeline).
        microbatches: microbatches per step m (per replica).
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``, ``"sync"``, or
            a :class:`PipelineSchedule` for ``stages`` devices and ``microbatches``
            (validated; counts that differ from its own are refused).
        loss_fn: ``loss_fn(output, target) -> scalar`` (mean or sum reduction) or a
            :class:`Loss`; needed on the last rank for :meth:`train_step`. A loss
            module's own parameters (a learned weight) start as the first replica's,
            their gradients are summed over the replicas, and a failed step leaves their
            ``.grad`` as before (put them in the last rank's optimizer).
        chunks: model stages per device v (interleaved only); device d runs stages d, d+p, ...
            Default 1, or a :class:`PipelineSchedule`'s own.
        replicas: data-parallel pipelines; ``world size == stages * replicas``.
        device: where this rank's stages run; default CPU (gloo) or ``cuda:LOCAL_RANK`` (NCCL).
        timeout: seconds any wait or collective may take before the step fails.
        collect_stats: gather every rank's timeline to rank 0 after each step (one small
            point-to-point message per rank, which rank 0 posts for while it waits for
            the pipeline to fill, so no rank waits for another at the end of a step);
            ``False`` skips it.
        broadcast_buffers: with ``replicas > 1``, copy the first replica's buffers
            (``BatchNorm``'s running statistics) to the other replicas at the start of a
            step, as ``DistributedDataParallel(broadcast_buffers=True)``, its default,
            does at the start of a forward, and when it does: at the first step and at
            each step that follows a ``train_step`` (DDP: a forward that follows one
            with grad enabled), so every replica evaluates and checkpoints the same
            model; a step that follows a ``forward`` (no grad) keeps each replica's
            own (see :class:`~batchgraph.pipeline.dist_sync.ReplicaBuffers`). ``False`` lets each replica keep the statistics of its
            own shards (as DDP's ``broadcast_buffers=False``). The attribute of that
            name may be changed between steps, on every rank alike.

    Raises:
        PipelineConfigError: if the ranks disagree on the configuration (checked by an
            all-gather before anything else), the world size is not ``stages *
            replicas``, a count differs from a :class:`PipelineSchedule`'s own, or the
            module does not split into ``stages * chunks`` stages.
        ScheduleError: if a :class:`PipelineSchedule` given is invalid (on every rank).
        RuntimeError: without an initialised process group.

    Example (``torchrun --nproc-per-node 2 train.py``)::

        dist.init_process_group("gloo")
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        with DistributedPipeline(model, stages=2, microbatches=4, schedule="1f1b",
                                 loss_fn=nn.MSELoss()) as pipe:
            rank = dist.get_rank()
            loss = pipe.train_step(x if rank == 0 else None, y if rank == 1 else None)
            pipe.clip_grad_norm_(1.0)   # by the whole model's norm, as on one device
            if rank == 0:
                print(pipe.stats.summary())
            torch.save(pipe.state_dict(), f"rank{rank}.pt")  # its stages, the model's names
    """

    def __init__(
        self,
        module: nn.Sequential | Sequence[StageSpec],
        *,
        stages: int,
        microbatches: int,
        schedule: str | PipelineSchedule = "1f1b",
        loss_fn: Callable[..., Tensor] | Loss | None = None,
        chunks: int | None = None,
        replicas: int = 1,
        device: torch.device | str | None = None,
        timeout: float = 60.0,
        collect_stats: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        check_timeout(timeout, optional=False)
        if chunks is None:  # a schedule object's own (its counts are checked below)
            chunks = schedule.chunks if isinstance(schedule, PipelineSchedule) else 1
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "backend='torch.distributed' runs inside a process group: start the script with "
                "torchrun, or call torch.distributed.init_process_group first"
            )
        self.topology = Topology(stages, replicas, dist.get_rank())
        self.groups = ProcessGroups(self.topology, timeout)
        n_specs = len(module) if isinstance(module, Sequence | nn.Sequential) else -1
        if isinstance(module, nn.Sequential):  # split here: its own hooks would never run
            warn_whole_model_hooks(module, stacklevel=2)
        ties, specs = ties_of(module, stages * chunks)
        # The model's names of each stage's state (checkpoints), read before materialising.
        self._names = StateNames.of_given(module, specs, stages * chunks)
        config = {
            "schedule": describe_schedule(schedule), "stages": stages, "microbatches": microbatches, "chunks": chunks,
            "replicas": replicas, "world": dist.get_world_size(), "modules": n_specs,
            "tied": describe_ties(ties), "broadcast_buffers": broadcast_buffers,
        }  # fmt: skip
        check_same_config(self.groups.control, config)
        if dist.get_world_size() != stages * replicas:
            raise PipelineConfigError(
                f"world size {dist.get_world_size()} != stages ({stages}) x replicas ({replicas}); "
                "start stages * replicas processes"
            )
        if isinstance(schedule, PipelineSchedule):
            # After the ranks agreed on it, so all refuse it alike. Unchecked, a count
            # that contradicts it was ignored, and an invalid one trained without some
            # backwards or hung every rank until the timeout (a raw gloo error).
            schedule_counts(schedule, stages, microbatches, chunks)
            validate_schedule(schedule)
        self.schedule = (
            schedule
            if isinstance(schedule, PipelineSchedule)
            else make_schedule(schedule, stages=stages, microbatches=microbatches, chunks=chunks)
        )
        self.groups.create_data_groups()
        self.loss = loss_fn if isinstance(loss_fn, Loss) or loss_fn is None else Loss(loss_fn)
        # A Loss that computes its own gradient keeps its separate pass (see _loss).
        self._fused_loss = (
            self.loss is not None and type(self.loss).compute_gradient is Loss.compute_gradient
        )
        backend = self.groups.backend
        if device is None:
            device = "cpu" if backend != "nccl" else f"cuda:{torch.cuda.current_device()}"
        self.device = torch.device(device)
        split = {a.stage for a in self._all_actions() if a.kind is ActionKind.BACKWARD_WEIGHT}
        self.stages = build_local_stages(
            specs or module, self.schedule, self.topology.device, self.device, split
        )
        given = [module] if isinstance(module, nn.Module) else module  # their state_dict() fails
        guard_split(given, self.own_modules, self.schedule.stages)
        # Parameters shared by stages on different ranks: their gradients are summed
        # over those ranks after each step (see dist_tied).
        self.tied = TiedGradients(ties, self.schedule.device_of, self.groups, self.stages, timeout)
        if self.groups.replica is not None:  # replicas start as the first one (as DDP)
            t, replica = self.topology, self.groups.replica
            sync_replicas(self.stages, replica, src=t.rank_of(t.device, 0))
            own = self.loss.parameters() if self._has_last and self.loss else None
            start_loss_replicas(own, self.groups.control, replica, t.rank_of(t.device, 0))
        self.comm = DistCommunicator(
            lambda s: self.topology.rank_of(self.schedule.device_of(s)),
            self.groups.pipeline,
            default_timeout=timeout,
            device=self.device if backend == "nccl" else "cpu",
            board=self.groups.board,
        )
        self.broadcast_buffers = broadcast_buffers
        t = self.topology
        self._buffers = ReplicaBuffers([self.stages[s].module for s in sorted(self.stages)],
                                       self.groups.replica, src=t.rank_of(t.device, 0))  # fmt: skip
        self._start_timeline(collect_stats, timeout)
        self._plan = self.schedule.order[self.topology.device]
        self._step_plans: dict[bool, StepPlan] = {}
        self._step = 0
        self._closed = False
        self._failed: BaseException | None = None
        self._warned_scalar = False  # a 0-d output warns once per pipeline

    # -- construction ---------------------------------------------------------------------

    def _all_actions(self) -> list[Action]:
        return [a for acts in self.schedule.order.values() for a in acts]

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (of its own stages only, each once), for its optimizer."""
        # Once: stages of this rank may share a parameter (tied weights, chunks > 1).
        params = (p for s in sorted(self.stages) for p in self.stages[s].module.parameters())
        return list(dict.fromkeys(params))

    def _step_parameters(self) -> list[nn.Parameter]:
        """What a step's backwards add to here: the stages' parameters and, on the last
        stage's rank, the loss's own (a learned weight; see :meth:`Loss.parameters`)."""
        extra = self.loss.parameters() if self._has_last and self.loss is not None else []
        return list(dict.fromkeys(self.parameters() + extra))

    # -- checkpoints (see batchgraph.pipeline.checkpoint) ---------------------------------

    @property
    def own_modules(self) -> dict[int, nn.Module]:
        """This rank's stage modules, by stage index."""
        return {s: stage.module for s, stage in self.stages.items()}

    def gather_state(self, part: dict[str, Any], dst: int = 0) -> dict[str, Any] | None:
        """Every rank's ``part`` merged on rank ``dst`` (the first replica's only)."""
        self._check_open()
        return gather_state(part, dst, self.groups.control, send=self.topology.replica == 0)

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> DistributedPipeline:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not self._closed and self._failed is None:
            # Left on an error of the caller's (between steps): the other ranks may be
            # waiting for this one's next step. They learn why at once, as from a failed
            # step, instead of after their timeout (close's barrier would wait for them).
            self._fail(exc, keep_frames=True)
        self.close()

    def close(self) -> None:
        """Wait for the other ranks (unless the pipeline failed), then release the groups."""
        if self._closed:
            return
        self._closed = True
        if self._failed is None:
            # A peer may be gone already; then there is nothing left to wait for.
            with contextlib.suppress(Exception):
                if self._gather is not None:
                    self._gather.close()
                dist.barrier(group=self.groups.control)
        self.comm.close()
        for stage in self.stages.values():
            stage.close()
        self.groups.destroy()

    def reset(self) -> None:
        """Forget saved activations, local messages, stats and the timeline (no collective)."""
        self._check_open()
        self.comm.reset()
        for stage in self.stages.values():
            stage.reset()
        self._events, self._stats = [], PipelineStats()

    @property
    def stats(self) -> PipelineStats:
        """Last step's statistics: every rank's on rank 0 (devices are global ranks), own elsewhere."""
        return self._stats

    @property
    def timeline(self) -> list[TimelineEvent]:
        """Last step's measured events (every rank's on rank 0), seconds from the first start."""
        return list(self._events)

    # -- steps ----------------------------------------------------------------------------

    def train_step(self, inputs: Batch | None, targets: Batch | None, *,
                   grad_scaler: torch.amp.GradScaler | None = None) -> Tensor | None:  # fmt: skip
        """One forward and backward over this rank's share; gradients accumulate into ``.grad``.

        Args:
            inputs: the (replica's) batch, on the rank of stage 0; ``None`` elsewhere.
            targets: the (replica's) targets, on the rank of the last stage; ``None`` elsewhere.
            grad_scaler: this rank's ``torch.amp.GradScaler`` (every rank passes one,
                made alike): the gradients are ``scaler.scale(loss).backward()``'s, and an
                overflow on any rank reaches every rank's (see
                :mod:`batchgraph.pipeline.grad_scaling`).

        Returns:
            On the last stage's rank the loss of the whole batch (over all replicas);
            ``None`` on the other ranks.

        Raises:
            PipelineConfigError: on every rank, before anything is sent (the pipeline
                stays usable), if the inputs and targets differ in sample count or the
                rank of stage 0 (the last stage) got no inputs (targets).
            RankStageError: an action failed on this rank (names rank, stage, action,
                microbatch; the original error is the cause). Every other rank then fails too.
            PeerFailedError: another rank failed first; carries its rank, stage, action,
                microbatch and message.
            PeerLostError, PipelineTimeoutError: a peer died or stopped answering.
        """
        if self.loss is None and self._has_last:
            raise PipelineConfigError("train_step needs a loss: pass loss_fn= to the pipeline")
        loss: Tensor | None = self._step_guarded(inputs, targets, train=True, scaler=grad_scaler)
        return loss

    def forward(self, inputs: Batch | None) -> Tensor | tuple[Tensor, ...] | None:
        """Forward only (no gradients); the last stage's rank returns the merged outputs."""
        out: Tensor | tuple[Tensor, ...] | None = self._step_guarded(inputs, None, train=False)
        return out

    @property
    def _has_first(self) -> bool:
        return 0 in self.stages

    @property
    def _has_last(self) -> bool:
        return self.schedule.stages - 1 in self.stages

    def _step_guarded(
        self, inputs: Batch | None, targets: Batch | None, *, train: bool,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Any:  # fmt: skip
        self._check_open()
        total_n = self._check_batches(inputs, targets, train, scaled=scaler is not None)
        scale = 1.0
        if scaler is not None:
            try:
                # A rank whose parameters are all frozen has no optimizer either.
                trains = any(p.requires_grad for p in self._step_parameters())
                scale = agree_on_scale(scaler, self.device, self.groups.control,
                                       self.comm.device, stepped=trains)  # fmt: skip
            except PipelineConfigError:
                raise  # on every rank alike: the pipeline stays usable
            except BaseException as exc:
                raise self._fail(exc) from exc
        self._step += 1
        self.comm.begin_step(self._step, self.schedule.stages)
        for stage in self.stages.values():
            stage.reset()
        # Earlier steps' gradients are stashed (see step_gradients): only this step's are
        # summed over ranks, and a failed step leaves .grad as it was before it.
        params = self._step_parameters() if train else []
        saved = stash_gradients(params) if params else []
        try:
            if self._gather is not None:
                self._gather.begin(train)  # rank 0 posts its receives during the fill
            self._buffers.begin(train, self.broadcast_buffers)  # by DDP's rule
            result, events = self._run(inputs, targets, total_n, train=train, scale=scale)
            if params:
                if self.groups.replica is not None:  # over the replicas, then the tied copies
                    allreduce_gradients(params, self.groups.replica, [None] * len(params))
                self.tied.allreduce()
            if scaler is not None:  # on every rank, with parameters or not (collective)
                spread_overflow(params, self.groups.control, self.comm.device)
            if train and result is not None and self.groups.replica is not None:
                dist.all_reduce(result, group=self.groups.replica)
            self._record(events, train)
        except BaseException as exc:
            discard_step_gradients(params, saved)
            raise self._fail(exc) from exc.__cause__ if isinstance(exc, StageError) else exc
        # Outside the try: it adds into the earlier tensors in place, which no failure
        # after it could undo.
        restore_gradients(params, saved)
        if not train and result is not None:
            # After the step: outputs that cannot be merged (0-d) are refused on this rank
            # alone, as the threads backend refuses them, and the pipeline stays usable.
            last = self.stages[self.schedule.stages - 1]
            result = merge_microbatches(
                result, f"the last stage (stage {last.index}, {type(last.module).__name__})"
            )
            if isinstance(result, Tensor) and not last.bare:  # the model returns (h,)
                result = (result,)
        return result

    def _run(
        self, inputs: Batch | None, targets: Batch | None, total_n: int, *, train: bool,
        scale: float = 1.0,
    ) -> tuple[Any, list[tuple[float, float]]]:  # fmt: skip
        m = self.schedule.microbatches
        steps = self._steps(train)
        if self._has_first:
            if inputs is None:
                raise PipelineConfigError(
                    f"rank {self.topology.rank} runs stage 0: pass the inputs"
                )
            caller = CallerGraph(inputs)  # see there: joined once the step is over
            for mb, xs in enumerate(split_microbatches(caller.inputs, m)):
                self.comm.send(MessageKey(_ACT, COORDINATOR, 0, mb), xs)
        collected: StepLoss | None = None
        if self._has_last and train:
            assert targets is not None and self.loss is not None  # see _check_batches
            self.loss.begin_step(targets)
            if self.groups.replica is not None:
                count_over_replicas(self.loss, self.groups.replica, self.comm.device)
            last = self.stages[self.schedule.stages - 1]
            tgs = split_microbatches(targets, m)
            collected = StepLoss(self.loss, last, self.comm, tgs, total_n, self._fused_loss,
                                 one_target=isinstance(targets, Tensor), grad_scale=scale)
        outputs: dict[int, tuple[Tensor, ...]] = {}

        def take_output(key: MessageKey, payload: Payload) -> None:
            # The last stage's send of its output (forward only; see StepLoss for train).
            outputs[key.microbatch] = tuple(t for t in payload if t is not None)

        events: list[tuple[float, float]] = []
        # Receives are posted ahead, each once: by plan two actions ahead, and the rest
        # of the step's while this rank waits for the pipeline to fill (see
        # dist_posting); so is the gather's.
        comm = self.comm
        gather = self._gather
        fill = FillPosts(comm, steps, on_idle=gather.post_receives if gather else None)
        fill_wait = steps.fill_wait
        if self._has_last:
            comm.set_handler(COORDINATOR, collected.take if collected else take_output)
        try:
            comm.prefetch(steps.first, payload=True)
            with torch.set_grad_enabled(train):
                for i, (stage, action, recv_key, send_key, keys) in enumerate(steps.actions):
                    if i == fill_wait:
                        fill.post()
                    events.append(stage.run_keyed(action, recv_key, send_key, comm, train))
                    if keys:
                        comm.prefetch(keys, payload=True)
        finally:
            comm.set_handler(COORDINATOR, None)
        fill.finish()
        comm.wait_sends()
        if self._has_first and train:
            caller.join()
        if not self._has_last:
            return None, events
        if collected is not None:
            if collected.scalar and not self._warned_scalar:
                self._warned_scalar = True
                last = self.stages[self.schedule.stages - 1]
                warnings.warn(
                    scalar_output_warning(last.index, type(last.module).__name__, m),
                    RuntimeWarning,
                    stacklevel=4,  # the caller of train_step
                )
            return collected.total(), events
        # Merged by the caller once the step is over on every rank (see _step_guarded).
        return [outputs[i] for i in range(m)], events

    def _steps(self, train: bool) -> StepPlan:
        """This rank's actions in a training (or forward-only) step, with their message
        keys and when to post each receive, computed once: the schedule is static."""
        steps = self._step_plans.get(train)
        if steps is None:
            plan = [a for a in self._plan if train or a.kind is ActionKind.FORWARD]
            steps = self._step_plans[train] = plan_step(plan, self.stages, self.schedule.stages)
        return steps
