"""A training step's batches, checked on every rank before anything is sent.

The inputs live on the rank of stage 0 and the targets on the rank of the last stage, so
neither rank can compare them alone. At the start of each training step every rank
all-gathers the sample counts it holds (one small collective over the control group)
and reaches the same verdict from the same numbers: a mismatch raises the same
:class:`PipelineConfigError` on every rank, before any message is sent, so no rank is
left waiting for one and the pipeline stays usable. The counts also give the global
batch size (every replica's targets) that the loss weights divide by::

    rank 0 (stage 0)      rank 1 (last stage)
    (inputs 8, -)         (-, targets 4)
          └── all_gather ──┘
    every rank: "inputs have 8 samples but targets have 4 (...)"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from batchgraph.pipeline.dist_topology import Topology
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.microbatch import Batch, batch_size

__all__ = ["BatchCounts", "check_batches", "gather_counts", "local_counts"]

#: What a rank reports instead of a sample count.
NOT_HERE = -1  # it does not run the stage that takes this batch
MISSING = -2  # it does, but got None
INVALID = -3  # it got something that is not a batch (that rank raises its own error)

#: Per rank, (inputs, targets): a sample count or one of the codes above.
BatchCounts = Sequence[tuple[int, int]]


def _count(batch: Batch | None, held: bool) -> tuple[int, BaseException | None]:
    if not held:
        return NOT_HERE, None
    if batch is None:
        return MISSING, None
    try:
        return batch_size(batch), None
    except Exception as exc:  # reported after the gather, so every rank fails together
        return INVALID, exc


def local_counts(
    inputs: Batch | None, targets: Batch | None, *, first: bool, last: bool
) -> tuple[tuple[int, int], BaseException | None]:
    """This rank's (inputs, targets) counts, and its own error for a batch that is not one.

    Never raises: a rank that failed here before the gather would leave the others
    waiting in it.
    """
    n_in, err_in = _count(inputs, first)
    n_tg, err_tg = _count(targets, last)
    return (n_in, n_tg), err_in or err_tg


def gather_counts(
    group: Any, counts: tuple[int, int], device: torch.device
) -> list[tuple[int, int]]:
    """Every rank's counts (all-gather over ``group``, which holds all ranks)."""
    mine = torch.tensor(counts, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [(int(a), int(b)) for a, b in torch.stack(every).tolist()]


def check_batches(
    counts: BatchCounts, topology: Topology, first_device: int, last_device: int
) -> tuple[int, PipelineConfigError | None]:
    """The global batch size (over the replicas), or the error every rank raises.

    Args:
        counts: every rank's (inputs, targets) counts, by global rank.
        topology: the ranks' grid.
        first_device, last_device: the devices (positions in a pipeline) of stage 0 and
            of the last stage.
    """
    total = 0
    for j in range(topology.replicas):
        f, last = topology.rank_of(first_device, j), topology.rank_of(last_device, j)
        n_in, n_tg = counts[f][0], counts[last][1]
        if n_in == MISSING:
            return 0, PipelineConfigError(f"rank {f} runs stage 0: pass the inputs")
        if n_tg == MISSING:
            return 0, PipelineConfigError(f"rank {last} runs the last stage: pass the targets")
        for n, what, r in ((n_in, "inputs", f), (n_tg, "targets", last)):
            if n == INVALID:
                return 0, PipelineConfigError(
                    f"rank {r}'s {what} are not a batch (that rank's error says why)"
                )
        if n_in != n_tg:
            where = f"replica {j}: " if topology.replicas > 1 else ""
            return 0, PipelineConfigError(
                f"{where}inputs have {n_in} samples but targets have {n_tg} (inputs on rank "
                f"{f}, targets on rank {last}); pass the targets of exactly the inputs' samples"
            )
        total += n_tg
    return total, None
