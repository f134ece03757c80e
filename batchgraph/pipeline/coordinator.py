"""The coordinator: runs a schedule over stages on threads, one reused thread per device.

One training step (seed 000's event-driven design, with a pipelined backward)::

    main thread (coordinator)            device threads (one per device, reused)
    ─────────────────────────            ──────────────────────────────────────
    split batch into microbatches
    send inputs to stage 0 ───────────►  each runs its schedule's actions in order:
                                           recv input ─► compute ─► async send
                                           (a recv blocks until its message arrives)
                                         last stage's output ─► coordinator's handler:
                                           loss, dL/d(output) ─► sent back to the last stage
    wait for every device thread
    stats from the measured events

The coordinator's output handler is registered with the communicator for the
:data:`~batchgraph.pipeline.comm.COORDINATOR` endpoint and runs in the last stage's
thread as soon as an output is sent (event-driven, seed 000): the loss costs no thread
hand-off on the critical path of 1F1B, where the last stage's backward waits for it.

Each device thread runs one task at a time, in the order its schedule gives; waiting
for a message is the only blocking. A failing task aborts the communicator, which wakes
every other blocked thread, so the step ends with the first error (naming stage, action
and microbatch) and no thread is left blocked. The threads are reused across steps and
are stopped by :meth:`Coordinator.close`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor, nn

from batchgraph import gcpause
from batchgraph.pipeline import rng
from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.comm import (
    COORDINATOR,
    Communicator,
    MessageKey,
    MessageKind,
    Payload,
    ThreadCommunicator,
)
from batchgraph.pipeline.errors import (
    PipelineAbortedError,
    PipelineClosedError,
    PipelineConfigError,
    StageError,
)
from batchgraph.pipeline.grad_scaling import grad_scale
from batchgraph.pipeline.kept_inputs import check_inputs_kept
from batchgraph.pipeline.loss import Loss, output_leaves
from batchgraph.pipeline.microbatch import (
    Batch,
    CallerGraph,
    batch_size,
    check_stages_fit,
    merge_microbatches,
    split_microbatches,
)
from batchgraph.pipeline.shared_modules import lock_shared
from batchgraph.pipeline.stage import Stage
from batchgraph.pipeline.stats import PipelineStats
from batchgraph.pipeline.step_checks import (
    inference_mode_error,
    no_gradient_error,
    nothing_to_train_error,
    scalar_output_warning,
    targets_require_grad_error,
)
from batchgraph.pipeline.step_gradients import (
    discard_step_gradients,
    restore_gradients,
    stash_gradients,
)
from batchgraph.pipeline.step_guard import StepGuard
from batchgraph.pipeline.thread_state import ThreadState
from batchgraph.pipeline.trace import TimelineEvent
from batchgraph.threads import compute_pool

__all__ = ["Coordinator"]

# One planned action: its stage, the action, the key it receives and the key it sends.
_Step = tuple[Stage, Action, MessageKey | None, MessageKey | None]
# What a device thread records per action: the action, its start and its end.
_Record = tuple[Action, float, float]


def _requires_grad(batch: Batch) -> bool:
    items = batch if isinstance(batch, tuple | list) else (batch,)
    return any([isinstance(t, Tensor) and t.requires_grad for t in items])


class Coordinator:
    """Runs training steps and forward passes of ``stages`` under ``schedule``.

    Args:
        stages: one :class:`Stage` per schedule stage, ``stages[i].index == i``.
        schedule: what each device runs, in order.
        loss: the loss (needed for :meth:`train_step` only).
        comm: the communicator; default a fresh :class:`ThreadCommunicator`.
        timeout: seconds any wait for a message may take before the step fails
            (``None``: no limit; a failing task still ends the step at once).
        check_shapes: probe the stages on the meta device before the first step (and
            whenever the microbatch shapes change).

    Raises:
        PipelineConfigError: if the stages do not match the schedule.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from batchgraph.pipeline.actions import Action, PipelineSchedule
        >>> order = {0: [Action.parse(a) for a in ["0F0", "0F1", "0B0", "0B1"]]}
        >>> schedule = PipelineSchedule("demo", 1, 1, 2, 1, order)
        >>> with Coordinator([Stage(nn.Linear(3, 1), 0, 1)], schedule,
        ...                  Loss(nn.MSELoss())) as coord:
        ...     loss = coord.train_step(torch.randn(4, 3), torch.randn(4, 1))
        >>> loss.shape
        torch.Size([])
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: PipelineSchedule,
        loss: Loss | None = None,
        comm: Communicator | None = None,
        *,
        timeout: float | None = None,
        check_shapes: bool = True,
    ) -> None:
        if len(stages) != schedule.stages:
            raise PipelineConfigError(
                f"schedule {schedule.name!r} has {schedule.stages} stages but {len(stages)} "
                "stage modules were given; give one module per stage"
            )
        for i, stage in enumerate(stages):
            if stage.index != i or stage.num_stages != len(stages):
                raise PipelineConfigError(
                    f"stages[{i}] is {stage!r}; expected index {i} of {len(stages)}"
                )
        self.stages = list(stages)
        self.schedule = schedule
        self.loss = loss
        self.comm: Communicator = comm if comm is not None else ThreadCommunicator(timeout)
        self.check_shapes = check_shapes
        split = {
            a.stage
            for acts in schedule.order.values()
            for a in acts
            if a.kind is ActionKind.BACKWARD_WEIGHT
        }
        for stage in self.stages:
            stage.split_backward = stage.index in split
        # Stages on other threads sharing a module with state run one at a time.
        lock_shared(self.stages, schedule.device_of)
        # Each device's thread runs its kernels with the caller's intra-op threads, and
        # on CUDA with its stages' GPU as its current device.
        where = {schedule.device_of(stage.index): stage.device for stage in self.stages}
        self._workers = {
            d: compute_pool(f"batchgraph-pipeline-device{d}", device=where.get(d))
            for d in range(schedule.devices)
        }
        # Per device, each action with its stage and message keys, for training and for
        # forward-only steps: the schedule is static, so nothing is looked up per action.
        self._plans: dict[bool, dict[int, list[_Step]]] = {
            train: {
                d: [
                    (self.stages[a.stage], a, *self.stages[a.stage].message_keys(a))
                    for a in actions
                    if train or a.kind is ActionKind.FORWARD
                ]
                for d, actions in schedule.order.items()
            }
            for train in (True, False)
        }
        self._checked: set[tuple[object, ...]] = set()
        self._checked_real = False  # the kept-inputs check ran on real tensors once
        self._events: list[TimelineEvent] = []
        self._stats = PipelineStats()
        self._closed = False
        self._warned_scalar = False  # see train_step: warned once per pipeline
        self._guard = StepGuard()  # one step at a time

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the device threads (waiting for them) and release the stages' state."""
        if self._closed:
            return
        self._closed = True
        self.comm.abort(PipelineClosedError("the pipeline was closed"))
        for pool in self._workers.values():
            pool.shutdown(wait=True)
        self.comm.close()
        for stage in self.stages:
            stage.close()

    def reset(self) -> None:
        """Forget saved activations, undelivered messages, stats and the timeline (after
        the step running on another thread, if any, has ended)."""
        with self._guard.step("reset"):
            self._reset()

    def _reset(self) -> None:
        self._check_open()
        self.comm.reset()
        for stage in self.stages:
            stage.reset()
        self._events = []
        self._stats = PipelineStats()

    @property
    def stats(self) -> PipelineStats:
        """Statistics of the last step (all zero before the first)."""
        return self._stats

    @property
    def timeline(self) -> list[TimelineEvent]:
        """Measured events of the last step, times relative to its first action's start."""
        return list(self._events)

    @property
    def own_modules(self) -> dict[int, nn.Module]:
        """Every stage's module (this process runs them all), by stage index."""
        return {stage.index: stage.module for stage in self.stages}

    def gather_state(self, part: dict[str, Any], dst: int = 0) -> dict[str, Any]:
        """``part`` itself: one process holds every stage (the distributed backend's
        gathers every rank's part)."""
        return part

    # -- steps ----------------------------------------------------------------------------

    def train_step(
        self, inputs: Batch, targets: Batch, *, grad_scaler: torch.amp.GradScaler | None = None
    ) -> Tensor:
        """Forward and backward of one batch; parameter gradients accumulate into ``.grad``.

        One step runs at a time: a call from another thread waits for the running step,
        one from inside it (the loss, a stage) raises ``PipelineReentrantError``.

        Args:
            inputs: a tensor or tuple of tensors (the first stage's inputs), batch in dim 0.
            targets: what the loss compares the last stage's output with, batch in dim 0.
            grad_scaler: the gradients are then those of ``scaler.scale(loss)`` (see
                :mod:`batchgraph.pipeline.grad_scaling`); the loss returned is not scaled.

        The stages run in the caller's ``torch.autocast`` state (forwards and the loss;
        backwards follow autograd) and saved-tensors hooks (see
        :mod:`batchgraph.pipeline.thread_state`). Gradients are recorded whatever the grad
        mode, as the step's name says; under ``torch.inference_mode()`` none can be, so
        it is refused.

        Returns:
            The loss of the whole batch (detached), as ``loss_fn`` on the full batch gives.

        Raises:
            PipelineConfigError: without a loss, for more microbatches than samples, or
                under ``torch.inference_mode()``.
            StageMismatchError: if the stages do not fit together (before any compute).
            StageError: if a task fails; the step is abandoned and ``.grad`` is as it was
                before the step (the gradients accumulated by earlier steps, none of this
                one's), as on one device, where such a failure comes before the backward.
        """
        with self._guard.step("train_step"):
            # Earlier steps' gradients are kept apart (see step_gradients): a step that
            # fails after some microbatches' backwards must not leave theirs behind.
            # A loss module's parameters too (a learned weight): its backwards add to
            # them per microbatch as the stages' do.
            extra = self.loss.parameters() if self.loss is not None else []
            params = list(dict.fromkeys(
                [p for s in self.stages for p in s.module.parameters()] + extra))
            saved = stash_gradients(params)
            try:
                scale = 1.0
                if grad_scaler is not None:  # where the loss is computed
                    scale = grad_scale(grad_scaler, self.stages[-1].device)
                loss = self._train_step(inputs, targets, scale)
            except BaseException:
                discard_step_gradients(params, saved)
                raise
            restore_gradients(params, saved)
            return loss

    def _train_step(self, inputs: Batch, targets: Batch, grad_scale: float) -> Tensor:
        if self.loss is None:
            raise PipelineConfigError("train_step needs a loss: pass loss_fn= to the pipeline")
        loss = self.loss
        m = self.schedule.microbatches
        n = batch_size(inputs, "inputs")
        if batch_size(targets, "targets") != n:
            raise PipelineConfigError(
                f"inputs have {n} samples but targets have {batch_size(targets)}"
            )
        if _requires_grad(targets):
            raise targets_require_grad_error()
        caller = CallerGraph(inputs)
        mbs = split_microbatches(caller.inputs, m, "inputs")
        tgs = split_microbatches(targets, m, "targets")
        one_target = isinstance(targets, Tensor)
        if not any([t.requires_grad for t in mbs[0]]) and not any(
            p.requires_grad for stage in self.stages for p in stage.module.parameters()
        ):
            # Stops at the first trainable parameter: costs nothing in the usual case.
            raise nothing_to_train_error()
        loss.begin_step(targets)
        values: list[tuple[Tensor, float]] = []
        last = self.stages[-1]
        # With the default gradient, the loss joins the last stage's backward (see
        # Stage.attached_outputs): one autograd pass fewer per microbatch.
        fused = type(loss).compute_gradient is Loss.compute_gradient
        scalars: list[int] = []  # microbatches whose output has a 0-d tensor (see below)
        graphs: list[bool] = []  # per microbatch: whether its loss has a backward

        def on_output(mb: int, outputs: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
            # Runs on the critical path (the last stage's B waits for it): weighting the
            # values for the batch loss waits until the step is over.
            if m > 1 and not scalars and any([o.dim() == 0 for o in outputs]):
                scalars.append(mb)
            # As given and as returned: a loss written for (y,) indexes the tuple.
            tgt = tgs[mb][0] if one_target else tgs[mb]
            weight = loss.weight(mbs[mb][0].shape[0], n)
            attached = last.attached_outputs(mb) if fused else None
            if attached is not None:
                # The loss on the stage's own outputs; its B starts from it, seeded with
                # the weight: the gradients of weight * loss, as below.
                with torch.enable_grad():
                    value = loss.compute_loss(attached[0] if last.bare else attached, tgt)
                graphs.append(value.requires_grad)
                last.start_backward_at(mb, (value,))
                values.append((value.detach(), weight))
                return (torch.full_like(value, weight * grad_scale),)
            graphs.append(last.has_graph(mb))
            # Detached, so no microbatch's output is kept alive through its loss graph.
            leaves = output_leaves(outputs)
            out = leaves[0] if last.bare else leaves
            with torch.enable_grad():
                value = loss.compute_loss(out, tgt)
                grads = loss.compute_gradient(value, out, weight=weight * grad_scale)
            values.append((value.detach(), weight))
            return grads

        self._run(mbs, train=True, on_output=on_output)
        if not any(graphs):
            raise no_gradient_error(last.index, type(last.module).__name__)
        caller.join()
        if scalars and not self._warned_scalar:
            self._warned_scalar = True
            warnings.warn(
                scalar_output_warning(last.index, type(last.module).__name__, m),
                RuntimeWarning,
                stacklevel=3,  # the caller of Pipeline.train_step
            )
        return torch.stack([value * weight for value, weight in values]).sum()

    def forward(self, inputs: Batch) -> Tensor | tuple[Tensor, ...]:
        """Run the forward pass only (no gradients), microbatch by microbatch, in the
        caller's autocast state and inference mode.

        Returns:
            The last stage's outputs for the whole batch, concatenated along dim 0.
        """
        with self._guard.step("forward"):
            return self._forward(inputs)

    def _forward(self, inputs: Batch) -> Tensor | tuple[Tensor, ...]:
        outputs: dict[int, tuple[Tensor, ...]] = {}

        def on_output(mb: int, out: tuple[Tensor, ...]) -> None:
            outputs[mb] = out

        self._run(
            split_microbatches(inputs, self.schedule.microbatches, "inputs"),
            train=False,
            on_output=on_output,
        )
        last = self.stages[-1]
        merged = merge_microbatches(
            [outputs[i] for i in range(len(outputs))],
            f"the last stage (stage {last.index}, {type(last.module).__name__})",
        )
        # A model returning (h,) returns it here too (merge gives one output as a tensor).
        return (merged,) if isinstance(merged, Tensor) and not last.bare else merged

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError("this pipeline is closed; build a new one")

    def _probe(self, mbs: list[tuple[Tensor, ...]]) -> None:
        sample = mbs[0]
        signature = tuple((tuple(t.shape), t.dtype) for t in sample)
        if self.check_shapes and signature not in self._checked:
            modules = [s.module for s in self.stages]
            check_stages_fit(modules, sample)
            if len(mbs) > 1:  # one microbatch runs as one device: nothing to refuse
                self._checked_real |= check_inputs_kept(
                    modules, sample, later=mbs[1], devices=[s.device for s in self.stages],
                    real=not self._checked_real)
            self._checked.add(signature)

    def _run(
        self,
        mbs: list[tuple[Tensor, ...]],
        *,
        train: bool,
        on_output: Callable[[int, tuple[Tensor, ...]], Payload | None],
    ) -> None:
        self._check_open()
        # Autocast, inference mode and saved-tensors hooks are per thread: the device
        # threads take the caller's, captured now (grad mode is the step's own:
        # train_step records). See batchgraph.pipeline.thread_state.
        state = ThreadState.capture()
        if train and state.inference:
            raise inference_mode_error()
        self._probe(mbs)
        self._reset()
        for stage in self.stages:
            stage.autocast = state.autocast
        randoms = [stage.random for stage in self.stages]
        rng_state = rng.begin_step(randoms, [stage.module for stage in self.stages], train)
        plan = self._plans[train]
        events: dict[int, list[_Record]] = {d: [] for d in plan}
        first, last = 0, len(self.stages) - 1
        loss_keys = [
            MessageKey(MessageKind.GRADIENT, COORDINATOR, last, mb) for mb in range(len(mbs))
        ]

        def handle_output(key: MessageKey, payload: Payload) -> None:
            # Runs in the last stage's thread right after its forward (seed 000's
            # immediate loss): no other thread has to wake up on the critical path.
            mb = key.microbatch
            try:
                grads = on_output(mb, tuple([t for t in payload if t is not None]))
            except Exception as exc:
                raise StageError(
                    f"the loss failed on microbatch {mb} (in the coordinator): "
                    f"{type(exc).__name__}: {exc}",
                    stage=COORDINATOR,
                    action="loss",
                    microbatch=mb,
                ) from exc
            if train and grads is not None:
                self.comm.send(loss_keys[mb], grads)

        self.comm.set_handler(COORDINATOR, handle_output)
        failure: BaseException | None = None
        # A collector pass holds the GIL and so stalls every stage thread at once; while
        # the step runs, young-generation passes come less often (see batchgraph.gcpause).
        gcpause.enter()
        try:
            futures: list[Future[None]] = [
                self._workers[d].submit(self._device_job, steps, train, state, events[d])
                for d, steps in plan.items()
            ]
            try:
                for mb, inputs in enumerate(mbs):
                    self.comm.send(
                        MessageKey(MessageKind.ACTIVATION, COORDINATOR, first, mb), inputs
                    )
            except BaseException as exc:  # also KeyboardInterrupt: never leave threads blocked
                failure = exc
                self.comm.abort(exc)
            try:
                for future in futures:
                    error = future.exception()
                    if error is not None and failure is None:
                        failure = error
            except BaseException as exc:  # interrupted while waiting: stop the threads too
                self.comm.abort(exc)
                raise
        finally:
            gcpause.leave()
            self.comm.set_handler(COORDINATOR, None)
        if failure is not None:
            root = self.comm.aborted or failure
            if isinstance(root, PipelineAbortedError) and root.__cause__ is not None:
                root = root.__cause__
            raise root
        self.comm.wait_sends()
        rng.end_step(randoms, rng_state)
        # Timeline and stats are built here, after the step, not in the device threads.
        t0 = min((start for d in events for _, start, _ in events[d]), default=0.0)
        self._events = [
            TimelineEvent(d, action, start - t0, end - t0)
            for d in sorted(events)
            for action, start, end in events[d]
        ]
        self._stats = PipelineStats.from_events(self._events, devices=self.schedule.devices)

    def _device_job(
        self, steps: list[_Step], train: bool, state: ThreadState, events: list[_Record]
    ) -> None:
        comm = self.comm
        record = events.append
        with state.job(grad=train), self._guard.inside("train_step" if train else "forward"):
            for stage, action, recv_key, send_key in steps:
                try:
                    start, end = stage.run_keyed(action, recv_key, send_key, comm, train)
                except PipelineAbortedError:
                    return  # another task failed first; its error ends the step
                except BaseException as exc:
                    comm.abort(exc)
                    raise
                record((action, start, end))
