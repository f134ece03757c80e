"""Bucketing: minibatches of examples of similar size, so batched calls waste little.

A batch's launches follow its *largest* example (a TreeLSTM batch needs about as many
cell launches as its deepest tree, a sequence batch as many steps as its longest
sequence), so mixing a 3-leaf tree with a 50-leaf one leaves most launches nearly
empty. ``BucketBatchSampler`` shuffles, cuts the epoch into *pools* of ``pool``
batches, sorts each pool by size, cuts it into batches and shuffles the batches.

``pool`` is the strictness knob: ``1`` is plain random batching (no bucketing), larger
pools give batches of ever closer sizes, ``None`` sorts the whole epoch (strictest,
least random). Every example appears exactly once per epoch (``drop_last`` drops only
the one short batch, if any).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

from torch.utils.data import Sampler

__all__ = ["BucketBatchSampler", "padding_waste"]


class BucketBatchSampler(Sampler[list[int]]):
    """Yields lists of indices, each a batch of examples of similar ``sizes``.

    Args:
        sizes: one size per example (tree size, sequence length, ...).
        batch_size: examples per batch.
        pool: batches per sorting pool (``1``: no bucketing; ``None``: the whole epoch).
        shuffle: shuffle examples before pooling and batches after; False keeps the
            order deterministic without a seed (pools in order, batches in order).
        seed: the base seed; epoch ``e`` (see ``set_epoch``) uses ``seed + e``.
        drop_last: drop the one batch shorter than ``batch_size``, if any.

    Raises:
        ValueError: for a non-positive ``batch_size`` or ``pool``.

    Example:
        >>> sampler = BucketBatchSampler([5, 1, 4, 2, 3, 6], batch_size=2, pool=None,
        ...                              shuffle=False)
        >>> list(sampler)
        [[1, 3], [4, 2], [0, 5]]
    """

    def __init__(
        self,
        sizes: Sequence[int],
        batch_size: int,
        *,
        pool: int | None = 50,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if pool is not None and pool < 1:
            raise ValueError(f"pool must be at least 1 batch (or None for all), got {pool}")
        self.sizes = list(sizes)
        self.batch_size = batch_size
        self.pool = pool
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from now on; call it at the start of every epoch.

        As with ``DistributedSampler``, iterating does not advance the epoch by itself:
        a ``DataLoader`` calls ``iter(sampler)`` more than once per epoch, so only an
        explicit epoch keeps the order (and a resumed run's order) reproducible.
        """
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.sizes)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def batches(self, epoch: int) -> list[list[int]]:
        """The batches of ``epoch`` (what iterating yields in that epoch)."""
        rng = random.Random(self.seed + epoch)
        order = list(range(len(self.sizes)))
        if self.shuffle:
            rng.shuffle(order)
        # Pools hold whole batches, so only the epoch's last pool can end short and at
        # most one batch is shorter than batch_size.
        width = len(order) if self.pool is None else self.pool * self.batch_size
        sizes = self.sizes
        batches: list[list[int]] = []
        for start in range(0, len(order), max(width, 1)):
            pool = sorted(order[start : start + width], key=sizes.__getitem__)
            batches.extend(pool[i : i + self.batch_size] for i in range(0, len(pool), self.batch_size))
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches(self.epoch))


def padding_waste(batches: Sequence[Sequence[int]], sizes: Sequence[int]) -> float:
    """Fraction of batch slots left empty if every example were padded to its batch's max.

    Args:
        batches: lists of indices.
        sizes: one size per example.

    Returns:
        ``1 - sum(sizes) / sum(len(batch) * max size in batch)``, in ``[0, 1)``.

    Example:
        >>> round(padding_waste([[0, 1]], [1, 3]), 3)
        0.333
    """
    used = 0
    slots = 0
    for batch in batches:
        if not batch:
            continue
        batch_sizes = [sizes[i] for i in batch]
        used += sum(batch_sizes)
        slots += len(batch) * max(batch_sizes)
    return 1.0 - used / slots if slots else 0.0
