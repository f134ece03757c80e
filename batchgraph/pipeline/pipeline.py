"""``Pipeline``: split a model into stages and train it with a pipeline schedule.

The façade ties the parts together::

    module ──partition──► stage modules ──backend──► runtime (train_step, forward, stats)
                          schedule = make_schedule(name, stages=p, microbatches=m, chunks=v)

Runtimes come from a backend registry: ``"threads"`` (one reused thread per device, in
this process, sharing the original parameters) is built in; other backends (a
``torch.distributed`` one, one process per rank) plug in with :func:`register_backend`
without touching this class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from batchgraph.pipeline.actions import PipelineSchedule
from batchgraph.pipeline.backends import BackendFactory, BackendRequest, PipelineRuntime
from batchgraph.pipeline.checkpoint import (
    CheckpointMethods,
    IncompatibleKeys,
    StateNames,
    guard_split,
)
from batchgraph.pipeline.coordinator import Coordinator
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.grad_clip import every_stage_parameters
from batchgraph.pipeline.grad_scaling import scaler_refused
from batchgraph.pipeline.held_layers import HeldLayers
from batchgraph.pipeline.loss import Loss, Output
from batchgraph.pipeline.microbatch import Batch
from batchgraph.pipeline.schedule_counts import schedule_counts
from batchgraph.pipeline.schedules import make_schedule
from batchgraph.pipeline.splitting import devices_of_stages, stage_modules
from batchgraph.pipeline.stage import Stage
from batchgraph.pipeline.stats import PipelineStats
from batchgraph.pipeline.step_checks import check_timeout
from batchgraph.pipeline.trace import TimelineEvent
from batchgraph.pipeline.traced_modes import ModeParts
from batchgraph.pipeline.validate import validate_schedule

__all__ = [
    "BackendFactory",
    "BackendRequest",
    "Pipeline",
    "PipelineRuntime",
    "available_backends",
    "register_backend",
]


_BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Make ``Pipeline(..., backend=name)`` build its runtime with ``factory``.

    Args:
        name: the backend name.
        factory: builds a runtime from a :class:`BackendRequest`.
        replace: allow replacing an existing registration.

    Raises:
        ValueError: if ``name`` is taken and ``replace`` is false.

    Example:
        >>> def my_backend(request: BackendRequest) -> PipelineRuntime:
        ...     return _threads_backend(request)   # e.g. wrap the built-in one
        >>> register_backend("threads", my_backend)
        Traceback (most recent call last):
        ...
        ValueError: backend 'threads' is already registered; pass replace=True
    """
    if name in _BACKENDS and not replace:
        raise ValueError(f"backend {name!r} is already registered; pass replace=True")
    _BACKENDS[name] = factory


def available_backends() -> tuple[str, ...]:
    """The registered backend names, sorted: ``("threads", "torch.distributed")`` once
    ``batchgraph.pipeline`` is imported (its ``dist_backend`` registers the second).

    Example:
        >>> "threads" in available_backends()
        True
    """
    return tuple(sorted(_BACKENDS))


def _threads_backend(request: BackendRequest) -> Coordinator:
    """Stages on threads of this process; modules are used in place (moved if devices given)."""
    if not request.broadcast_buffers:
        # One copy of the model: no replica could keep statistics of its own, and an
        # option that changes nothing is refused rather than ignored.
        raise PipelineConfigError(
            "broadcast_buffers=False lets data-parallel replicas keep their own buffers "
            "(backend='torch.distributed' with stages x replicas processes); "
            "backend='threads' trains one copy of the model, whose buffers are the only "
            "ones: leave broadcast_buffers out"
        )
    stages = []
    for index, module in enumerate(request.modules):
        device = None
        if request.devices is not None:
            device = request.devices[request.schedule.device_of(index)]
            module.to(device)  # moves parameters in place: same Parameter objects
        stages.append(Stage(module, index, len(request.modules), device=device))
    return Coordinator(
        stages,
        request.schedule,
        request.loss,
        timeout=request.timeout,
        check_shapes=request.check_shapes,
    )


register_backend("threads", _threads_backend)


