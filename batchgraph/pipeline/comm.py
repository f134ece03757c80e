"""Moving activations and gradients between stages: the ``Communicator`` interface.

Every message has a :class:`MessageKey` — kind (activation or gradient), source stage,
destination stage, microbatch — so a receiver asks for exactly the message its next
action needs, whatever order messages arrive in. The coordinator is the endpoint
:data:`COORDINATOR` (it feeds stage 0 and takes the last stage's outputs).

Sends are asynchronous (seed 004): ``isend`` returns a :class:`Work` handle at once, so a
stage that sends an activation can go on to receive a gradient — a blocking send would
deadlock 1F1B. Handles (and through them the buffers being sent) must stay alive until
the transfer completes, or a transport like gloo reads freed memory; :meth:`Communicator.send`
keeps every handle in the communicator until :meth:`Communicator.wait_sends` at the end of
a step. Receives are asynchronous too (``irecv``); a torch.distributed implementation posts
``irecv`` early and waits on the handle when the data is needed.

:class:`ThreadCommunicator` is the in-process implementation: a mailbox shared by all
stage threads, with one gate (a lock) per message key so a send wakes only its receiver. Sends
complete immediately and hand the tensors over by reference; ``abort`` wakes every
blocked receiver with an error so that no thread stays blocked after a failure.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from batchgraph.pipeline.errors import (
    PipelineAbortedError,
    PipelineClosedError,
    PipelineTimeoutError,
)

__all__ = [
    "COORDINATOR",
    "Communicator",
    "MessageKey",
    "MessageKind",
    "Payload",
    "RecvWork",
    "ThreadCommunicator",
    "Work",
]

#: The coordinator's address: the source of stage 0's inputs, the destination of the
#: last stage's outputs and the source of the loss gradients.
COORDINATOR = -1

#: What a message carries: one entry per tensor crossing the cut (``None`` for a gradient
#: that does not exist, e.g. for an integer input).
Payload = tuple[Tensor | None, ...]


class MessageKind(str, enum.Enum):
    """Activations flow down the pipeline, gradients flow up."""

    ACTIVATION = "activation"
    GRADIENT = "gradient"


@dataclass(frozen=True)
class MessageKey:
    """Names one message: ``kind`` of ``microbatch`` from stage ``src`` to stage ``dst``."""

    kind: MessageKind
    src: int
    dst: int
    microbatch: int

    def __str__(self) -> str:
        def name(stage: int) -> str:
            return "the coordinator" if stage == COORDINATOR else f"stage {stage}"

        return f"{self.kind.value} of microbatch {self.microbatch} from {name(self.src)} to {name(self.dst)}"


class Work(ABC):
    """A handle on an asynchronous send or receive. Keep it alive until it completes."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation completes.

        Raises:
            PipelineTimeoutError: if ``timeout`` seconds pass first.
            PipelineAbortedError: if the communicator was aborted meanwhile.
        """

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation has completed (never blocks)."""


class RecvWork(Work):
    """A receive handle; :meth:`value` waits and returns the payload."""

    @abstractmethod
    def value(self, timeout: float | None = None) -> Payload:
        """Wait for the message and return it (raises like :meth:`Work.wait`)."""

    def wait(self, timeout: float | None = None) -> None:
        self.value(timeout)


class Communicator(ABC):
    """Point-to-point messages between stages (and the coordinator).

    Implementations provide ``isend``, ``irecv``, ``abort``, ``reset`` and ``close``;
    this base class keeps send handles alive (``send``/``wait_sends``) and offers a
    blocking ``recv``. ``default_timeout`` (seconds, ``None`` = wait forever) bounds every
    wait that does not pass its own.
    """

    def __init__(self, default_timeout: float | None = None) -> None:
        self.default_timeout = default_timeout
        self._inflight: list[Work] = []
        self._inflight_lock = threading.Lock()
        self._handlers: dict[int, Callable[[MessageKey, Payload], None]] = {}

    def set_handler(self, dst: int, handler: Callable[[MessageKey, Payload], None] | None) -> None:
        """Deliver messages for ``dst`` by calling ``handler(key, payload)`` in the sender.

        An event-driven local endpoint (seed 000): the coordinator registers one for
        :data:`COORDINATOR`, so the last stage's output is turned into a loss gradient at
        once, in the last stage's own thread, without waking another thread. An exception
        from the handler propagates to the sender. ``None`` removes the handler.
        """
        if handler is None:
            self._handlers.pop(dst, None)
        else:
            self._handlers[dst] = handler

    @abstractmethod
    def isend(self, key: MessageKey, payload: Payload) -> Work:
        """Start sending ``payload`` under ``key``; the caller must keep the handle alive."""

    @abstractmethod
    def irecv(self, key: MessageKey) -> RecvWork:
        """Start receiving the message named ``key``."""

    @abstractmethod
    def abort(self, error: BaseException) -> None:
        """Fail every pending and future wait with :class:`PipelineAbortedError` from ``error``."""

    @property
    @abstractmethod
    def aborted(self) -> BaseException | None:
        """The error the communicator was aborted with (``None`` when not aborted)."""

    @abstractmethod
    def reset(self) -> None:
        """Drop undelivered messages and clear an abort, ready for a new step."""

    @abstractmethod
    def close(self) -> None:
        """Release resources; further use raises :class:`PipelineClosedError`."""

    def send(self, key: MessageKey, payload: Payload) -> Work:
        """Asynchronous send whose handle the communicator keeps until :meth:`wait_sends`.

        Example:
            >>> import torch
            >>> comm = ThreadCommunicator()
            >>> key = MessageKey(MessageKind.ACTIVATION, 0, 1, microbatch=0)
            >>> _ = comm.send(key, (torch.ones(2),))
            >>> comm.recv(key)
            (tensor([1., 1.]),)
            >>> comm.wait_sends()
        """
        handler = self._handlers.get(key.dst)
        if handler is not None:
            handler(key, payload)
            return _DoneWork()
        work = self.isend(key, payload)
        with self._inflight_lock:
            self._inflight.append(work)
        return work

    def recv(self, key: MessageKey, timeout: float | None = None) -> Payload:
        """Blocking receive of the message named ``key``."""
        return self.irecv(key).value(timeout if timeout is not None else self.default_timeout)

    def wait_sends(self, timeout: float | None = None) -> None:
        """Wait for every send started with :meth:`send`, then drop their handles."""
        with self._inflight_lock:
            pending, self._inflight = self._inflight, []
        for work in pending:
            work.wait(timeout if timeout is not None else self.default_timeout)


