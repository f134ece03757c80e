"""Handles an example returns unawaited are computed by its driver; when that compute
fails, the example gets the call's own error."""

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
