"""Recording in real DataLoader worker processes: same results, errors surface, nothing hangs."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import batchgraph as bg
from tests.property.models import TreeModel
from tests.unit.schedules import same_schedule

pytestmark = pytest.mark.multiprocess

LIMIT_S = 45  # no test here may take longer: a hang fails instead of blocking CI


@pytest.fixture(autouse=True)
def _deadline() -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"test ran past {LIMIT_S}s: something hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def random_trees(n: int, seed: int) -> list[tuple[Any, int]]:
    rng = random.Random(seed)

    def tree(leaves: int) -> Any:
        if leaves == 1:
            return rng.randrange(20)
        k = rng.randint(1, leaves - 1)
        return (tree(k), tree(leaves - k))

    return [(tree(rng.randint(1, 9)), rng.randrange(3)) for _ in range(n)]


def logits(model: Any, item: tuple[Any, int]) -> Any:
    return model.logits(item[0])


def explode_on_99(model: Any, item: tuple[Any, int]) -> Any:
    if item[0] == 99:
        raise ValueError("leaf 99 is out of range")
    return model.logits(item[0])


def die_on_99(model: Any, item: tuple[Any, int]) -> Any:
    if item[0] == 99:
        os._exit(3)  # a worker killed mid-batch (OOM killer, segfault...)
    return model.logits(item[0])


def loss_of(logits_batch: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits_batch, labels, reduction="sum")


def test_worker_path_equals_in_process_schedules_outputs_and_gradients() -> None:
    data = random_trees(24, seed=1)
    model = TreeModel().double()
    sampler = [list(range(i, i + 8)) for i in range(0, 24, 8)]
    expected = []
    for indices in sampler:
        with bg.BatchingPolicy() as policy:
            hs = [model.logits(data[i][0]) for i in indices]
        out = torch.stack(policy.compute(hs))
        labels = torch.tensor([data[i][1] for i in indices])
        model.zero_grad()
        loss_of(out, labels).backward()
        expected.append((policy.last_schedule, out, [p.grad.clone() for p in model.parameters()]))
    collate = bg.GraphCollate(model, logits, target=1)
    loader = bg.graph_loader(data, collate, sampler, num_workers=1, timeout=30)
    binder = bg.Binder(model)
    batches = 0
    for batch, (schedule, out, grads) in zip(loader, expected):
        assert same_schedule(batch.schedule, schedule)
        got = binder.run(batch, stack=True)
        assert torch.equal(got, out)
        model.zero_grad()
        loss_of(got, batch.targets).backward()
        for g, p in zip(grads, model.parameters()):
            assert p.grad is not None and torch.equal(g, p.grad)
        batches += 1
    assert batches == 3 and binder.stats.examples == 24


def test_plain_collate_fn_with_two_workers() -> None:
    data = random_trees(32, seed=2)
    model = TreeModel()
    loader = DataLoader(
        data, batch_size=8, collate_fn=bg.GraphCollate(model, logits, target=1), num_workers=2
    )
    labels = [y for batch in loader for y in bg.bind(batch, model, stack=True).argmax(1)]
    assert len(labels) == 32


def test_repeated_structures_hit_the_worker_cache_across_epochs() -> None:
    data = random_trees(24, seed=3)
    model = TreeModel()
    sampler = bg.BucketBatchSampler([0] * 24, 6, shuffle=False)  # the same batches each epoch
    loader = bg.graph_loader(
        data, bg.GraphCollate(model, logits), sampler, num_workers=1, persistent_workers=True
    )
    binder = bg.Binder(model)
    hits = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch, indices in zip(loader, sampler.batches(epoch), strict=True):
            assert batch.indices == indices  # the loader yields the sampler's epoch
            binder.run(batch)
            hits.append(batch.cache_hit)
    assert hits == [False] * 4 + [True] * 4
    assert binder.stats.cache_hits == 4 and binder.stats.keys_checked == 5


def test_epoch_stream_through_a_worker_gives_every_epoch_its_own_batches() -> None:
    data = random_trees(30, seed=5)
    model = TreeModel()
    sampler = bg.BucketBatchSampler([1 + i % 7 for i in range(30)], 8, pool=2, seed=9)
    stream = bg.EpochStream(sampler, 3)
    loader = bg.graph_loader(data, bg.GraphCollate(model, logits), stream, num_workers=1,
                             timeout=30)
    binder = bg.Binder(model)
    for epoch, batches in enumerate(stream.epochs(loader)):
        indices = []
        for batch in batches:
            indices.append(batch.indices)
            assert binder.run(batch, stack=True).shape[0] == len(batch.indices)
        assert indices == sampler.batches(epoch)  # that epoch's order, nothing else
        assert sorted(i for batch in indices for i in batch) == list(range(30))
    assert binder.stats.examples == 90


def test_failing_example_reaches_the_main_process_with_index_and_traceback() -> None:
    data = random_trees(12, seed=4)
    data[7] = (99, 0)
    loader = bg.graph_loader(
        data, bg.GraphCollate(TreeModel(), explode_on_99), [[5, 6, 7, 8]], num_workers=1
    )
    with pytest.raises(
        bg.ExampleError,
        match=r"(?s)DataLoader worker process 0.*example 2 of the batch \(dataset index 7\) "
        r"raised ValueError: leaf 99 is out of range.*Original traceback.*in explode_on_99",
    ):
        next(iter(loader))


def test_skip_errors_counts_skipped_examples_through_workers() -> None:
    data = random_trees(12, seed=5)
    data[2] = data[9] = (99, 0)
    model = TreeModel()
    collate = bg.GraphCollate(model, explode_on_99, target=1, skip_errors=True)
    loader = bg.graph_loader(data, collate, [[0, 1, 2, 3], [8, 9, 10, 11]], num_workers=1)
    binder = bg.Binder(model)
    for batch in loader:
        assert len(binder.run(batch, stack=True)) == len(batch.targets) == 3
    assert (binder.stats.examples, binder.stats.skipped) == (6, 2)


def test_dead_worker_surfaces_and_nothing_hangs() -> None:
    data = random_trees(12, seed=6)
    data[4] = (99, 0)
    loader = bg.graph_loader(
        data, bg.GraphCollate(TreeModel(), die_on_99), [[0, 1], [4, 5], [6, 7]],
        num_workers=1, timeout=20,
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid.*\) exited unexpectedly"):
        for _ in loader:
            pass
    assert time.monotonic() - start < 20


def test_model_tensors_used_directly_and_no_grad_regions_through_a_worker() -> None:
    # Parameters and buffers the per-example code uses itself, and a no_grad region,
    # through a real worker process (the batch is pickled): outputs and gradients equal
    # eager ones.
    from tests.unit.test_portable_live_model import ITEMS, Decoder

    torch.manual_seed(7)
    model = Decoder()

    def frozen_cell(m: Decoder, xs: list[list[float]]) -> Any:
        with torch.no_grad():
            start = m.cell(bg.batched_value(torch.tensor(xs[0], dtype=torch.float64)), m.h0)
        return m.decode(xs) + start * m.scale

    data = ITEMS * 2
    loader = bg.graph_loader(data, bg.GraphCollate(model, frozen_cell), [[0, 1, 2], [3, 4, 5]],
                             num_workers=1, persistent_workers=True, timeout=30)
    seen = []
    for batch in loader:
        seen.append(batch.indices)
        model.zero_grad()
        bound = bg.bind(batch, model, stack=True)
        # Weighted: under a plain sum, gradients sent to another example's rows match.
        weights = torch.rand(bound.shape, generator=torch.Generator().manual_seed(1),
                             dtype=bound.dtype)
        (bound * weights).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        eager = torch.stack([frozen_cell(model, data[i]) for i in batch.indices])
        (eager * weights).sum().backward()
        torch.testing.assert_close(bound, eager, rtol=0, atol=1e-12)
        for g, p in zip(got, model.parameters()):
            assert p.grad is not None
            torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-12)
    assert seen == [[0, 1, 2], [3, 4, 5]]  # the checks above ran, once per batch
