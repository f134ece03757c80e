"""Handles an example returns unawaited are computed by its driver; when that compute
fails, the example gets the call's own error. The rest of a result comes back as it
was returned."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg


def _refuse_negative(x: torch.Tensor) -> torch.Tensor:
    if (x < 0).any():  # value-dependent Python: each call runs on its own
        raise ValueError("negative input")
    return x * 2


refuse_negative = bg.batched_func(_refuse_negative)


async def _returns_unawaited(v: float) -> torch.Tensor:
    return refuse_negative(torch.tensor(v, dtype=torch.float64))  # type: ignore[no-any-return]


@settings(max_examples=10)
@given(values=st.lists(st.floats(-4, 4, allow_nan=False), min_size=1, max_size=5),
       groups=st.integers(1, 2))
def test_a_failing_returned_handle_fails_its_example_with_the_calls_error(
    values: list[float], groups: int,
) -> None:
    # The error was thrown into the finished coroutine, which raised "cannot reuse
    # already awaited coroutine" in its place.
    got = bg.run_all([_returns_unawaited(v) for v in values], groups=groups,
                     return_exceptions=True)
    for v, result in zip(values, got):
        if v < 0:
            assert isinstance(result, bg.BatchedCallError), result
            assert "ValueError: negative input" in str(result)
        else:
            assert torch.equal(result, torch.tensor(v * 2, dtype=torch.float64))


class _Pair(tuple):  # type: ignore[type-arg]
    """A tuple subclass that is neither a namedtuple nor a structseq."""


def test_tuples_without_handles_in_a_result_come_back_as_they_are() -> None:
    """Before: a ``torch.Size`` in an example's result came back a plain tuple (its
    ``numel()`` gone), as did any such tuple subclass, whether the result held
    handles (computed with the last step) or not."""
    tanh = bg.batched_func(torch.tanh)
    pair = _Pair((1, 2))

    async def example(x: torch.Tensor, with_handle: bool) -> tuple[object, ...]:
        value = await bg.value(tanh(x))
        shape = value.shape
        return (shape, pair, tanh(x + 1)) if with_handle else (shape, pair)  # not merged

    xs = [torch.zeros(2, 3), torch.ones(2, 3)]
    for with_handle in (False, True):
        got = bg.run_all([example(x, with_handle) for x in xs])
        for x, result in zip(xs, got):
            shape, same = result[:2]
            assert type(shape) is torch.Size and shape.numel() == 6
            assert same is pair
            if with_handle:
                torch.testing.assert_close(result[2], torch.tanh(x + 1))


def test_returning_another_groups_handle_says_why() -> None:
    """Before: NotComputedError ("call bg.compute(...) on it"), though nothing the
    caller could do would compute it, and not a word about groups (with one group
    the same examples work: the handle is computed with the result)."""
    tanh = bg.batched_func(torch.tanh)
    cache: dict[str, object] = {}

    async def example(i: int) -> object:
        if i == 0:  # group 0 records the handle and never awaits it
            cache["h"] = tanh(torch.ones(2))
            await bg.value(tanh(torch.zeros(2)))
            return 0
        await bg.value(tanh(torch.full((2,), float(i))))
        return cache["h"]  # group 1 returns it

    got = bg.run_all([example(i) for i in range(2)])
    torch.testing.assert_close(got[1], torch.tanh(torch.ones(2)))
    cache.clear()
    got = bg.run_all([example(i) for i in range(2)], groups=2, return_exceptions=True)
    assert isinstance(got[1], bg.PolicyMismatchError)
    assert "example 1 returned" in str(got[1]) and "outside its own policy" in str(got[1])
    assert any("Each group of run_all" in note for note in got[1].__notes__)
