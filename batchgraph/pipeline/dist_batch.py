"""A training step's batches, checked on every rank before anything is sent.

The inputs live on the rank of stage 0 and the targets on the rank of the last stage, so
neither rank can compare them alone. At the start of each training step every rank
all-gathers the sample counts it holds (one small collective over the control group)
and reaches the same verdict from the same numbers: a mismatch raises the same
:class:`PipelineConfigError` on every rank, before any message is sent, so no rank is
left waiting for one and the pipeline stays usable. The counts also give the global
batch size (every replica's targets) that the loss weights divide by. With them goes what
refuses a step as the threads backend refuses it but no rank can tell alone: more
microbatches than a replica's samples, every parameter of every rank frozen with inputs
that do not require grad, ``torch.inference_mode()`` on some rank::

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
from batchgraph.pipeline.microbatch import Batch, batch_size, microbatch_fit_error
from batchgraph.pipeline.step_checks import (
    inference_mode_error,
    nothing_to_train_error,
    targets_require_grad_error,
)

__all__ = ["BatchCounts", "check_batches", "gather_counts", "local_counts"]

#: What a rank reports instead of a sample count.
NOT_HERE = -1  # it does not run the stage that takes this batch
MISSING = -2  # it does, but got None
INVALID = -3  # it got something that is not a batch, or refused (it raises its own error)

#: Bits of a rank's third number: what it knows of the step besides its batches.
TRAINABLE = 1  # a parameter of its stages requires grad, or its inputs do
INFERENCE = 2  # it was called under torch.inference_mode(): no gradient can be recorded
TRAINING = 4  # it was called by train_step (else by forward)
SCALED = 8  # it was given a GradScaler (see grad_scaling)

#: Per rank, (inputs, targets, flags): a sample count or one of the codes above, and bits.
BatchCounts = Sequence[tuple[int, int, int]]


def _count(batch: Batch | None, held: bool) -> tuple[int, BaseException | None]:
    if not held:
        return NOT_HERE, None
    if batch is None:
        return MISSING, None
    try:
        return batch_size(batch), None
    except Exception as exc:  # reported after the gather, so every rank fails together
        return INVALID, exc


def _requires_grad(batch: Batch | None) -> bool:
    items = batch if isinstance(batch, tuple | list) else (batch,)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in items)


def local_counts(
    inputs: Batch | None,
    targets: Batch | None,
    *,
    first: bool,
    last: bool,
    trainable: bool = True,
    train: bool = True,
    scaled: bool = False,
) -> tuple[tuple[int, int, int], BaseException | None]:
    """This rank's (inputs, targets, flags) counts, and its own error for a batch that is
    not one. ``trainable``: whether a parameter of this rank's stages requires grad;
    ``train``: whether ``train_step`` (not ``forward``) asks; ``scaled``: whether it was
    given a ``GradScaler``.

    Never raises: a rank that failed here before the gather would leave the others
    waiting in it.
    """
    n_in, err_in = _count(inputs, first)
    n_tg, err_tg = _count(targets, last)
    if last and err_tg is None and _requires_grad(targets):
        n_tg, err_tg = INVALID, targets_require_grad_error()
    flags = TRAINABLE if trainable or (first and _requires_grad(inputs)) else 0
    if torch.is_inference_mode_enabled():
        flags |= INFERENCE
    if train:
        flags |= TRAINING
    if scaled:
        flags |= SCALED
    return (n_in, n_tg, flags), err_in or err_tg


def gather_counts(
    group: Any, counts: tuple[int, int, int], device: torch.device
) -> list[tuple[int, int, int]]:
    """Every rank's counts (all-gather over ``group``, which holds all ranks)."""
    # Outside inference mode: a collective cannot write into inference tensors.
    with torch.inference_mode(False):
        mine = torch.tensor(counts, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
    return [(int(a), int(b), int(c)) for a, b, c in torch.stack(every).tolist()]


def check_batches(
    counts: BatchCounts,
    topology: Topology,
    first_device: int,
    last_device: int,
    microbatches: int = 1,
    *,
    train: bool = True,
) -> tuple[int, PipelineConfigError | None]:
    """The global batch size (over the replicas), or the error every rank raises.

    Args:
        counts: every rank's (inputs, targets, flags) counts, by global rank.
        topology: the ranks' grid.
        first_device, last_device: the devices (positions in a pipeline) of stage 0 and
            of the last stage.
        microbatches: microbatches per replica's batch.
        train: a training step; for ``forward`` (``False``) only the inputs are checked
            (no targets, and inference mode and frozen parameters are fine there).

    Example (2 ranks, one replica: rank 0 holds 8 inputs, rank 1 the 4 targets)::

        check_batches([(8, NOT_HERE, TRAINABLE | TRAINING), (NOT_HERE, 4, TRAINABLE | TRAINING)],
                      Topology(2, 1, 0), 0, 1)
        # (0, PipelineConfigError("inputs have 8 samples but targets have 4 (...)"))
    """
    split = _split(counts, TRAINING)
    if split is not None:
        # Each would run its own plan and wait for messages the other never sends.
        return 0, PipelineConfigError(
            f"{_ranks(split[0])} called train_step but {_ranks(split[1])} called forward; "
            "every rank must make the same call each step"
        )
    split = _split(counts, SCALED)
    if split is not None:  # the others would not join the check for overflows
        return 0, PipelineConfigError(
            f"{_ranks(split[0])} passed grad_scaler= but {_ranks(split[1])} did not; every "
            "rank passes its own GradScaler (made alike) to train_step"
        )
    inference = [r for r, (_, _, flags) in enumerate(counts) if flags & INFERENCE]
    if inference and train:
        return 0, inference_mode_error(f" on {_ranks(inference)}")
    total = 0
    for j in range(topology.replicas):
        f, last = topology.rank_of(first_device, j), topology.rank_of(last_device, j)
        n_in, n_tg = counts[f][0], counts[last][1]
        if n_in == MISSING:
            return 0, PipelineConfigError(f"rank {f} runs stage 0: pass the inputs")
        if train and n_tg == MISSING:
            return 0, PipelineConfigError(f"rank {last} runs the last stage: pass the targets")
        held = ((n_in, "inputs", f), (n_tg, "targets", last)) if train else ((n_in, "inputs", f),)
        for n, what, r in held:
            if n == INVALID:
                return 0, PipelineConfigError(
                    f"rank {r}'s {what} are refused (that rank's error says why)"
                )
        if train and n_in != n_tg:
            where = f"replica {j}: " if topology.replicas > 1 else ""
            return 0, PipelineConfigError(
                f"{where}inputs have {n_in} samples but targets have {n_tg} (inputs on rank "
                f"{f}, targets on rank {last}); pass the targets of exactly the inputs' samples"
            )
        error = microbatch_fit_error(microbatches, n_in)
        if error is not None:
            return 0, error
        total += n_in
    if train and not any(flags & TRAINABLE for _, _, flags in counts):
        return 0, nothing_to_train_error(" on any rank")
    return total, None


def _split(counts: BatchCounts, bit: int) -> tuple[list[int], list[int]] | None:
    """The ranks whose flags have ``bit`` and those whose do not, where both exist."""
    having = [r for r, (_, _, flags) in enumerate(counts) if flags & bit]
    if 0 < len(having) < len(counts):
        return having, [r for r in range(len(counts)) if r not in having]
    return None


def _ranks(ranks: Sequence[int]) -> str:
    """``"rank 0"`` or ``"ranks 0, 2"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
