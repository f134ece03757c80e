"""One pipeline stage: a part of the model on a device, and how it runs F, B, I and W.

A stage keeps, per microbatch, what its backward needs::

    F(mb):  recv activation ─► x (leaf, requires grad) ─► module ─► y ─► send y.detach()
            saved[mb] = (x, y, tape)        tape only when the backward is split
    B(mb):  recv dL/dy ─► autograd.backward(y, dL/dy) ─► send x.grad upstream
    I(mb):  recv dL/dy ─► tape.backward_input ─► send dL/dx upstream; keep tape for W
    W(mb):  tape.backward_weight (parameter gradients into .grad)

A split stage that sends nothing upstream (stage 0, or inputs that need no gradient)
records no tape: its I only keeps dL/dy and its W runs the whole backward, as nothing
upstream waits for an I there. Stage 0's inputs are the caller's: when they require grad,
its backward carries on into the caller's graph (``x.grad`` as on one device; inputs that
a graph computed come as leaves, joined back once after the step: see
:class:`~batchgraph.pipeline.microbatch.CallerGraph`).

Each stage input is a detached leaf, so a stage's autograd graph ends at its own
boundary: the gradient at the input is read from the leaf and sent upstream as a
message, like it would cross a process boundary. The module gets a non-leaf alias of
the leaf, so its first op may be in place (``ReLU(inplace=True)``) as on one device. Messages go through a
:class:`~batchgraph.pipeline.comm.Communicator`; sends are asynchronous and their
handles are kept by the communicator until the end of the step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from time import perf_counter

import torch
from torch import Tensor, nn

from batchgraph.autocasting import AutocastState, in_autocast_state
from batchgraph.pipeline import _autograd
from batchgraph.pipeline.actions import Action, ActionKind
from batchgraph.pipeline.backward import BackwardTape, TwoStageBackward
from batchgraph.pipeline.comm import COORDINATOR, Communicator, MessageKey, MessageKind, Payload
from batchgraph.pipeline.errors import PipelineAbortedError, StageError
from batchgraph.pipeline.kept_inputs import check_inputs_kept
from batchgraph.pipeline.rng import StageRandom

__all__ = ["Stage"]

_NO_CONTEXT = nullcontext()

_KIND_WORDS = {
    ActionKind.FORWARD: "forward",
    ActionKind.BACKWARD: "backward",
    ActionKind.BACKWARD_INPUT: "input-gradient backward",
    ActionKind.BACKWARD_WEIGHT: "weight-gradient backward",
}


class _Saved:
    """What one microbatch's forward keeps for its backward."""

    __slots__ = ("inputs", "outputs", "tape")

    def __init__(
        self,
        inputs: tuple[Tensor | None, ...],
        outputs: tuple[Tensor, ...],
        tape: BackwardTape | None,
    ) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.tape = tape


class _Deferred:
    """A whole backward that ``I`` left for ``W``: a stage whose inputs need no gradient."""

    __slots__ = ("grads", "saved")

    def __init__(self, saved: _Saved, grads: list[Tensor | None]) -> None:
        self.saved = saved
        self.grads = grads

    def backward_weight(self) -> None:
        """Run the backward, parameter gradients into ``.grad``."""
        _backward(self.saved.outputs, self.grads)