class _DoneWork(Work):
    """An in-process send: complete as soon as it is posted."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class _MailboxRecv(RecvWork):
    def __init__(self, comm: ThreadCommunicator, key: MessageKey) -> None:
        self._comm = comm
        self._key = key
        self._payload: Payload | None = None

    def value(self, timeout: float | None = None) -> Payload:
        if self._payload is None:
            self._payload = self._comm._take(self._key, timeout)
        return self._payload

    def is_completed(self) -> bool:
        return self._payload is not None or self._comm._has(self._key)


class _Slot:
    """One message's place in the mailbox.

    ``gate`` is a lock taken at creation; the receiver blocks acquiring it and whoever
    delivers the message (or aborts or closes the communicator) releases it, once
    (``opened``). A bare lock is the cheapest wake-up CPython has: no condition
    variable, no per-wait allocation.
    """

    __slots__ = ("delivered", "gate", "opened", "payload")

    def __init__(self) -> None:
        self.gate = threading.Lock()
        self.gate.acquire()
        self.opened = False
        self.payload: Payload = ()
        self.delivered = False

    def open(self) -> None:
        """Wake the receiver (call with the communicator's lock held)."""
        if not self.opened:
            self.opened = True
            self.gate.release()


_DONE = _DoneWork()


class ThreadCommunicator(Communicator):
    """In-process communicator for stages running on threads of one process.

    Each message key has its own slot with a gate, so a send wakes exactly the one
    thread waiting for it (one shared condition variable would wake every waiting stage
    thread on every message, and each of them would fight for the GIL just to go back to
    sleep). A message that arrives before its receiver asks is picked up without waiting.

    Args:
        default_timeout: seconds a receive waits before raising
            :class:`PipelineTimeoutError` (``None``: forever; ``abort`` still wakes it).

    Example:
        >>> import torch
        >>> comm = ThreadCommunicator(default_timeout=1.0)
        >>> key = MessageKey(MessageKind.GRADIENT, 2, 1, microbatch=3)
        >>> recv = comm.irecv(key)
        >>> recv.is_completed()
        False
        >>> _ = comm.send(key, (torch.zeros(1),))
        >>> recv.value()
        (tensor([0.]),)
    """

    def __init__(self, default_timeout: float | None = None) -> None:
        super().__init__(default_timeout)
        self._lock = threading.Lock()
        self._slots: dict[MessageKey, _Slot] = {}
        self._error: BaseException | None = None
        self._closed = False

    def isend(self, key: MessageKey, payload: Payload) -> Work:
        with self._lock:
            if self._closed:
                self._check_open()
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            elif slot.delivered:
                # Two sends under one key mean the schedule ran an action twice: a bug upstream.
                raise RuntimeError(f"duplicate message: {key} was sent twice in one step")
            slot.payload = tuple(payload)
            slot.delivered = True
            slot.open()
        return _DONE

    def irecv(self, key: MessageKey) -> RecvWork:
        with self._lock:
            self._check_open()
        return _MailboxRecv(self, key)

    def recv(self, key: MessageKey, timeout: float | None = None) -> Payload:
        """Blocking receive of the message named ``key`` (no handle object on this path)."""
        return self._take(key, timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError("the communicator is closed; build a new pipeline")

    def _check_error(self, key: MessageKey) -> None:
        if self._error is not None:
            raise PipelineAbortedError(
                f"stopped waiting for {key}: the step was aborted ({self._error!r})"
            ) from self._error
        self._check_open()

    def _has(self, key: MessageKey) -> bool:
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.delivered

    def _take(self, key: MessageKey, timeout: float | None) -> Payload:
        if timeout is None:
            timeout = self.default_timeout
        with self._lock:
            if self._error is not None or self._closed:
                self._check_error(key)
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            elif slot.delivered:
                del self._slots[key]  # it arrived first: no waiting, no wake-up
                return slot.payload
        woke = slot.gate.acquire(True, -1 if timeout is None else timeout)
        with self._lock:
            # abort and close open every gate too: check why we woke up.
            self._check_error(key)
            if not woke and not slot.delivered:
                raise PipelineTimeoutError(
                    f"waited {timeout:g} s for {key}; the sender never sent it (a stage is "
                    "stuck or the schedule is inconsistent)"
                )
            if self._slots.get(key) is slot:
                del self._slots[key]
            return slot.payload

    def abort(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            for slot in self._slots.values():
                slot.open()

    @property
    def aborted(self) -> BaseException | None:
        with self._lock:
            return self._error

    def reset(self) -> None:
        with self._lock:
            self._slots = {}
            self._error = None
        with self._inflight_lock:
            self._inflight.clear()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for slot in self._slots.values():
                slot.open()
            self._slots = {}
