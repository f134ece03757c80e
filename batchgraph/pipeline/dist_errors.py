"""Failures across ranks: the errors, and the board where a failing rank says why.

When a rank fails it writes a :class:`FailureRecord` (rank, stage, action, microbatch,
message) to the process group's key-value store — the first record wins — and then
destroys its pipeline process groups and lets go of them (and of its transfers in
flight, which hold them), so they are freed even if the process lives on. Freeing them
closes its connections, so every rank blocked on it wakes at once with a connection error; that rank reads the board,
raises :class:`PeerFailedError` carrying the original failure, and destroys its own
groups in turn, waking the ranks blocked on it. The failure spreads along the pipeline
in a few milliseconds per hop instead of each rank waiting for its timeout.

A rank that dies without publishing (killed) leaves no record: its neighbours see the
closed connection (:class:`PeerLostError`) or, if the connection stays silently open,
their wait's timeout (:class:`~batchgraph.pipeline.errors.PipelineTimeoutError`); they
publish that, so the ranks further away report it too.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from batchgraph.errors import BatchgraphError
from batchgraph.pipeline.errors import PipelineAbortedError, StageError

__all__ = [
    "AbortBoard",
    "FailureRecord",
    "PeerFailedError",
    "PeerLostError",
    "RankStageError",
    "clear_frames",
    "rank_error",
]


class RankStageError(StageError):
    """A stage's action failed on this rank; names rank, stage, action and microbatch.

    The original exception is chained as ``__cause__``.
    """

    def __init__(
        self, message: str, *, rank: int, stage: int, action: str, microbatch: int
    ) -> None:
        super().__init__(message, stage=stage, action=action, microbatch=microbatch)
        self.rank = rank


class PeerFailedError(PipelineAbortedError):
    """This rank stopped because another rank failed first; carries that original failure.

    ``rank``, ``stage``, ``action`` and ``microbatch`` describe the original failure (``-1``
    and ``""`` where unknown); ``origin_message`` is its message.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        stage: int,
        action: str,
        microbatch: int,
        origin_message: str,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.stage = stage
        self.action = action
        self.microbatch = microbatch
        self.origin_message = origin_message


class PeerLostError(BatchgraphError, ConnectionError):
    """The connection to another rank closed while this rank waited on it (the peer died)."""

    def __init__(self, message: str, *, rank: int, peer: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer


@dataclass(frozen=True)
class FailureRecord:
    """Why a rank failed: where, and the error's type and message."""

    rank: int
    stage: int
    action: str
    microbatch: int
    error: str
    message: str

    def as_error(self, me: int, context: str) -> PeerFailedError:
        """The error rank ``me`` raises when it stops because of this failure."""
        where = f"stage {self.stage}, action {self.action}, microbatch {self.microbatch}"
        if self.stage < 0:
            where = "outside a stage action"
        return PeerFailedError(
            f"rank {me} stopped {context}: rank {self.rank} failed first ({where}): "
            f"{self.error}: {self.message}",
            rank=self.rank,
            stage=self.stage,
            action=self.action,
            microbatch=self.microbatch,
            origin_message=self.message,
        )

    @classmethod
    def of(cls, rank: int, exc: BaseException) -> FailureRecord:
        """The record of ``exc`` raised on ``rank`` (stage details read off the error)."""
        if isinstance(exc, PeerFailedError):
            return cls(
                exc.rank,
                exc.stage,
                exc.action,
                exc.microbatch,
                "PeerFailedError",
                exc.origin_message,
            )
        stage = getattr(exc, "stage", -1)
        action = str(getattr(exc, "action", ""))
        microbatch = getattr(exc, "microbatch", -1)
        return cls(rank, stage, action, microbatch, type(exc).__name__, str(exc))


class AbortBoard:
    """A failure notice on a ``torch.distributed`` store, under a per-pipeline prefix.

    Args:
        store: the store (``None``: a board that records nothing and reads nothing).
        prefix: keys are ``f"{prefix}/count"`` and ``f"{prefix}/first"``.

    Example:
        >>> from datetime import timedelta
        >>> import torch.distributed as dist
        >>> board = AbortBoard(dist.HashStore(), "demo")
        >>> board.read() is None
        True
        >>> board.publish(FailureRecord(1, 1, "1F0", 0, "ValueError", "boom"))
        >>> board.read().action
        '1F0'
    """

    def __init__(self, store: Any | None, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def publish(self, record: FailureRecord) -> None:
        """Write ``record`` unless another rank's failure was written first (never raises)."""
        if self.store is None:
            return
        try:
            if int(self.store.add(f"{self.prefix}/count", 1)) == 1:
                self.store.set(f"{self.prefix}/first", json.dumps(asdict(record)))
        except Exception:  # the store may have died with its host rank: nothing to tell
            return

    def read(self) -> FailureRecord | None:
        """The first published failure, or ``None`` (also when the store is unreachable)."""
        if self.store is None:
            return None
        key = f"{self.prefix}/first"
        try:
            if not self.store.check([key]):
                return None
            data = json.loads(self.store.get(key))
        except Exception:
            return None
        return FailureRecord(**data)


def rank_error(exc: BaseException, rank: int, board: AbortBoard) -> BaseException:
    """What rank ``rank`` raises for ``exc``: a stage's error names the rank; a raw error
    (of a collective after the step's actions: the timeline gather, an all-reduce) is
    the failure of the rank that failed first, if another did; anything else as is.

    Example:
        >>> from batchgraph.pipeline.errors import StageError
        >>> board = AbortBoard(None, "demo")
        >>> failed = StageError("stage 1 failed", stage=1, action="1F0", microbatch=0)
        >>> str(rank_error(failed, 3, board))
        'rank 3: stage 1 failed'
    """
    if isinstance(exc, StageError) and not isinstance(exc, RankStageError):
        return RankStageError(
            f"rank {rank}: {exc}", rank=rank, stage=exc.stage, action=exc.action,
            microbatch=exc.microbatch,
        )  # fmt: skip
    if not isinstance(exc, BatchgraphError):
        record = board.read()
        if record is not None and record.rank != rank:
            return record.as_error(rank, "in a collective with the other ranks")
    return exc


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames of ``exc``'s traceback and of its causes'
    (a failed wait's frames hold its transfer, and so its process group).

    Example:
        >>> try:
        ...     raise ValueError("x")
        ... except ValueError as err:
        ...     clear_frames(err)
    """
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
