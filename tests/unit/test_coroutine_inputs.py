"""run_all with groups on executor threads, and input tensors another group's examples
change in place while a step computes: a change before the step is handed to its
thread is refused (as with one group), one after it does not reach the step. Eagerly,
each call read the tensor as it was when its example recorded it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

import batchgraph as bg
import batchgraph.coroutines
from batchgraph.executor import Executor

double = bg.batched_func(torch.mul)
_TIMEOUT = 10.0  # only reached when the code under test is wrong


def _lanes_on_threads(overlap: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """"parallel" with two executor threads, however many cores this host has (the
    tests force their interleavings with events, not with timing)."""
    if overlap == "parallel":
        monkeypatch.setattr(batchgraph.coroutines, "_spare_threads", lambda lanes: 2)


async def _writer(shared: torch.Tensor, changed: threading.Event,
                  checked: threading.Event | None = None) -> float:
    """Lane 0: after its first step, change ``shared`` in place (the other lanes'
    steps, handed to their threads before, read it), then say so."""
    seen = float((await bg.value(double(torch.ones(2, dtype=torch.float64), 2.0))).sum())
    if checked is not None:
        assert checked.wait(_TIMEOUT), "the reader's step never checked its input"
    shared.add_(1.0)
    changed.set()
    return seen


async def _reader(shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = double(shared, 2.0)
    recorded = shared.clone()  # what the eager call read
    got: torch.Tensor = await bg.value(h)
    return got, recorded * 2.0


@pytest.mark.parametrize("overlap", ["thread", "parallel"])
def test_a_change_while_the_step_is_queued_does_not_reach_it(
    overlap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Four lanes, one example each, on at most two threads: lanes 1 and 2 hold the
    # threads until lane 0's example (resumed on the driver) has changed `shared`, so
    # lane 3's step, queued behind them, starts after the change. It read `shared`
    # then: ConstantChangedError, for a change made after lane 3's example recorded
    # and awaited, by another group, which one group never saw.
    _lanes_on_threads(overlap, monkeypatch)
    changed = threading.Event()

    def hold(x: torch.Tensor) -> torch.Tensor:
        if not is_fake(x):  # not while shapes are inferred
            assert changed.wait(_TIMEOUT), "lane 0 never changed the tensor"
        return x + 1

    held = bg.batched_func(hold)

    async def holder() -> float:
        return float((await bg.value(held(torch.zeros(2, dtype=torch.float64)))).sum())

    shared = torch.arange(3, dtype=torch.float64)
    results = bg.run_all([_writer(shared, changed), holder(), holder(), _reader(shared)],
                         groups=4, overlap=overlap)
    assert results[:3] == [4.0, 2.0, 2.0]
    got, want = results[3]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(shared, torch.arange(1, 4, dtype=torch.float64))


@pytest.mark.parametrize("overlap", ["thread", "parallel"])
def test_a_change_between_the_steps_check_and_read_does_not_reach_it(
    overlap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The step checks a tensor's version just before it reads it, on its thread: a
    # change landing between the two was read unseen (silently other values than the
    # eager call's). Here the reader's step is stopped right after the check until
    # the writer, resumed on the driver, has made its change.
    _lanes_on_threads(overlap, monkeypatch)
    changed, checked = threading.Event(), threading.Event()
    policies: list[bg.BatchingPolicy] = []

    def make_policy() -> bg.BatchingPolicy:
        policies.append(bg.BatchingPolicy())
        return policies[-1]

    check = Executor._check_unchanged

    def check_then_wait(self: Executor, nodes: list[int]) -> None:
        check(self, nodes)
        constants = self.graph.constants
        if (self.graph is policies[1].graph and not checked.is_set()
                and any(isinstance(constants[n], torch.Tensor) for n in nodes)):
            checked.set()
            assert changed.wait(_TIMEOUT), "the writer never changed the tensor"

    monkeypatch.setattr(Executor, "_check_unchanged", check_then_wait)
    shared = torch.arange(3, dtype=torch.float64)
    results: list[Any] = bg.run_all(
        [_writer(shared, changed, checked), _reader(shared)],
        groups=2, overlap=overlap, make_policy=make_policy,
    )
    assert checked.is_set() and results[0] == 4.0
    got, want = results[1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(("groups", "overlap"), [(1, "inline"), (2, "inline"),
                                                 (2, "thread"), (2, "parallel")])
def test_a_change_before_the_step_is_handed_over_is_refused(
    groups: int, overlap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Copying a step's inputs when it is handed to its thread must not hide a change
    # made before: by the example itself between recording and awaiting, or by
    # another group's example before the step was handed over (all groups record
    # before the first steps; with one group that change is refused too).
    _lanes_on_threads(overlap, monkeypatch)
    own, other = torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)

    async def changes_its_own() -> torch.Tensor:
        h = double(own, 2.0)
        own.add_(1.0)  # eagerly the call saw ones
        value: torch.Tensor = await bg.value(h)
        return value

    async def reads_other() -> torch.Tensor:
        value: torch.Tensor = await bg.value(double(other, 2.0))
        return value

    async def changes_other() -> None:
        other.add_(1.0)  # before reads_other's step (that group recorded first)
        await bg.value(double(torch.ones(2, dtype=torch.float64), 3.0))

    # With two groups, reads_other is the first group's, the others the second's.
    results = bg.run_all([reads_other(), changes_its_own(), changes_other()],
                         groups=groups, overlap=overlap, return_exceptions=True)
    for refused in results[:2]:
        assert isinstance(refused, bg.ConstantChangedError), refused
        assert "changed in place before it was computed" in str(refused)
    assert results[2] is None


@pytest.mark.parametrize("overlap", ["thread", "parallel"])
@pytest.mark.parametrize("inputs_in_inference", [True, False])
def test_steps_in_inference_mode_read_their_inputs(
    overlap: str, inputs_in_inference: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inference tensors keep no version counter (reading it raises), so nothing can
    # tell whether one changed: they are not copied. A plain tensor copied in
    # inference mode would become one: its copy is made outside it.
    _lanes_on_threads(overlap, monkeypatch)
    with torch.inference_mode(inputs_in_inference):
        xs = [torch.full((3,), float(i)) for i in range(4)]

    async def example(x: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = await bg.value(double(x, 2.0))
        return value

    with torch.inference_mode():
        got = bg.run_all([example(x) for x in xs], groups=2, overlap=overlap)
    for x, y in zip(xs, got, strict=True):
        torch.testing.assert_close(y, x * 2.0)
