"""Coroutine examples: bg.value, await h, run_all, groups, error isolation, deadlocks."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

import batchgraph as bg
from batchgraph.recording import active_policy
from batchgraph.threads import usable_cores
from tests.property.decoder_models import Decoder, make_decoder, run_eagerly

STATES = [torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i in range(7)]


def test_value_of_a_tensor_finishes_at_once_so_examples_run_under_asyncio() -> None:
    model = make_decoder(0)
    eager = [run_eagerly(model.greedy(h, 3, 8)) for h in STATES]
    assert [asyncio.run(model.greedy(h, 3, 8)) for h in STATES] == eager


def test_run_all_equals_the_eager_run_and_takes_one_step_per_round() -> None:
    model = make_decoder(1)
    free = [run_eagerly(model.greedy(h, -1, 9)) for h in STATES]  # never stops early
    stops = [seq[i % len(seq)] for i, seq in enumerate(free)]
    eager = [run_eagerly(model.greedy(h, s, 9)) for h, s in zip(STATES, stops)]
    assert len({len(t) for t in eager}) > 1, "examples should stop at different lengths"
    policies: list[bg.BatchingPolicy] = []

    def make() -> bg.BatchingPolicy:
        policies.append(bg.BatchingPolicy())
        return policies[0]

    got = bg.run_all([model.greedy(h, s, 9) for h, s in zip(STATES, stops)], make_policy=make)
    assert got == eager
    # One compute per await of the longest example: all waiting examples share each step.
    assert policies[0].computes == max(min(len(t) + 1, 9) for t in eager)
    assert not policies[0].recording  # closed once run_all returns


def test_await_handle_directly_and_returned_handles_are_computed() -> None:
    lin = bg.batched_func(nn.Linear(3, 2).double())

    async def example(x: torch.Tensor) -> tuple[float, Any]:
        first = await lin(x)  # `await h` is `await bg.value(h)`
        return float(first.detach().sum()), lin(x * 2)  # the second handle is never awaited

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    got = bg.run_all([example(x) for x in xs])
    for x, (total, second) in zip(xs, got):
        assert total == pytest.approx(float(lin(x).detach().sum()))
        assert isinstance(second, torch.Tensor)
        torch.testing.assert_close(second, lin(x * 2))


def test_value_accepts_nested_structures() -> None:
    lin = bg.batched_func(nn.Linear(2, 2).double())

    async def example(x: torch.Tensor) -> dict[str, Any]:
        pair = await bg.value({"a": lin(x), "b": [x, lin(x + 1)], "n": 3})
        return pair

    x = torch.ones(2, dtype=torch.float64)
    [got] = bg.run_all([example(x)])
    torch.testing.assert_close(got["b"][1], lin(x + 1))
    assert got["n"] == 3 and got["b"][0] is x


@pytest.mark.parametrize("overlap", ["auto", "thread", "inline", "parallel"])
@pytest.mark.parametrize("groups", [2, 3, 7])
def test_groups_give_identical_results(groups: int, overlap: str) -> None:
    model = make_decoder(2)
    stops = [seq[i % len(seq)] for i, seq in enumerate(
        run_eagerly(model.greedy(h, -1, 10)) for h in STATES)]
    one = bg.run_all([model.greedy(h, s, 10) for h, s in zip(STATES, stops)])
    many = bg.run_all([model.greedy(h, s, 10) for h, s in zip(STATES, stops)], groups=groups,
                      overlap=overlap)
    assert many == one


def test_a_lane_that_records_cpu_tensors_takes_turns_on_a_thread() -> None:
    from batchgraph.stepping import Lane

    lane = Lane(bg.BatchingPolicy(), [])
    with lane.policy:
        bg.batched_func(torch.tanh)(torch.zeros(3))
    assert not lane.records_on_cuda()


def test_an_unknown_overlap_is_refused() -> None:
    with pytest.raises(ValueError, match="overlap must be one of"):
        bg.run_all([], groups=2, overlap="threads")


class _Probe(nn.Module):
    """Notes the thread each batched call runs on and whether a policy was active."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.seen: list[tuple[int, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fake(x):  # recording runs the call once on fake tensors to infer shapes
            self.seen.append((threading.get_ident(), active_policy() is not None))
        return self.lin(x)


