"""Several epochs through one ``DataLoader`` iterator, so workers never stop at an epoch's end.

A ``DataLoader`` starts its workers on an epoch only when ``iter(loader)`` is called,
so every epoch begins with the training process waiting for a whole minibatch to be
recorded and scheduled (the pipeline fill), even with ``persistent_workers``. When
the batch sampler spans all epochs instead, the workers build the next epoch's first
batches while the training process finishes this one:

```
stream = EpochStream(BucketBatchSampler(sizes, 64), epochs=10)
loader = graph_loader(trees, collate, stream, num_workers=1)
for epoch, batches in enumerate(stream.epochs(loader)):
    for batch in batches:           # this epoch's batches, in order
        ...
```

The wrapped sampler's ``set_epoch(e)`` (if it, or the sampler it batches, has one) is
called as its epoch ``e`` is drawn, which is a little before that epoch is trained on
(the loader draws indices ahead of the batches it hands out). Each epoch's batch lists are drawn whole first,
so a sampler whose order depends on the epoch still gives exactly that epoch's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Generic, TypeVar, cast

from torch.utils.data import Sampler

__all__ = ["EpochStream"]

T = TypeVar("T")


class EpochStream(Sampler[list[int]]):
    """A batch sampler that yields ``epochs`` epochs of ``batch_sampler`` in one pass.

    Use it as a ``DataLoader``'s batch sampler (or ``graph_loader``'s) and iterate the
    loader through ``epochs(loader)``, which splits the one stream back into epochs.

    Args:
        batch_sampler: yields lists of dataset indices; iterated once per epoch, after
            ``set_epoch(epoch)`` when it has that method (or else the sampler it
            batches has, as ``BatchSampler(DistributedSampler(...), n)``).
        epochs: how many epochs to chain.
        start_epoch: the first epoch's number (for a resumed run).

    Raises:
        ValueError: for a negative ``epochs``.

    Example:
        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> stream = EpochStream(BatchSampler(SequentialSampler(range(5)), 2, False), 2)
        >>> [list(batches) for batches in stream.epochs(iter(stream))]
        [[[0, 1], [2, 3], [4]], [[0, 1], [2, 3], [4]]]
    """

    def __init__(
        self, batch_sampler: Iterable[list[int]], epochs: int, *, start_epoch: int = 0
    ) -> None:
        if epochs < 0:
            raise ValueError(f"epochs must be at least 0, got {epochs}")
        self.batch_sampler = batch_sampler
        self.count = epochs
        self.start_epoch = start_epoch
        # Batches drawn per epoch, recorded as each epoch is drawn: what
        # ``epochs`` uses to cut the stream (a sampler may vary its length).
        self.drawn: dict[int, int] = {}

    def __len__(self) -> int:
        if not isinstance(self.batch_sampler, Sized):
            raise TypeError(
                f"{type(self.batch_sampler).__name__} has no len(), so neither has this EpochStream"
            )
        return self.count * len(self.batch_sampler)

    def __iter__(self) -> Iterator[list[int]]:
        self.drawn.clear()  # in place: a splitter may hold it
        set_epoch = _epoch_setter(self.batch_sampler)
        for epoch in range(self.start_epoch, self.start_epoch + self.count):
            if set_epoch is not None:
                set_epoch(epoch)
            batches = list(self.batch_sampler)
            self.drawn[epoch] = len(batches)
            yield from batches

    def epochs(self, stream: Iterable[T]) -> Iterator[Iterator[T]]:
        """Split ``stream`` (the loader over this sampler) into one iterator per epoch.

        Take each epoch's iterator in turn; an epoch left unfinished (``break``) has
        its remaining batches skipped when the next epoch is taken, so every epoch
        starts at its own first batch.

        Raises:
            RuntimeError: when ``stream`` ends before the epochs this sampler drew (it
                was not iterated over this sampler, or was iterated twice at once).
        """
        return _Splitter(self, iter(stream)).epochs()


def _epoch_setter(batch_sampler: object) -> Callable[[int], object] | None:
    """``set_epoch`` of the batch sampler, or of the sampler it batches
    (``BatchSampler(DistributedSampler(...), n)``), or None."""
    for holder in (batch_sampler, getattr(batch_sampler, "sampler", None)):
        set_epoch = getattr(holder, "set_epoch", None)
        if callable(set_epoch):
            return cast(Callable[[int], object], set_epoch)
    return None


class _Splitter(Generic[T]):
    """Cuts one iterator into per-epoch pieces by the sampler's recorded counts."""

    def __init__(self, sampler: EpochStream, stream: Iterator[T]) -> None:
        self.sampler = sampler
        self.stream = stream
        self.ahead: list[T] = []  # at most one item, read to learn an epoch's length

    def epochs(self) -> Iterator[Iterator[T]]:
        start = self.sampler.start_epoch
        for epoch in range(start, start + self.sampler.count):
            piece = self.epoch(epoch)
            yield piece
            for _ in piece:  # skip what an unfinished epoch left
                pass

    def epoch(self, epoch: int) -> Iterator[T]:
        drawn = self.sampler.drawn
        if epoch not in drawn:
            # The loader draws an epoch's indices only when it needs its first batch:
            # reading that batch makes the sampler record the epoch's length (and the
            # lengths of any empty epochs before it; the stream may also just end,
            # when every epoch left is empty).
            with contextlib.suppress(StopIteration):
                self.ahead.append(next(self.stream))
            if epoch not in drawn:
                raise RuntimeError(
                    f"EpochStream: batches of epoch {epoch} arrived before the sampler drew "
                    "that epoch; iterate the loader built on this EpochStream, once at a time"
                )
        for _ in range(drawn[epoch]):
            yield self.ahead.pop() if self.ahead else self.next(epoch)

    def next(self, epoch: int) -> T:
        try:
            return next(self.stream)
        except StopIteration:
            raise RuntimeError(
                f"EpochStream: the loader ended during epoch {epoch}, before every batch the "
                "sampler drew; iterate the loader built on this EpochStream, once at a time"
            ) from None
