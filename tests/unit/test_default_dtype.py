"""Calls recorded under a default dtype (``torch.set_default_dtype``) keep its dtypes.

Before: call signatures were cached whatever the default dtype, so after a policy
under float32 one under float64 reused float32 specs (``int_h * 2.5``, a function
making ``torch.arange(3.0)``), and its compute failed with ``BatchedCallError``
("its batching rule does not keep each example's type promotion"), advising another
rule; calls recorded under float64 and computed under float32 failed likewise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import batchgraph as bg

# Made once: their call sites keep their caches from one test (and policy) to the next.
_RANGE_PLUS = bg.batched_func(lambda x: x + torch.arange(3.0))


def _int_times_float(i: Any) -> Any:
    return i * 2.5


def _int_true_div(i: Any) -> Any:
    return i / 3


def _plus_range(i: Any) -> Any:
    return _RANGE_PLUS(i * 1)


_PROGRAMS = [_int_times_float, _int_true_div, _plus_range]
_INPUTS = [torch.tensor(v) for v in (1, 2, 7)]


@pytest.fixture(autouse=True)
def _restore_default() -> Iterator[None]:
    before = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _run(program: Callable[[Any], Any]) -> list[torch.Tensor]:
    with bg.BatchingPolicy():
        handles = [program(bg.batched_value(x)) for x in _INPUTS]
    return bg.compute(handles)  # type: ignore[no-any-return]


@pytest.mark.parametrize("program", _PROGRAMS)
@pytest.mark.parametrize("default", [torch.float64, torch.float16, torch.bfloat16])
def test_a_policy_under_another_default_dtype_gives_its_eager_dtypes(
    program: Callable[[Any], Any], default: torch.dtype
) -> None:
    first = _run(program)  # caches the signatures under float32
    assert all(t.dtype == torch.float32 for t in first)
    torch.set_default_dtype(default)
    got = _run(program)
    for x, value in zip(_INPUTS, got, strict=True):
        want = program(x)
        assert value.dtype == want.dtype == default
        torch.testing.assert_close(value, want, rtol=0, atol=0)
    torch.set_default_dtype(torch.float32)
    for x, value in zip(_INPUTS, _run(program), strict=True):  # and back again
        torch.testing.assert_close(value, program(x), rtol=0, atol=0)


@pytest.mark.parametrize("program", _PROGRAMS)
def test_calls_computed_under_another_default_dtype_are_refused(
    program: Callable[[Any], Any],
) -> None:
    torch.set_default_dtype(torch.float64)
    with bg.BatchingPolicy():
        handles = [program(bg.batched_value(x)) for x in _INPUTS]
    want = [program(x) for x in _INPUTS]
    torch.set_default_dtype(torch.float32)
    with pytest.raises(bg.DefaultDtypeChangedError, match="recorded under the default dtype"):
        bg.compute(handles)
    torch.set_default_dtype(torch.float64)  # put back: the same handles compute
    for value, expected in zip(bg.compute(handles), want, strict=True):
        assert value.dtype == expected.dtype == torch.float64
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_a_default_changed_inside_the_block_is_refused_at_compute() -> None:
    with bg.BatchingPolicy():
        a = _int_times_float(bg.batched_value(torch.tensor(1)))
        torch.set_default_dtype(torch.float64)
        b = _int_times_float(bg.batched_value(torch.tensor(2)))
    with pytest.raises(bg.DefaultDtypeChangedError, match="float32 and float64"):
        bg.compute([a, b])