def test_groups_compute_on_an_executor_thread_with_no_policy_active() -> None:
    probe = _Probe()
    f = bg.batched_func(probe)
    recorded_on: set[int] = set()

    async def example(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            recorded_on.add(threading.get_ident())
            assert active_policy() is not None
            x = await bg.value(f(x))
        return x

    xs = [torch.randn(4, dtype=torch.float64) for _ in range(6)]
    bg.run_all([example(x) for x in xs], groups=2, overlap="thread")
    assert recorded_on == {threading.get_ident()}
    assert all(not active for _, active in probe.seen)
    assert {tid for tid, _ in probe.seen} != {threading.get_ident()}
    assert len(probe.seen) == 6  # 2 lanes x 3 steps, one batched call each
    probe.seen.clear()
    bg.run_all([example(x) for x in xs], groups=2, overlap="inline")
    assert {tid for tid, _ in probe.seen} == {threading.get_ident()}
    assert all(not active for _, active in probe.seen) and len(probe.seen) == 6


class _Rendezvous(nn.Module):
    """A batched call that waits (GIL released) until ``parties`` calls are inside it
    at once: it only gets through when lanes compute at the same time."""

    def __init__(self, parties: int, timeout: float) -> None:
        super().__init__()
        self.barrier = threading.Barrier(parties, timeout=timeout)
        self.threads: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fake(x):
            self.threads.add(threading.get_ident())
            self.barrier.wait()
        return x * 2


@pytest.fixture
def one_intra_op_thread() -> Generator[None, None, None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


async def _meet_three_times(meet: Any, x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = await bg.value(meet(x))
    return x


@pytest.mark.skipif(usable_cores() < 2, reason="lanes compute at the same time only with 2+ cores")
@pytest.mark.usefixtures("one_intra_op_thread")
def test_parallel_lanes_compute_at_the_same_time_on_threads_of_their_own() -> None:
    rendezvous = _Rendezvous(2, timeout=10)
    meet = bg.batched_func(rendezvous)
    xs = [torch.full((2,), float(i)) for i in range(4)]
    got = bg.run_all([_meet_three_times(meet, x) for x in xs], groups=2, overlap="parallel")
    for x, y in zip(xs, got):
        torch.testing.assert_close(y, x * 8)
    assert len(rendezvous.threads) == 2 and threading.get_ident() not in rendezvous.threads


@pytest.mark.usefixtures("one_intra_op_thread")
def test_lanes_on_one_executor_thread_take_turns() -> None:
    # The counterpart: served in turn, the first call waits for a second that never
    # comes, the barrier breaks, and every example fails with it.
    meet = bg.batched_func(_Rendezvous(2, timeout=0.2))
    xs = [torch.full((2,), float(i)) for i in range(4)]
    got = bg.run_all([_meet_three_times(meet, x) for x in xs], groups=2, overlap="thread",
                     return_exceptions=True)
    assert all(isinstance(g, bg.BatchedCallError) for g in got)


class _Slow(nn.Module):
    """A batched call whose execution (a GIL-free wait) outweighs any Python around it."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_fake(x):
            self.threads.append(threading.get_ident())
            time.sleep(0.02)
        return x + 1


@pytest.mark.skipif(usable_cores() < 2, reason="auto goes parallel only with 2+ cores")
@pytest.mark.usefixtures("one_intra_op_thread")
def test_auto_measures_the_first_steps_and_chooses_parallel_when_execution_dominates() -> None:
    slow = _Slow()
    step = bg.batched_func(slow)
    xs = [torch.zeros(2) for _ in range(4)]
    got = bg.run_all([_meet_three_times(step, x) for x in xs], groups=2)
    assert all(float(y.sum()) == 6.0 for y in got)
    main = threading.get_ident()
    # Two lanes x three steps: the first two steps of each lane are measured inline.
    assert slow.threads[:4] == [main] * 4
    assert main not in slow.threads[4:] and len(slow.threads) == 6


@pytest.mark.usefixtures("one_intra_op_thread")
def test_auto_stays_inline_when_python_dominates() -> None:
    probe = _Probe()
    f = bg.batched_func(probe)

    async def example(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            # Much Python per step, one tiny batched call: ~5 ms a lane's step, so that
            # another process's time slice, taken during a measured call, cannot
            # outweigh it (with 100, 2 of 100 runs went parallel on a loaded host).
            for _ in range(1000):
                x = x + 0
            x = await bg.value(f(x))
        return x

    bg.run_all([example(torch.randn(4, dtype=torch.float64)) for _ in range(6)], groups=2)
    assert {tid for tid, _ in probe.seen} == {threading.get_ident()}


@pytest.mark.parametrize(("groups", "overlap"), [(1, "auto"), (2, "auto"), (2, "inline"),
                                               (2, "thread"), (2, "parallel")])
def test_gradients_flow_and_grad_mode_reaches_the_executor_thread(
    groups: int, overlap: str
) -> None:
    model = make_decoder(3)

    async def loss(h: torch.Tensor) -> Any:
        out = model.out(model.cell(model.embed(bg.batched_value(1)), h))
        await bg.value(out)
        return out.sum()

    eager = torch.stack([run_eagerly(loss(h)) for h in STATES]).sum()
    (want,) = torch.autograd.grad(eager, model.out.weight)
    got = torch.stack(bg.run_all([loss(h) for h in STATES], groups=groups,
                                 overlap=overlap)).sum()
    (have,) = torch.autograd.grad(got, model.out.weight)
    torch.testing.assert_close(have, want)
    with torch.no_grad():
        values = bg.run_all([loss(h) for h in STATES], groups=groups, overlap=overlap)
    assert not any(v.requires_grad for v in values)


class _Oops(ValueError):
    pass


def test_an_example_that_raises_fails_alone() -> None:
    model = make_decoder(4)

    async def example(i: int) -> list[int]:
        tokens = await model.greedy(STATES[i], 99, 5)
        if i == 2:
            raise _Oops(f"bad input {i}")
        return tokens

    want = [run_eagerly(model.greedy(STATES[i], 99, 5)) for i in range(5)]
    got = bg.run_all([example(i) for i in range(5)], return_exceptions=True)
    assert isinstance(got[2], _Oops)
    assert [g for i, g in enumerate(got) if i != 2] == [w for i, w in enumerate(want) if i != 2]
    with pytest.raises(bg.CoroutineExampleError, match=r"example 2 of 5 raised _Oops: bad input 2") as info:
        bg.run_all([example(i) for i in range(5)])
    assert info.value.index == 2 and isinstance(info.value.__cause__, _Oops)
    assert info.value.results[4] == want[4]


def test_a_failing_batched_call_fails_only_its_example() -> None:
    embed = bg.batched_func(nn.Embedding(10, 3).double())

    async def example(token: int) -> torch.Tensor:
        first = await bg.value(embed(bg.batched_value(1)))
        second = await bg.value(embed(bg.batched_value(token)))  # 50 is out of range
        return first + second

    got = bg.run_all([example(t) for t in (2, 50, 3)], return_exceptions=True)
    assert isinstance(got[1], bg.BatchedCallError)
    torch.testing.assert_close(got[0], embed(torch.tensor(1)) + embed(torch.tensor(2)))
    torch.testing.assert_close(got[2], embed(torch.tensor(1)) + embed(torch.tensor(3)))



@pytest.mark.parametrize("groups", [1, 2])
def test_a_failing_batched_call_names_its_run_all_example(groups: int) -> None:
    # The failing call is found by computing each example alone; its error used to
    # number examples within that compute, so it always blamed "example 0".
    embed = bg.batched_func(nn.Embedding(5, 3))

    async def example(i: int) -> Any:
        fine = embed(bg.batched_value(0))
        token = embed(bg.batched_value(i * 2))  # only example 3's token (6) is out of range
        return await bg.value((fine, token))

    got = bg.run_all([example(i) for i in range(4)], groups=groups, return_exceptions=True)
    assert [isinstance(g, bg.BatchedCallError) for g in got] == [False, False, False, True]
    assert "example 3" in str(got[3])
    assert not re.search(r"\bexamples? [0-2]\b", str(got[3])), str(got[3])
    with pytest.raises(bg.CoroutineExampleError) as info:
        bg.run_all([example(i) for i in range(4)], groups=groups)
    assert info.value.index == 3 and isinstance(info.value.__cause__, bg.BatchedCallError)
    message = str(info.value)
    assert message.startswith("example 3 of 4 raised BatchedCallError")
    assert not re.search(r"\bexamples? [0-2]\b", message), message

class _Foreign:
    def __await__(self) -> Generator[str, None, None]:
        yield "a future from somewhere else"


def test_awaiting_something_that_is_not_a_handle_is_reported_not_hung() -> None:
    lin = bg.batched_func(nn.Linear(2, 2))

    async def example(i: int) -> int:
        await bg.value(lin(torch.ones(2)))
        if i == 1:
            await _Foreign()
        if i == 2:
            await asyncio.sleep(0)  # yields None to its driver
        return i

    got = bg.run_all([example(i) for i in range(4)], return_exceptions=True)
    assert got[0] == 0 and got[3] == 3
    assert isinstance(got[1], bg.UnsupportedAwaitError)
    assert "example 1 awaited 'a future from somewhere else'" in str(got[1])
    assert isinstance(got[2], TypeError) and "example 2 awaited None" in str(got[2])


def test_awaiting_a_handle_the_driver_cannot_compute_names_the_example() -> None:
    lin = bg.batched_func(nn.Linear(2, 2))
    with bg.BatchingPolicy(name="outer"):
        outside = lin(torch.ones(2))

    async def example(i: int) -> Any:
        return await bg.value(outside) if i == 1 else i

    with pytest.raises(bg.CoroutineExampleError, match=r"example 1 of 2 raised PolicyMismatchError: "
                       r"example 1 awaits .*outside its own policy"):
        bg.run_all([example(i) for i in range(2)])


def test_a_coroutine_that_never_finishes_hits_max_steps() -> None:
    double = bg.batched_func(torch.mul)

    async def forever(x: torch.Tensor) -> None:
        while True:
            x = await bg.value(double(x, 1.5))  # new values: never merged with old calls

    async def short(x: torch.Tensor) -> float:
        return float((await bg.value(double(x, 2.0))).sum())

    got = bg.run_all([short(torch.ones(2)), forever(torch.ones(2))], return_exceptions=True,
                     max_steps=50)
    assert got[0] == 4.0
    assert isinstance(got[1], bg.DeadlockError)
    assert "example 1 is still running after 50 awaits" in str(got[1])


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"example 1 is list, not a coroutine"):
        bg.run_all([asyncio.sleep(0), [1]])  # type: ignore[list-item]
    with pytest.raises(bg.UnsupportedAwaitError, match=r"got int"):
        bg.value(3)
    with bg.BatchingPolicy():
        h = bg.batched_func(torch.tanh)(torch.zeros(2))
    with pytest.raises(bg.NotComputedError, match=r"outside a batchgraph driver"):
        run_eagerly(_await(h))
    assert bg.run_all([]) == []


async def _await(h: Any) -> Any:
    return await bg.value(h)


def test_decoder_state_handle_in_the_result() -> None:
    model: Decoder = make_decoder(5)
    got = bg.run_all([model.greedy_with_state(h, 2, 6) for h in STATES[:3]])
    for h, (tokens, state) in zip(STATES, got):
        want_tokens, want_state = run_eagerly(model.greedy_with_state(h, 2, 6))
        assert tokens == want_tokens
        torch.testing.assert_close(state, want_state)


@pytest.mark.parametrize("groups", [1, 2])
def test_examples_sharing_handles_work_in_one_group_and_say_why_not_across_groups(
    groups: int,
) -> None:
    # A cache of handles shared by examples (one encoding per source): one group records
    # every example into one policy, so it works and equals eager; examples in another
    # group's policy get an error whose note says what to do instead.
    lin = bg.batched_func(nn.Linear(2, 2))
    cache: dict[int, Any] = {}

    async def example(i: int) -> Any:
        if i % 2 not in cache:
            cache[i % 2] = lin(torch.full((2,), float(i % 2)))
        return await bg.value(lin(cache[i % 2]))

    eager = [lin.__wrapped__(lin.__wrapped__(torch.full((2,), float(i % 2)))) for i in range(4)]
    if groups == 1:
        got = bg.run_all([example(i) for i in range(4)])
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e)
        return
    got = bg.run_all([example(i) for i in range(4)], groups=2, return_exceptions=True)
    for g, e in zip(got[:2], eager[:2]):
        torch.testing.assert_close(g, e)
    for err in got[2:]:
        assert isinstance(err, bg.PolicyMismatchError)
        assert any("group of run_all(groups=k)" in n and "share computed tensors" in n
                   for n in err.__notes__)


def test_awaiting_another_groups_handle_says_why_in_a_note() -> None:
    lin = bg.batched_func(nn.Linear(2, 2))
    shared: list[Any] = []

    async def example(i: int) -> Any:
        if i == 0:
            shared.append(lin(torch.ones(2)))
            return await bg.value(shared[0])
        # Lanes start in order: example 0 has recorded, nothing is computed yet.
        return await bg.value(shared[0])

    got = bg.run_all([example(i) for i in range(2)], groups=2, return_exceptions=True)
    assert isinstance(got[0], torch.Tensor)
    assert isinstance(got[1], bg.PolicyMismatchError)
    assert "example 1 awaits" in str(got[1])
    assert any("records into a policy of its own" in n for n in got[1].__notes__)


# run_all's lanes computing at the same time draw random numbers in a fixed order.
# With overlap="parallel" (which "auto" picks on the CPU when execution dominates) two
# lanes' steps ran on two threads at once and drew from the one global generator as
# the threads happened to run: under a fixed seed, dropout masks and samples changed
# from run to run, and differed from the inline and one-thread runs.


class _Noisy(nn.Module):
    """Two draws with a GIL-free wait between them: steps of two lanes at the same
    time interleave their draws."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.rand_like(x)
        if not is_fake(x):
            time.sleep(0.02)
        return x + first * torch.rand_like(x)


async def _walk(noisy: bg.BatchedModule | nn.Module, x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = await bg.value(noisy(x))
    return x


def _run(overlap: str) -> torch.Tensor:
    noisy = bg.batched_func(_Noisy())
    torch.manual_seed(0)
    xs = [torch.zeros(4) for _ in range(4)]
    return torch.stack(bg.run_all([_walk(noisy, x) for x in xs], groups=2, overlap=overlap))


@pytest.mark.skipif(usable_cores() < 2, reason="lanes compute at the same time only with 2+ cores")
@pytest.mark.usefixtures("one_intra_op_thread")
def test_parallel_lanes_draw_as_inline_lanes_under_a_fixed_seed() -> None:
    inline = _run("inline")
    assert torch.equal(_run("thread"), inline)
    assert torch.equal(_run("parallel"), inline)
    assert torch.equal(_run("parallel"), inline)
