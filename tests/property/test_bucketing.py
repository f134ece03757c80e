"""BucketBatchSampler: every example exactly once per epoch; buckets of similar sizes."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from batchgraph.bucketing import padding_waste


@given(
    sizes=st.lists(st.integers(1, 60), max_size=200),
    batch_size=st.integers(1, 17),
    pool=st.one_of(st.none(), st.integers(1, 8)),
    shuffle=st.booleans(),
    epoch=st.integers(0, 5),
)
def test_every_example_exactly_once_per_epoch(
    sizes: list[int], batch_size: int, pool: int | None, shuffle: bool, epoch: int
) -> None:
    sampler = bg.BucketBatchSampler(sizes, batch_size, pool=pool, shuffle=shuffle, seed=3)
    sampler.set_epoch(epoch)
    batches = list(sampler)
    assert Counter(i for b in batches for i in b) == Counter(range(len(sizes)))
    assert len(batches) == len(sampler)
    assert all(0 < len(b) <= batch_size for b in batches)
    assert sum(len(b) < batch_size for b in batches) <= 1
    assert sampler.batches(epoch) == batches  # the epoch alone decides the order
    dropping = bg.BucketBatchSampler(sizes, batch_size, pool=pool, shuffle=shuffle, drop_last=True)
    kept = [i for b in dropping.batches(epoch) for i in b]
    assert len(set(kept)) == len(kept) == len(sizes) // batch_size * batch_size
    assert len(dropping) == len(sizes) // batch_size


def test_only_set_epoch_changes_the_order() -> None:
    sampler = bg.BucketBatchSampler(list(range(100)), 10, pool=2)
    # A DataLoader calls iter(sampler) twice per epoch: iterating must not advance it.
    first, again = list(sampler), list(sampler)
    sampler.set_epoch(1)
    assert first == again == sampler.batches(0) != list(sampler) == sampler.batches(1)


def test_stricter_pools_waste_less() -> None:
    rng = random.Random(0)
    sizes = [max(1, min(56, int(rng.gauss(19, 9)))) for _ in range(2000)]
    waste = {
        pool: padding_waste(bg.BucketBatchSampler(sizes, 64, pool=pool).batches(0), sizes)
        for pool in (1, 4, None)
    }
    assert waste[1] > 0.4 > waste[4] > 0.05 > waste[None]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        bg.BucketBatchSampler([1], 0)
    with pytest.raises(ValueError, match="pool must be at least 1 batch"):
        bg.BucketBatchSampler([1], 1, pool=0)