class Pipeline(CheckpointMethods):
    """Pipeline-parallel training of a model split into stages.

    Args:
        module: an ``nn.Sequential`` or a list of layers (split into ``stages * chunks``
            balanced stages), a list of stage modules or :class:`Stage` objects (one per
            stage, in order: Stage ``i`` at position ``i``, with ``num_stages`` the
            list's length; ``stages`` is then inferred), or any ``torch.fx``-traceable module
            (its graph is split; where its Python reads ``self.training``, each stage
            runs the graph traced in the model's current mode, see
            :mod:`batchgraph.pipeline.traced_modes`).
        stages: the number of pipeline devices p (each runs ``chunks`` stages).
        microbatches: the number of microbatches m per batch (at most the batch size);
            default 1. With a :class:`PipelineSchedule`, ``stages``, ``microbatches`` and
            ``chunks`` default to its ``devices``, ``microbatches`` and ``chunks``.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``, ``"sync"``,
            or a :class:`PipelineSchedule` (validated).
        loss_fn: ``loss_fn(output, target) -> scalar`` or a :class:`Loss`; needed by
            :meth:`train_step`.
        chunks: stages per device v (``"interleaved-1f1b"`` only); default 1.
        backend: a registered backend name, see :func:`available_backends`.
        devices: one device per pipeline device; stages are moved there (in place).
        cost: how layers are balanced: ``"params"``, ``"uniform"`` or ``"profile"``.
        sample: a sample input batch, for ``cost="profile"``.
        reduction: the loss reduction, ``"auto"``, ``"mean"``, ``"batchmean"`` or ``"sum"``
            (see :class:`Loss`).
        timeout: seconds any wait for a message may take before the step fails.
        check_shapes: probe the stages on the meta device before the first step.
        broadcast_buffers: ``backend="torch.distributed"``: as
            :class:`DistributedPipeline`'s, whether data-parallel replicas' buffers
            (``BatchNorm``'s running statistics) become the first replica's at the start
            of a step, when ``DistributedDataParallel(broadcast_buffers=True)``, the
            default, would; with one replica it changes nothing, as DDP on one rank.
            ``backend="threads"`` trains one copy of the model and refuses ``False``.

    Raises:
        PipelineConfigError: for inconsistent values (the message says which are allowed).

    With ``backend="threads"`` the stages use the original parameters: after
    :meth:`train_step`, ``.grad`` holds what ``loss_fn(module(inputs), targets).backward()``
    gives on the whole batch (added to what was there, like ``backward``). Layers that use
    batch statistics (``BatchNorm`` in training mode) see one microbatch at a time: they
    normalize per microbatch and update running statistics once per microbatch.

    The threads backend runs the stages on threads of its own, and carries the calling
    thread's per-thread state to them at each step: its ``torch.autocast`` (forwards and
    the loss), ``torch.inference_mode()`` (``forward``; ``train_step`` refuses it),
    saved-tensors hooks (``torch.autograd.graph.save_on_cpu()``, any
    ``saved_tensors_hooks(pack, unpack)``: the innermost pair; called from the stage
    threads, several at once) and ``disable_saved_tensors_hooks``, and its
    ``torch.set_num_threads``. Grad mode is the step's own (``train_step`` records
    gradients whatever it is, ``forward`` none). Not carried: torch function and dispatch
    modes (``with torch.device(...)``, ``FlopCounterMode``; a step run inside one warns),
    the current CUDA stream and device. Anomaly detection, deterministic algorithms and
    the default dtype are process-wide and need no carrying.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
        ...                     nn.Linear(8, 1))
        >>> x, y = torch.randn(10, 4), torch.randn(10, 1)
        >>> with Pipeline(net, stages=2, microbatches=4, schedule="1f1b",
        ...               loss_fn=nn.MSELoss()) as pipe:
        ...     loss = pipe.train_step(x, y)   # 4 microbatches of 3, 3, 2 and 2 samples
        ...     busy = pipe.stats.utilization  # share of device time spent computing
        >>> grads = [p.grad.clone() for p in net.parameters()]
        >>> net.zero_grad()
        >>> one_device = nn.MSELoss()(net(x), y)   # the same step, unsplit
        >>> one_device.backward()
        >>> torch.allclose(loss, one_device), 0 < busy <= 1
        (True, True)
        >>> all(torch.allclose(g, p.grad, atol=1e-6) for g, p in zip(grads, net.parameters()))
        True
    """

    def __init__(
        self,
        module: nn.Module | Sequence[nn.Module] | Sequence[Stage],
        stages: int | None = None,
        microbatches: int | None = None,
        schedule: str | PipelineSchedule = "1f1b",
        loss_fn: Callable[[Output, Output], Tensor] | Loss | None = None,
        chunks: int | None = None,
        backend: str = "threads",
        devices: Sequence[torch.device | str] | None = None,
        *,
        cost: str = "params",
        sample: Batch | None = None,
        reduction: str = "auto",
        timeout: float | None = None,
        check_shapes: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        if backend not in _BACKENDS:
            raise PipelineConfigError(
                f"backend {backend!r} is not registered; registered backends: "
                f"{', '.join(available_backends())}. A backend plugs in with "
                "batchgraph.pipeline.register_backend(name, factory)"
            )
        check_timeout(timeout)
        if not isinstance(broadcast_buffers, bool):
            raise PipelineConfigError(
                f"broadcast_buffers must be True or False, got {broadcast_buffers!r}"
            )
        stages, microbatches, chunks = schedule_counts(schedule, stages, microbatches, chunks)
        if not isinstance(chunks, int) or chunks < 1:
            raise PipelineConfigError(f"chunks must be an int >= 1, got {chunks!r}")
        if stages is not None and (not isinstance(stages, int) or stages < 1):
            raise PipelineConfigError(f"stages must be an int >= 1, got {stages!r}")
        early = None
        if stages is not None and not isinstance(schedule, PipelineSchedule):
            # The schedule's own refusals (chunks > 1 with '1f1b', too few microbatches)
            # before the model is split: they are the first thing to fix.
            try:
                early = make_schedule(
                    schedule, stages=stages, microbatches=microbatches, chunks=chunks
                )
            except ValueError as exc:
                raise PipelineConfigError(str(exc)) from exc
        name = schedule.name if isinstance(schedule, PipelineSchedule) else schedule
        modules = stage_modules(module, stages, chunks, cost, sample, name)
        if len(modules) % chunks:
            raise PipelineConfigError(
                f"{len(modules)} stage modules cannot be dealt to devices with chunks={chunks}: "
                "give a multiple of chunks"
            )
        p = len(modules) // chunks
        if isinstance(schedule, PipelineSchedule):
            if schedule.stages != len(modules) or schedule.microbatches != microbatches:
                raise PipelineConfigError(
                    f"schedule {schedule.name!r} is for {schedule.stages} stages and "
                    f"{schedule.microbatches} microbatches, but the pipeline has "
                    f"{len(modules)} stages and microbatches={microbatches}"
                )
            validate_schedule(schedule)
            plan = schedule
        elif early is not None and early.stages == len(modules):
            plan = early
        else:
            try:
                plan = make_schedule(schedule, stages=p, microbatches=microbatches, chunks=chunks)
            except ValueError as exc:
                raise PipelineConfigError(str(exc)) from exc
        devices = devices_of_stages(module, plan, devices)
        if devices is not None and len(devices) != plan.devices:
            raise PipelineConfigError(
                f"devices has {len(devices)} entries; give one per pipeline device ({plan.devices})"
            )
        loss = loss_fn if isinstance(loss_fn, Loss) or loss_fn is None else Loss(loss_fn, reduction)
        # Before the backend moves (or materialises) the stages: tensors are matched by identity.
        whole: nn.Module | list[nn.Module] = (
            module
            if isinstance(module, nn.Module)
            else [s.module if isinstance(s, Stage) else s for s in module]
        )
        self._names = StateNames.by_identity(whole, modules)
        # A layer replaced in the model later would not reach the stages: refused then.
        self._held = HeldLayers(whole, modules) if isinstance(whole, nn.Module) else None
        self.schedule = plan
        self.stage_modules = modules
        self.backend = backend
        self._runtime = _BACKENDS[backend](
            BackendRequest(
                modules=modules,
                schedule=plan,
                loss=loss,
                devices=None if devices is None else [torch.device(d) for d in devices],
                timeout=timeout,
                check_shapes=check_shapes,
                broadcast_buffers=broadcast_buffers,
            )
        )
        # Where other processes train some stages, the model's own state_dict() here is stale.
        items = [whole] if isinstance(whole, nn.Module) else whole
        guard_split(items, self._runtime.own_modules, len(modules))

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        # A runtime that is a context manager learns why the block was left (a process
        # backend tells its peers at once instead of waiting for them).
        leave = getattr(self._runtime, "__exit__", None)
        if callable(leave):
            leave(*exc)
        else:
            self.close()

    def train_step(
        self,
        inputs: Batch | None,
        targets: Batch | None,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> Tensor | None:
        """One forward and backward over the batch; gradients accumulate into ``.grad``.

        Args:
            inputs: a tensor (or tuple of tensors) with the batch in dimension 0.
                ``backend="torch.distributed"``: on the first rank; ``None`` elsewhere.
            targets: the loss targets, batch in dimension 0.
                ``backend="torch.distributed"``: on the last rank; ``None`` elsewhere.
            grad_scaler: a ``torch.amp.GradScaler`` for float16 autocast: the gradients
                are then those ``scaler.scale(loss).backward()`` gives on one device
                (follow with ``scaler.step(optimizer)`` and ``scaler.update()``; see
                :mod:`batchgraph.pipeline.grad_scaling`); every rank passes its own.

        Returns:
            The loss of the whole batch (a detached scalar tensor); ``None`` on ranks
            other than the last with ``backend="torch.distributed"``.

        Raises:
            StageMismatchError: if the stages do not fit together (checked before any work).
            StageError: if a stage's task fails (names stage, action and microbatch).
            PipelineReentrantError: if called from inside a running step of this
                pipeline (its loss function, a stage); a call from another thread waits
                for the running step instead (``backend="threads"``).
        """
        self._check_modes()
        # A process backend takes None where a rank owns neither end; the threads backend
        # rejects None with its own error, so the casts only widen what reaches it.
        if grad_scaler is None:
            return self._runtime.train_step(cast(Batch, inputs), cast(Batch, targets))
        step = self._runtime.train_step
        if "grad_scaler" not in inspect.signature(step).parameters:
            raise scaler_refused(self.backend)
        loss: Tensor | None = cast(Any, step)(inputs, targets, grad_scaler=grad_scaler)
        return loss

    def forward(self, inputs: Batch | None) -> Tensor | tuple[Tensor, ...] | None:
        """The model's outputs for the whole batch, without gradients.

        With ``backend="torch.distributed"`` the first rank passes the inputs (others
        ``None``) and only the last rank gets the outputs. One step runs at a time, as
        for :meth:`train_step`.
        """
        self._check_modes()
        return self._runtime.forward(cast(Batch, inputs))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:  # fmt: skip
        """Clip the gradients by the norm over every stage, as on one device.

        ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on the unsplit model:
        the same total norm (a parameter shared by stages counted once) and the same
        scaling of every gradient. On threads the stages train the model's own
        parameters; with ``backend="torch.distributed"`` each rank clips its own by the
        norm over every rank (collective: call it on every rank; see
        :meth:`DistributedPipeline.clip_grad_norm_`), where clipping a rank's
        parameters by their own norm would scale each stage differently.

        Returns:
            The total norm of the gradients (before clipping).

        Raises:
            RuntimeError: for a non-finite total with ``error_if_nonfinite=True``.
            PipelineConfigError: if this process holds only some stages and the
                backend cannot compute the norm over the others.

        Example:
            >>> import copy
            >>> net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
            >>> twin = copy.deepcopy(net)
            >>> x, y = torch.randn(6, 4), torch.randn(6, 1)
            >>> with Pipeline(net, stages=2, microbatches=3, loss_fn=nn.MSELoss()) as pipe:
            ...     _ = pipe.train_step(x, y)
            ...     total = pipe.clip_grad_norm_(0.1)
            >>> nn.MSELoss()(twin(x), y).backward()
            >>> want = nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
            >>> torch.allclose(total, want), all(
            ...     torch.allclose(p.grad, q.grad, atol=1e-7)
            ...     for p, q in zip(net.parameters(), twin.parameters()))
            (True, True)
        """
        clip = getattr(self._runtime, "clip_grad_norm_", None)
        if callable(clip):
            total: Tensor = clip(max_norm, norm_type, error_if_nonfinite, foreach)
            return total
        own = self._runtime.own_modules
        params = every_stage_parameters(own, self.schedule.stages, self.backend)
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)

    def _check_modes(self) -> None:
        """Refuse, before any work, a mode a graph-split stage was not traced in, and a
        model whose layers were replaced since the stages were split from it."""
        self._check_layers()
        for module in self.stage_modules:
            if isinstance(module, ModeParts):
                module.select()

    def _check_layers(self) -> None:
        if self._held is not None:
            self._held.check()

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`CheckpointMethods.state_dict`; refused once a layer of the model
        was replaced (the stages would give the old one's state under its name).

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
            >>> with Pipeline(net, stages=2) as pipe:
            ...     net[2] = nn.Linear(3, 1)
            ...     pipe.state_dict()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            batchgraph.pipeline.errors.PipelineConfigError: the model's layer '2' was replaced ...
        """
        self._check_layers()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """See :meth:`CheckpointMethods.load_state_dict`; refused once a layer of the
        model was replaced (the old one would get the state).

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
            >>> with Pipeline(net, stages=2) as pipe:
            ...     pipe.load_state_dict(net.state_dict())
            IncompatibleKeys(missing_keys=[], unexpected_keys=[])
        """
        self._check_layers()
        return super().load_state_dict(state_dict, strict)

    @property
    def stats(self) -> PipelineStats:
        """Statistics of the last step."""
        return self._runtime.stats

    @property
    def timeline(self) -> list[TimelineEvent]:
        """Measured events of the last step (seconds from its first action's start)."""
        return self._runtime.timeline

    def reset(self) -> None:
        """Drop saved activations, pending messages, stats and timeline (e.g. after a failure)."""
        self._runtime.reset()

    @property
    def own_modules(self) -> dict[int, nn.Module]:
        """The modules of the stages this process runs, by stage index."""
        return self._runtime.own_modules

    def gather_state(self, part: dict[str, Any], dst: int = 0) -> dict[str, Any] | None:
        """Every process's ``part`` merged on rank ``dst`` (see :class:`PipelineRuntime`)."""
        return self._runtime.gather_state(part, dst)

    def close(self) -> None:
        """Stop the runtime's threads or processes; the modules stay usable."""
        self._runtime.close()