def _backward(outputs: tuple[Tensor, ...], grads: Sequence[Tensor | None]) -> None:
    """Backward from the outputs that have a gradient and a graph, accumulating ``.grad``."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    if pairs:
        _autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


@contextmanager
def _nested(
    outer: AbstractContextManager[object], inner: AbstractContextManager[object]
) -> Iterator[None]:
    with outer, inner:
        yield


def _default_device(module: nn.Module) -> torch.device:
    for param in module.parameters():
        return param.device
    for buffer in module.buffers():
        return buffer.device
    return torch.device("cpu")


class Stage:
    """A part of the model, its position in the pipeline, and its per-microbatch state.

    Args:
        module: the stage's module; its parameters are used in place (never copied).
        index: the stage's position, 0-based.
        num_stages: how many stages the pipeline has.
        device: where inputs are moved before the module runs; default: the device of
            the module's first parameter (CPU for a parameterless module).

    Raises:
        ValueError: if ``index`` is not in ``range(num_stages)``.

    Example:
        >>> import torch
        >>> stage = Stage(torch.nn.Linear(2, 3), index=0, num_stages=1)
        >>> outputs = stage.forward(0, (torch.ones(4, 2),), train=True)
        >>> outputs[0].shape
        torch.Size([4, 3])
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        num_stages: int,
        device: torch.device | str | None = None,
    ) -> None:
        if not 0 <= index < num_stages:
            raise ValueError(f"stage index must be in 0..{num_stages - 1}, got {index}")
        self.module = module
        self.index = index
        self.num_stages = num_stages
        self.device = torch.device(device) if device is not None else _default_device(module)
        # Given, not found: a Pipeline built from Stages places them there.
        self.device_given = device is not None
        self.split_backward = False
        # Whether the module's last forward returned a tensor, not a tuple or list of them:
        # what crosses a cut is always a tuple, but the loss and pipe.forward get the last
        # stage's outputs as the module returned them ((h,) stays a tuple).
        self.bare = True
        self._split: TwoStageBackward | None = None
        self._saved: dict[int, _Saved] = {}
        self._weight_pending: dict[int, BackwardTape | _Deferred | None] = {}
        # The autocast state of the thread that started the step: autocast is per thread,
        # and a runtime that runs this stage on a thread of its own sets it (see run_keyed).
        self.autocast: AutocastState | None = None
        # Reproducible random numbers on a thread of its own (see pipeline.rng); a runtime
        # that plans it (rng.begin_step) makes the stage lock and seed its actions.
        self.random = StageRandom(index, self.device)
        # The input signatures its forward was checked for reading back what it kept of
        # its inputs (kept_inputs), where the runtime checks no whole pipeline: None, none.
        self.kept_checks: set[tuple[object, ...]] | None = None
        self.kept_checked_real = False  # that check ran on real tensors once
        # Held around each action where a stage on another thread shares a module that
        # may keep state (see pipeline.shared_modules): None, none.
        self.shared: threading.Lock | None = None

    def __repr__(self) -> str:
        return (
            f"Stage({self.index}/{self.num_stages}, {type(self.module).__name__}, "
            f"device={self.device})"
        )

    # -- addressing ---------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def _prev(self) -> int:
        return COORDINATOR if self.is_first else self.index - 1

    def _next(self) -> int:
        return COORDINATOR if self.is_last else self.index + 1

    # -- compute ------------------------------------------------------------------------

    def forward(self, microbatch: int, inputs: Payload, *, train: bool) -> Payload:
        """Run the module on one microbatch; keep what the backward needs when training.

        Args:
            microbatch: the microbatch index (the key of the saved state).
            inputs: the tensors crossing into this stage.
            train: keep activations (and a two-stage tape if ``split_backward``).

        Returns:
            The outputs, detached (what is sent to the next stage).

        Raises:
            TypeError: if the module returns something other than tensors.
        """
        xs = tuple([self._prepare(t, train) for t in inputs])
        if self.kept_checks is not None:
            self._check_kept(xs)
        if not train:
            with torch.no_grad():
                return self._as_outputs(self.module(*xs))
        # The module gets aliases of the leaves (see _autograd.alias: its first op may be
        # in place); dL/dx is read off the leaves, which saved.inputs keeps.
        args = xs if self.is_first else tuple([self._alias(x) for x in xs])
        tape: BackwardTape | None = None
        if (
            self.split_backward
            and not self.is_first
            and any(x is not None and x.requires_grad for x in xs)
        ):
            # Only a stage that sends dL/d(inputs) upstream gains from splitting; without
            # one (stage 0) I has nobody waiting and W runs the whole backward at once,
            # so the forward records no tape (recording costs tens of microseconds per layer).
            # Stage 0 must not split even when the caller's inputs require grad: a tape's
            # I returns dL/dx instead of carrying it on into the caller's graph.
            split = self._split
            if split is None or (not self._saved and not self._weight_pending and split.stale()):
                # Built at the first training forward and again when the trainable set or
                # a parameter object changed (checked only when no tape is in flight:
                # between steps).
                if split is not None:
                    split.close()
                split = self._split = TwoStageBackward(self.module)
            with split.record() as tape:
                outputs = self._as_outputs(self.module(*args))
            split.check(outputs, tape)
        else:
            outputs = self._as_outputs(self.module(*args))
        self._saved[microbatch] = _Saved(xs, outputs, tape)
        return tuple([o.detach() for o in outputs])

    def attached_outputs(self, microbatch: int) -> tuple[Tensor, ...] | None:
        """The outputs ``microbatch``'s forward kept, still attached to the stage's graph,
        when its backward may start from a loss computed on them instead; else ``None``.

        That is when the backward is one autograd pass (no two-stage tape): a loss
        computed on these outputs and handed to :meth:`start_backward_at` joins that
        pass, so the last stage needs no separate pass for dL/d(outputs) (a two-stage
        tape covers the module's own graph only, so a split stage keeps its outputs).
        """
        saved = self._saved.get(microbatch)
        if saved is None or saved.tape is not None:
            return None
        return saved.outputs

    def has_graph(self, microbatch: int) -> bool:
        """Whether an output ``microbatch``'s forward kept requires grad (has a backward)."""
        saved = self._saved.get(microbatch)
        return saved is not None and any(o.requires_grad for o in saved.outputs)

    def start_backward_at(self, microbatch: int, roots: tuple[Tensor, ...]) -> None:
        """Run ``microbatch``'s backward from ``roots`` (computed from
        :meth:`attached_outputs`, e.g. its loss) instead of its outputs: the gradient its
        ``B`` (or deferred ``W``) then receives has one entry per root."""
        self._saved[microbatch].outputs = roots

    def backward(self, microbatch: int, grad_outputs: Payload) -> Payload:
        """Full backward (``B``): parameter gradients into ``.grad``; returns dL/d(inputs)
        (``None`` each on stage 0, whose backward goes on into the caller's graph)."""
        saved = self._take(microbatch)
        if saved.tape is not None:
            # Recorded for a split backward but asked for a full one: run both halves now.
            grads = self._split_input(saved, grad_outputs)
            saved.tape.backward_weight()
            return grads
        _backward(saved.outputs, self._grads(grad_outputs))
        if self.is_first:
            # The caller's inputs: the backward went on into their graph (into x.grad when x
            # is a leaf); their slices are not leaves and nothing is sent upstream.
            return tuple(None for _ in saved.inputs)
        return tuple(x.grad if x is not None and x.requires_grad else None for x in saved.inputs)

    def backward_input(self, microbatch: int, grad_outputs: Payload) -> Payload:
        """``I``: dL/d(inputs) now; the parameter gradients wait for :meth:`backward_weight`."""
        saved = self._take(microbatch)
        if saved.tape is None:
            if self.split_backward:
                # No input needs a gradient (see forward): nothing to send upstream, so
                # the whole backward waits for W, which fills a bubble with it.
                self._weight_pending[microbatch] = _Deferred(saved, self._grads(grad_outputs))
                return tuple(None for _ in saved.inputs)
            # Not recorded for a split backward: do it all now, W has nothing left.
            self._saved[microbatch] = saved
            grads = self.backward(microbatch, grad_outputs)
            self._weight_pending[microbatch] = None
            return grads
        grads = self._split_input(saved, grad_outputs)
        self._weight_pending[microbatch] = saved.tape
        return grads

    def _split_input(self, saved: _Saved, grad_outputs: Payload) -> Payload:
        assert saved.tape is not None
        inputs = tuple(x for x in saved.inputs if x is not None)
        got = iter(saved.tape.backward_input(saved.outputs, self._grads(grad_outputs), inputs))
        return tuple(None if x is None else next(got) for x in saved.inputs)

    def backward_weight(self, microbatch: int) -> None:
        """``W``: accumulate the parameter gradients deferred by :meth:`backward_input`.

        Raises:
            RuntimeError: if ``I`` has not run for ``microbatch``.
        """
        if microbatch not in self._weight_pending:
            raise RuntimeError(
                f"stage {self.index}: W of microbatch {microbatch} before its I; the schedule "
                "must run I before W"
            )
        tape = self._weight_pending.pop(microbatch)
        if tape is not None:
            tape.backward_weight()

    # -- one action: receive, compute, send ----------------------------------------------

    def message_keys(self, action: Action) -> tuple[MessageKey | None, MessageKey | None]:
        """The message ``action`` receives before it computes and the one it sends after.

        ``None`` where there is none (``W`` receives and sends nothing; stage 0's ``B``/``I``
        sends nothing). The schedule is static, so a runtime computes these once.
        """
        mb = action.microbatch
        if action.kind is ActionKind.FORWARD:
            return (
                MessageKey(MessageKind.ACTIVATION, self._prev(), self.index, mb),
                MessageKey(MessageKind.ACTIVATION, self.index, self._next(), mb),
            )
        if action.kind is ActionKind.BACKWARD_WEIGHT:
            return None, None
        send = (
            None
            if self.is_first
            else MessageKey(MessageKind.GRADIENT, self.index, self.index - 1, mb)
        )
        return MessageKey(MessageKind.GRADIENT, self._next(), self.index, mb), send

    def run(self, action: Action, comm: Communicator, *, train: bool = True) -> tuple[float, float]:
        """Run one action: receive its input, compute, send its result.

        Args:
            action: an action of this stage.
            comm: the communicator.
            train: whether this is a training step (forward-only steps keep nothing).

        Returns:
            ``(start, end)`` of the compute and send, from ``time.perf_counter()``; the wait
            for the input message is before ``start`` (it is bubble, not work).

        Raises:
            StageError: if the action fails; names the stage, action and microbatch and
                chains the original exception.
            PipelineAbortedError: if another task failed while this one waited.
        """
        recv_key, send_key = self.message_keys(action)
        return self.run_keyed(action, recv_key, send_key, comm, train)

    def run_keyed(
        self,
        action: Action,
        recv_key: MessageKey | None,
        send_key: MessageKey | None,
        comm: Communicator,
        train: bool,
    ) -> tuple[float, float]:
        """:meth:`run` with the keys from :meth:`message_keys` computed ahead (a runtime's loop)."""
        kind = action.kind
        try:
            payload = None if recv_key is None else comm.recv(recv_key)
            # Started once the context is entered: waiting for the generator lock (see
            # _context) is bubble, like waiting for the message.
            with self._context(kind, action.microbatch):
                start = perf_counter()
                if kind is ActionKind.BACKWARD_WEIGHT:
                    self.backward_weight(action.microbatch)
                    return start, perf_counter()
                assert payload is not None
                if kind is ActionKind.FORWARD:
                    result = self.forward(action.microbatch, payload, train=train)
                elif kind is ActionKind.BACKWARD:
                    result = self.backward(action.microbatch, payload)
                else:
                    result = self.backward_input(action.microbatch, payload)
                if send_key is not None:
                    comm.send(send_key, result)
                return start, perf_counter()
        except (PipelineAbortedError, StageError):
            raise  # already names where it failed (e.g. the loss, run from this thread)
        except Exception as exc:
            mb = action.microbatch
            raise StageError(
                f"stage {self.index} failed in action {action} ({_KIND_WORDS[action.kind]} "
                f"of microbatch {mb}): {type(exc).__name__}: {exc}",
                stage=self.index,
                action=str(action),
                microbatch=mb,
            ) from exc

    def reset(self) -> None:
        """Drop every saved activation and pending weight gradient (e.g. after a failure)."""
        self._saved.clear()
        self._weight_pending.clear()

    def close(self) -> None:
        """Drop state and restore the module the two-stage backprop had prepared."""
        self.reset()
        if self._split is not None:
            self._split.close()
            self._split = None

    @property
    def pending(self) -> int:
        """Microbatches whose backward has not finished on this stage (in flight)."""
        return len(self._saved) + sum(1 for t in self._weight_pending.values() if t is not None)

    # -- helpers --------------------------------------------------------------------------

    def _prepare(self, value: Tensor | None, train: bool) -> Tensor | None:
        if value is None:
            return None
        if value.device != self.device:
            value = value.to(self.device)
        if train and not self.is_first and (value.is_floating_point() or value.is_complex()):
            # A leaf of its own: the stage's graph stops here and dL/dx is read off it.
            return value.detach().requires_grad_(True)
        return value

    def _context(self, kind: ActionKind, microbatch: int) -> AbstractContextManager[object]:
        """What an action runs in: a forward (and the loss, which the last stage's send
        computes) in the caller's autocast, backwards follow autograd, outside it; when
        the stage draws random numbers, its own generator state (see pipeline.rng); and
        the lock of the stages sharing a module with state (taken first)."""
        own = self._own_context(kind, microbatch)
        return own if self.shared is None else _nested(self.shared, own)

    def _own_context(self, kind: ActionKind, microbatch: int) -> AbstractContextManager[object]:
        forward = kind is ActionKind.FORWARD
        if not self.random.locked or not (forward or self.random.drew):
            if forward and self.autocast is not None:
                return in_autocast_state(self.autocast)
            return _NO_CONTEXT
        if not forward:
            return self.random.hold()
        if self.autocast is None:
            return self.random.forward(microbatch)
        return _nested(self.random.forward(microbatch), in_autocast_state(self.autocast))

    def _check_kept(self, xs: tuple[Tensor | None, ...]) -> None:
        checked = self.kept_checks
        assert checked is not None
        signature = tuple(None if x is None else (x.shape, x.dtype) for x in xs)
        if signature not in checked and all(x is not None for x in xs):
            self.kept_checked_real |= check_inputs_kept(
                [self.module], [x for x in xs if x is not None], self.index,
                devices=[self.device], real=not self.kept_checked_real)
        checked.add(signature)

    @staticmethod
    def _alias(x: Tensor | None) -> Tensor | None:
        return _autograd.alias(x) if x is not None and x.requires_grad else x

    def _as_outputs(self, result: object) -> tuple[Tensor, ...]:
        self.bare = not isinstance(result, (tuple, list))
        items: Sequence[object] = result if isinstance(result, (tuple, list)) else (result,)
        for i, item in enumerate(items):
            if not isinstance(item, Tensor):
                raise TypeError(
                    f"stage {self.index} ({type(self.module).__name__}) returned "
                    f"{type(item).__name__} at output {i}; a stage must return a tensor or a "
                    "tuple of tensors"
                )
        return tuple(items)  # type: ignore[arg-type]

    def _take(self, microbatch: int) -> _Saved:
        try:
            return self._saved.pop(microbatch)
        except KeyError:
            raise RuntimeError(
                f"stage {self.index}: backward of microbatch {microbatch} without its forward"
            ) from None

    def _grads(self, grad_outputs: Payload) -> list[Tensor | None]:
        device = self.device
        return [g if g is None or g.device == device else g.to(device) for g in grad_outputs]
