"""EpochStream: several epochs in one pass, cut back into epochs in order."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import batchgraph as bg


class Lengths:
    """A batch sampler whose epoch ``e`` has ``lengths[e]`` batches named ``[e, i]``."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.epoch = -1
        self.set_calls: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.set_calls.append(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[self.epoch, i] for i in range(self.lengths[self.epoch])])

    def __len__(self) -> int:
        return self.lengths[max(self.epoch, 0)]


@given(st.lists(st.integers(0, 4), max_size=6), st.integers(0, 3))
def test_each_epoch_gets_exactly_its_batches(lengths: list[int], start: int) -> None:
    sampler = Lengths([0] * start + lengths)
    stream = bg.EpochStream(sampler, len(lengths), start_epoch=start)
    got = [list(batches) for batches in stream.epochs(iter(stream))]
    want = [[[e, i] for i in range(n)] for e, n in enumerate(lengths, start)]
    assert got == want
    assert sampler.set_calls == list(range(start, start + len(lengths)))


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.data())
def test_an_unfinished_epoch_is_skipped_to_the_next(lengths: list[int], data: st.DataObject) -> None:
    stream = bg.EpochStream(Lengths(lengths), len(lengths))
    for epoch, batches in enumerate(stream.epochs(iter(stream))):
        take = data.draw(st.integers(0, lengths[epoch]))
        seen = [b for _, b in zip(range(take), batches)]
        assert seen == [[epoch, i] for i in range(take)]


def test_through_a_dataloader_in_order() -> None:
    batches = BatchSampler(SequentialSampler(range(7)), batch_size=3, drop_last=False)
    stream = bg.EpochStream(batches, 3)
    loader = DataLoader(list(range(100, 107)), batch_sampler=stream)
    assert len(loader) == 9
    got = [[b.tolist() for b in epoch] for epoch in stream.epochs(loader)]
    assert got == [[[100, 101, 102], [103, 104, 105], [106]]] * 3


def test_set_epoch_reaches_the_sampler_inside_a_batch_sampler() -> None:
    class Shuffled:
        """A per-epoch order, as DistributedSampler gives after set_epoch."""

        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self) -> Iterator[int]:
            return iter([(i + self.epoch) % 4 for i in range(4)])

        def __len__(self) -> int:
            return 4

    stream = bg.EpochStream(BatchSampler(Shuffled(), 2, False), 2, start_epoch=1)  # type: ignore[arg-type]
    got = [list(batches) for batches in stream.epochs(iter(stream))]
    assert got == [[[1, 2], [3, 0]], [[2, 3], [0, 1]]]


def test_a_stream_of_something_else_is_refused() -> None:
    stream = bg.EpochStream(Lengths([2, 2]), 2)
    epochs = stream.epochs(iter([[0, 0]]))  # one batch, and the sampler never drawn
    with pytest.raises(RuntimeError, match="before the sampler drew"):
        list(next(epochs))


def test_a_stream_that_ends_early_is_refused() -> None:
    stream = bg.EpochStream(Lengths([3]), 1)
    short = iter(stream)
    epochs = stream.epochs(x for _, x in zip(range(2), short))
    with pytest.raises(RuntimeError, match="ended during epoch 0"):
        list(next(epochs))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="epochs must be at least 0"):
        bg.EpochStream(Lengths([1]), -1)
    with pytest.raises(TypeError, match="has no len"):
        len(bg.EpochStream(iter([[0]]), 1))
