"""A :class:`~batchgraph.pipeline.comm.Communicator` on ``torch.distributed`` point-to-point.

One process per pipeline device (started by ``torchrun`` or ``init_process_group``); gloo
on CPU, NCCL on GPU. The first time a message key is used, its message travels as two or
more transfers::

    sender (rank a)                                   receiver (rank b)
    ───────────────                                   ─────────────────
    isend header  [kind src dst mb n dtype ndim dims] ─► irecv header   (posted at step start)
    isend tensor 0 ──────────────────────────────────► irecv tensor 0  (allocated from the header)
    ...

The header names the message and every tensor's dtype and shape, so the receiver
allocates exactly what was sent (a mismatched send can never be silently truncated) and
checks that the header names the message it expected (a mismatch raises instead of
mixing microbatches up). Both ends then remember the key's signature (dtypes and
shapes), so in later steps the receiver posts the buffers ahead: with gloo, a message of
up to 256 KiB travels as *one* transfer, the header followed by the tensors in one buffer
(the receiver checks the header and takes the tensors as views; the sender copies the
tensors into that key's buffer, allocated once with the header written in, and reused
every step once its last send has been waited); a larger one, or any on
NCCL, as the header plus one transfer per tensor into the buffers posted ahead. If the
signature changed, the sender fills what the receiver posted for the old one (carrying
the new header) and sends the tensors again under fresh tags, sized by that header.
Every transfer has its own tag, derived from the message key,
so gloo matches sends and receives by name, in whatever order the two schedules post
them: no two ranks ever block on each other's ordering, and since every send is
asynchronous (seed 004) a rank that sends an activation goes straight on to receive a
gradient. Each send handle keeps its buffers (header and tensors) referenced until
:meth:`Communicator.wait_sends` has waited it, so gloo never reads freed memory.

Messages whose both ends live on this rank (the coordinator's inputs, outputs and loss
gradients; neighbouring stages of a one-device pipeline) go through an in-process
:class:`~batchgraph.pipeline.comm.ThreadCommunicator`.

Every wait is bounded by a timeout. A failed wait is turned into a clear error: the
original failure of another rank when one was published on the abort board
(:class:`~batchgraph.pipeline.dist_errors.PeerFailedError`), a
:class:`~batchgraph.pipeline.errors.PipelineTimeoutError` naming peer and message, or a
:class:`~batchgraph.pipeline.dist_errors.PeerLostError` when the peer's connection closed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from batchgraph.pipeline.comm import (
    COORDINATOR,
    Communicator,
    MessageKey,
    Payload,
    RecvWork,
    ThreadCommunicator,
    Work,
)
from batchgraph.pipeline.dist_errors import AbortBoard, PeerLostError
from batchgraph.pipeline.dist_header import (
    FRESH,
    HEADER_LEN,
    KINDS,
    Signature,
    encode_signature,
    payload_specs,
    signature_of,
)
from batchgraph.pipeline.dist_packing import (
    HEADER_BYTES,
    PACK_LIMIT,
    PackedBuffer,
    layout,
    unpack,
)
from batchgraph.pipeline.dist_recv import Expected, RemoteRecv
from batchgraph.pipeline.errors import (
    PipelineAbortedError,
    PipelineClosedError,
    PipelineConfigError,
    PipelineTimeoutError,
)

__all__ = ["DistCommunicator"]


class _SendWork(Work):
    """The transfers of one sent message; holds their buffers until waited (seed 004)."""

    def __init__(
        self,
        comm: DistCommunicator,
        key: MessageKey,
        peer: int,
        works: list[Any],
        buffers: list[Tensor],
    ) -> None:
        self._comm, self._key, self._peer = comm, key, peer
        self._works = works
        self._buffers = buffers  # referenced only to keep them alive
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        if self._done:
            return
        for work in self._works:  # every handle of the message, not just the first
            self._comm._wait(work, self._key, self._peer, timeout, "send of")
        self._done = True
        self._works, self._buffers = [], []

    def is_completed(self) -> bool:
        return self._done


class DistCommunicator(Communicator):
    """Messages between pipeline stages that live on different ``torch.distributed`` ranks.

    Args:
        rank_of_stage: the global rank that runs each stage.
        group: the process group the transfers use (its members are the ranks of one
            pipeline); ``None``: the default group.
        default_timeout: seconds any wait may take before :class:`PipelineTimeoutError`.
        device: where received tensors are allocated (``cpu`` for gloo, the rank's CUDA
            device for NCCL); sent tensors are moved there first.
        board: where a rank's failure is published, read back to explain a failed wait.

    Raises:
        RuntimeError: if ``torch.distributed`` is not initialised.

    Example (on every rank of a 2-process group; ``rank`` is this process's rank)::

        comm = DistCommunicator({0: 0, 1: 1}.__getitem__, default_timeout=30.0)
        key = MessageKey(MessageKind.ACTIVATION, 0, 1, microbatch=0)
        if rank == 0:
            comm.send(key, (torch.ones(4, 8),))   # returns at once
            comm.wait_sends()                     # end of step: every handle waited
        else:
            comm.prefetch([key])                  # optional: post the header receive early
            (x,) = comm.recv(key)                 # shape and dtype come from the header
    """

    def __init__(
        self,
        rank_of_stage: Callable[[int], int],
        group: dist.ProcessGroup | None = None,
        *,
        default_timeout: float = 60.0,
        device: torch.device | str = "cpu",
        board: AbortBoard | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "DistCommunicator needs an initialised process group: run under torchrun or "
                "call torch.distributed.init_process_group first"
            )
        super().__init__(default_timeout)
        self.rank = dist.get_rank()
        self.group = group
        self._pg: Any = group if group is not None else dist.group.WORLD
        self._group_ranks: dict[int, int] = {}
        self.device = torch.device(device)
        self.board = board
        self._rank_of_stage = rank_of_stage
        self._stage_ranks: dict[int, int] = {}
        self._local = ThreadCommunicator(default_timeout)
        self._headers: dict[MessageKey, tuple[Any, Tensor, Expected | None]] = {}
        # Last signature sent or received per key; both ends keep the same table, so
        # both know which buffers the receiver posted ahead.
        self._known: dict[MessageKey, Signature] = {}
        self._header_cache: dict[tuple[MessageKey, Signature], Tensor] = {}
        self._header_byte_cache: dict[MessageKey, tuple[Signature, Tensor]] = {}
        self._ahead: dict[MessageKey, list[tuple[Any, Tensor] | None]] = {}
        # Per key, the send buffer of its known one-transfer signature (see PackedBuffer).
        self._packed: dict[MessageKey, PackedBuffer] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._parity = 0
        self._stages = 1

    # -- routing and tags -----------------------------------------------------------------

    def _peer(self, key: MessageKey) -> int:
        """The other end's rank (this rank for the coordinator and same-rank stages)."""
        if key.src == COORDINATOR or key.dst == COORDINATOR:
            return self.rank
        src = self._rank_of(key.src)
        return self._rank_of(key.dst) if src == self.rank else src

    def _rank_of(self, stage: int) -> int:
        rank = self._stage_ranks.get(stage)
        if rank is None:
            rank = self._stage_ranks[stage] = self._rank_of_stage(stage)
        return rank

    def _tag(self, key: MessageKey, part: int) -> int:
        # Unique among the messages in flight between two ranks: (step parity, kind,
        # source stage, microbatch, part). The parity keeps a fast rank's next step from
        # matching a receive of this step.
        kind = KINDS.index(key.kind)
        slots = 2 * FRESH  # header + tensors, then the same again for fresh tags
        tag = ((self._parity * 2 + kind) * self._stages + key.src) * 65536 + key.microbatch
        tag = tag * slots + part
        if tag >= 2**31:
            raise PipelineConfigError(f"{key}: too many stages or microbatches to tag messages")
        return tag

    def begin_step(self, step: int, num_stages: int) -> None:
        """Start a step: clear local state and set the tag space (all ranks count steps alike)."""
        self._check()
        self._parity = step % 2
        self._stages = max(1, num_stages)
        self._local.reset()

    # -- sends ----------------------------------------------------------------------------

    def isend(self, key: MessageKey, payload: Payload) -> Work:
        self._check()
        packed = self._packed.get(key)
        if packed is not None and packed.free and packed.matches(payload):
            # The steady state (gloo, small, same signature as last time): one copy per
            # tensor into the key's buffer, one transfer.
            packed.fill(payload)
            return self._send_packed(key, packed)
        peer = self._peer(key)
        if peer == self.rank:
            return self._local.isend(key, payload)
        device = self.device
        tensors = [
            None if t is None else (t if t.device == device else t.to(device)).detach().contiguous()
            for t in payload
        ]
        sig = signature_of(payload_specs(tensors))
        header = self._header(key, sig)
        known = self._known.get(key)
        self._known[key] = sig
        if known is not None and self._packs(known):
            # The receiver posted one buffer for header and tensors of the known signature:
            # one transfer, the tensors after the header. If the signature changed, that
            # buffer carries the new header and the tensors follow under fresh tags.
            if sig == known:
                packed = PackedBuffer(header, sig, peer, device)
                self._packed[key] = packed
                packed.fill(tuple(tensors))
                return self._send_packed(key, packed)
            self._packed.pop(key, None)
            buf = torch.empty(layout(known)[1], dtype=torch.uint8, device=device)
            buf[:HEADER_BYTES].view(torch.int64).copy_(header)
            buffers: list[Tensor] = [buf]
            works = [self._post_send(buf, key, peer, 0)]
            for part, t in enumerate(tensors, start=1):
                if t is not None:
                    buffers.append(t)
                    works.append(self._post_send(t, key, peer, part + FRESH))
            return _SendWork(self, key, peer, works, buffers)
        buffers, works = [header], [self._post_send(header, key, peer, 0)]
        fresh = 0
        if known is not None and known != sig:
            # The receiver posted buffers for the old signature: fill them, then send the
            # real tensors under fresh tags, sized by the header.
            fresh = FRESH
            for part, spec in enumerate(known, start=1):
                if spec is not None:
                    filler = torch.zeros(spec[1], dtype=spec[0], device=device)
                    buffers.append(filler)
                    works.append(self._post_send(filler, key, peer, part))
        for part, t in enumerate(tensors, start=1):
            if t is not None:
                buffers.append(t)
                works.append(self._post_send(t, key, peer, part + fresh))
        return _SendWork(self, key, peer, works, buffers)

    def _send_packed(self, key: MessageKey, packed: PackedBuffer) -> _SendWork:
        work = _SendWork(
            self, key, packed.peer, [self._post_send(packed.buf, key, packed.peer, 0)], [packed.buf]
        )
        packed.work = work
        return work

    def _header(self, key: MessageKey, sig: Signature) -> Tensor:
        """The header of ``key`` with ``sig`` (the same every step: encoded once, never
        written to, so sends in flight can share it)."""
        header = self._header_cache.get((key, sig))
        if header is None:
            header = self._header_cache[(key, sig)] = encode_signature(key, sig)
        return header

    def _header_bytes(self, key: MessageKey, sig: Signature) -> Tensor:
        """:meth:`_header` as bytes, what a one-transfer message starts with."""
        found = self._header_byte_cache.get(key)
        if found is None or found[0] != sig:
            found = self._header_byte_cache[key] = (sig, self._header(key, sig).view(torch.uint8))
        return found[1]

    def _packs(self, sig: Signature) -> bool:
        """Whether a message of ``sig`` travels as one transfer (both ends decide alike)."""
        return self.device.type == "cpu" and layout(sig)[1] <= PACK_LIMIT

    # Transfers are posted on the process group object itself: what ``dist.isend`` and
    # ``dist.irecv`` do after their per-call argument checks (a complex tensor travels as
    # its real view, as there), without those checks' cost on every message.

    def _group_rank(self, peer: int) -> int:
        rank = self._group_ranks.get(peer)
        if rank is None:
            rank = self._group_ranks[peer] = dist.get_group_rank(self._pg, peer)
        return rank

    def _post_send(self, t: Tensor, key: MessageKey, peer: int, part: int) -> Any:
        try:
            wire = torch.view_as_real(t) if t.is_complex() else t
            return self._pg.send([wire], self._group_rank(peer), self._tag(key, part))
        except RuntimeError as exc:  # posting to a peer whose connection is gone fails at once
            raise self._explain(exc, key, peer, None, "send of") from exc

    # -- receives -------------------------------------------------------------------------

    def prefetch(self, keys: Iterable[MessageKey], *, payload: bool = False) -> None:
        """Post receives of ``keys`` now, so messages land while this rank computes.

        Headers are small; with ``payload=True`` the tensors' buffers are posted too, for
        keys whose signature (dtypes and shapes) is known from an earlier step: the sender
        then transmits at once instead of waiting for the receiver to read the header
        (one round trip less on the critical path). Post payloads only a few actions
        ahead: each posted buffer holds memory until its message arrives. A key whose
        known signature travels as one transfer (gloo, at most 256 KiB) gets its one
        buffer, header and tensors, at once, whatever ``payload`` says.
        """
        self._check()
        for key in keys:
            peer = self._peer(key)
            if peer == self.rank:
                continue
            known = self._known.get(key)
            if key not in self._headers:
                expect: Expected | None = None
                if known is not None and self._packs(known):
                    # Small and known: one buffer for the header and the tensors. What
                    # the message must start with and the tensors' views are made now,
                    # while posting (ahead, often while idle), not when it has landed.
                    buf = torch.empty(layout(known)[1], dtype=torch.uint8, device=self.device)
                    expect = (
                        buf[:HEADER_BYTES],
                        self._header_bytes(key, known),
                        unpack(buf, known),
                    )
                else:
                    buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
                self._headers[key] = (self._post_recv(buf, key, peer, 0), buf, expect)
            if payload and known is not None and not self._packs(known):
                self._post_ahead(key, peer)

    def ahead_bytes(self, key: MessageKey) -> int:
        """The memory a :meth:`prefetch` of ``key`` without ``payload`` holds until its
        message lands: the one-transfer buffer of a small known signature, else a header."""
        known = self._known.get(key)
        if known is not None and self._packs(known):
            return layout(known)[1]
        return HEADER_BYTES

    def _post_ahead(self, key: MessageKey, peer: int) -> None:
        """Post buffers for ``key``'s known signature (once)."""
        if key not in self._ahead:
            posted: list[tuple[Any, Tensor] | None] = []
            for part, spec in enumerate(self._known[key], start=1):
                if spec is None:
                    posted.append(None)
                    continue
                t = torch.empty(spec[1], dtype=spec[0], device=self.device)
                posted.append((self._post_recv(t, key, peer, part), t))
            self._ahead[key] = posted

    def _take_ahead(self, key: MessageKey, peer: int) -> list[tuple[Any, Tensor] | None]:
        """The buffers posted ahead for ``key`` (posted now if they were not yet)."""
        self._post_ahead(key, peer)
        return self._ahead.pop(key)

    def _take_header(self, key: MessageKey, peer: int) -> tuple[Any, Tensor, Expected | None]:
        if key not in self._headers:
            self.prefetch([key])
        return self._headers.pop(key)

    def _post_recv(self, t: Tensor, key: MessageKey, peer: int, part: int) -> Any:
        try:
            wire = torch.view_as_real(t) if t.is_complex() else t
            return self._pg.recv([wire], self._group_rank(peer), self._tag(key, part))
        except RuntimeError as exc:
            raise self._explain(exc, key, peer, None, "receive of") from exc

    def recv(self, key: MessageKey, timeout: float | None = None) -> Payload:
        """Blocking receive of ``key`` (no handle object for a message from this rank)."""
        self._check()
        peer = self._peer(key)
        seconds = timeout if timeout is not None else self.default_timeout
        if peer == self.rank:
            return self._local.recv(key, seconds)
        return RemoteRecv(self, key, peer).value(seconds)

    def irecv(self, key: MessageKey) -> RecvWork:
        self._check()
        peer = self._peer(key)
        if peer == self.rank:
            return self._local.irecv(key)
        return RemoteRecv(self, key, peer)

    # -- waiting, failures ----------------------------------------------------------------

    def _wait(
        self, work: Any, key: MessageKey, peer: int, timeout: float | None, what: str
    ) -> None:
        self._check()
        seconds = timeout if timeout is not None else self.default_timeout
        try:
            if seconds is None:
                work.wait()
            else:
                work.wait(timeout=timedelta(seconds=seconds))
        except RuntimeError as exc:
            raise self._explain(exc, key, peer, seconds, what) from exc

    def _explain(
        self, exc: RuntimeError, key: MessageKey, peer: int, seconds: float | None, what: str
    ) -> BaseException:
        # A peer that failed first published why; that is the error worth reporting.
        record = self.board.read() if self.board is not None else None
        desc = f"{what} {key}".strip()
        seconds = seconds if seconds is not None else self.default_timeout
        if record is not None and record.rank != self.rank:
            return record.as_error(self.rank, f"at the {desc}")
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            return PipelineTimeoutError(
                f"rank {self.rank} waited {seconds or 0:g} s for the {desc} with rank {peer}; that rank "
                "is stuck, dead or runs another schedule"
            )
        return PeerLostError(
            f"rank {self.rank} lost rank {peer} while waiting for the {desc}: the peer process "
            f"died or closed its connection ({text.splitlines()[0][:200] if text else 'no detail'})",
            rank=self.rank,
            peer=peer,
        )

    def _check(self) -> None:
        if self._closed:
            raise PipelineClosedError("the communicator is closed; build a new pipeline")
        if self._error is not None:
            raise PipelineAbortedError(
                f"rank {self.rank}: the pipeline was aborted ({self._error!r}); build a new one"
            ) from self._error

    def abort(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._local.abort(error)

    @property
    def aborted(self) -> BaseException | None:
        return self._error

    def reset(self) -> None:
        """Drop local messages and kept handles; a pending remote receive cannot be undone."""
        self._local.reset()
        with self._inflight_lock:
            self._inflight.clear()
        self._error = None

    def close(self) -> None:
        self._closed = True
        self._local.close()
        self._headers.clear()
        self._ahead.clear()
        self._packed.clear()
        with self._inflight_lock:
            self._inflight.clear()

    def release(self) -> None:
        """:meth:`close`, and forget the process group (see ``DistributedPipeline._fail``)."""
        self.close()
        self.group = self._pg = None
