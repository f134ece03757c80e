"""What a rank of a ``DistributedPipeline`` does when a step cannot go on: batches
checked on every rank before any work (a refused batch leaves the pipeline usable),
and a failure published to the other ranks and the process groups torn down, so that
no peer waits for its timeout."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

from batchgraph.pipeline.dist_batch import check_batches, gather_counts, local_counts
from batchgraph.pipeline.dist_errors import (
    FailureRecord,
    PeerFailedError,
    clear_frames,
    rank_error,
)
from batchgraph.pipeline.errors import PipelineClosedError, StageError

if TYPE_CHECKING:
    from batchgraph.pipeline.actions import PipelineSchedule
    from batchgraph.pipeline.dist_comm import DistCommunicator
    from batchgraph.pipeline.dist_sync import TimelineGather
    from batchgraph.pipeline.dist_tied import TiedGradients
    from batchgraph.pipeline.dist_topology import ProcessGroups, Topology
    from batchgraph.pipeline.microbatch import Batch
    from batchgraph.pipeline.stage import Stage

__all__ = ["RankFailures"]


class RankFailures:
    """The failure handling of ``DistributedPipeline`` (its base class)."""

    if TYPE_CHECKING:
        schedule: PipelineSchedule
        stages: dict[int, Stage]
        comm: DistCommunicator
        groups: ProcessGroups
        topology: Topology
        tied: TiedGradients
        _gather: TimelineGather | None
        _closed: bool
        _failed: BaseException | None

        @property
        def _has_first(self) -> bool: ...

        @property
        def _has_last(self) -> bool: ...

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError("this pipeline is closed; build a new one")
        if self._failed is not None:
            raise PipelineClosedError(
                f"this pipeline failed ({self._failed}); its process groups are gone, build a new one"
            ) from self._failed

    def _fail(self, exc: BaseException, keep_frames: bool = False) -> BaseException:
        """Publish the failure, tear down the groups (waking blocked peers), name this rank."""
        self._failed = exc
        rank = self.topology.rank
        error = rank_error(exc, rank, self.groups.board)
        if not isinstance(error, PeerFailedError):
            self.groups.board.publish(FailureRecord.of(rank, error))
        self.comm.abort(exc)
        self.groups.destroy()
        # Destroying a gloo group closes its connections only when the group is freed,
        # and the transfers this rank had in flight hold it: a peer blocked on this rank
        # would wait until this process exits or its timeout passes (a caller that
        # catches the error and goes on, to log or save, kept every peer waiting). So
        # every holder lets go, and the peers wake now and read the board. The frames of
        # a wait that failed hold its transfer too; a stage's error keeps its frames
        # (the user's code, for post-mortem debugging), which hold no transfer.
        self.comm.release()
        if self._gather is not None:
            self._gather.release()
        self.tied.release()
        if not (keep_frames or isinstance(exc, StageError)):
            clear_frames(exc)
        gc.collect()
        return error

    def _check_batches(
        self, inputs: Batch | None, targets: Batch | None, train: bool, scaled: bool = False
    ) -> int:
        """The step's global batch size; raises what every rank raises for bad batches.

        Before the step begins (no message sent, no gradient stashed), so a refused
        batch leaves the pipeline usable, as in the threads backend; for ``forward`` too
        (an evaluation's last, smaller batch failed rank 0 inside the step, which tore
        the process groups down for good).
        """
        # Stops at the first trainable parameter: costs nothing in the usual case.
        params = (p for s in self.stages.values() for p in s.module.parameters())
        trainable = any(p.requires_grad for p in params)
        counts, own_error = local_counts(
            inputs, targets, first=self._has_first, last=self._has_last and train,
            trainable=trainable, train=train, scaled=scaled,
        )  # fmt: skip
        try:
            every = gather_counts(self.groups.control, counts, self.comm.device)
        except BaseException as exc:  # a peer is gone or stuck: the pipeline cannot go on
            raise self._fail(exc) from exc
        first, last = self.schedule.device_of(0), self.schedule.device_of(self.schedule.stages - 1)
        total, error = check_batches(
            every, self.topology, first, last, self.schedule.microbatches, train=train
        )
        if own_error is not None:
            raise own_error  # this rank's own words for its batch; the others name it
        if error is not None:
            raise error
        return total
