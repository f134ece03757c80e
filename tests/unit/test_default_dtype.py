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
from batchgraph import rule_tokens

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


_ZEROS_PLUS = bg.batched_func(lambda x: x + torch.zeros(3))


def test_a_default_changed_and_changed_back_inside_the_block_is_refused_at_compute() -> None:
    # The calls under float64 are the first of their signatures (or of their keys
    # after a compute): eagerly float64, batched they would compute under float32.
    with bg.BatchingPolicy():
        torch.set_default_dtype(torch.float64)
        handles = [_ZEROS_PLUS(torch.ones(3, dtype=torch.float32) * i) for i in range(2)]
        assert all(h.dtype == torch.float64 for h in handles)  # as eagerly
        torch.set_default_dtype(torch.float32)
    with pytest.raises(bg.DefaultDtypeChangedError, match="float32 and float64"):
        bg.compute(handles)


def test_a_signature_resolved_under_a_default_changed_inside_a_block_is_not_kept_for_later_blocks(
) -> None:
    xs = [torch.ones(3) * i for i in range(2)]  # float32, made before the change

    def record() -> list[Any]:
        return [_ZEROS_PLUS(x) for x in xs]

    with bg.BatchingPolicy():
        torch.set_default_dtype(torch.float64)
        record()
        torch.set_default_dtype(torch.float32)
    # A later block wholly under float32 computes as eagerly (it reused the float64
    # spec, and failed with a BatchedCallError blaming the batching rule).
    with bg.BatchingPolicy():
        handles = record()
    assert all(h.dtype == torch.float32 for h in handles)
    for x, value in zip(xs, bg.compute(handles), strict=True):
        torch.testing.assert_close(value, x + torch.zeros(3), rtol=0, atol=0)


def test_a_default_changed_before_a_key_s_first_call_after_a_compute_is_refused() -> None:
    x = torch.ones(3)
    with bg.BatchingPolicy() as policy:
        first = _ZEROS_PLUS(x)
    policy.compute(first)  # a new stamp: the next call of the key is rechecked
    with policy:
        torch.set_default_dtype(torch.float64)
        second = _ZEROS_PLUS(x * 2)
        torch.set_default_dtype(torch.float32)
    with pytest.raises(bg.DefaultDtypeChangedError, match="float32 and float64"):
        policy.compute(second)


@pytest.mark.parametrize("default", [torch.float64, torch.float16])
def test_policies_with_rules_made_per_batch_leave_nothing_behind(default: torch.dtype) -> None:
    # Before, each policy with rules entered under a default other than float32 left
    # its (rules, dtype) token in a global table for good: one entry per batch.
    torch.set_default_dtype(default)
    rules = {torch.nn.Linear: bg.VmapKey}
    before = len(rule_tokens._TABLES)
    for _ in range(30):
        policy = bg.BatchingPolicy(rules=rules)
        with policy:
            handles = [_int_times_float(bg.batched_value(x)) for x in _INPUTS]
        token = policy.rules_token
        with policy:  # entered again: the same token, its signatures cached still
            assert policy.rules_token == token
        for got, x in zip(bg.compute(handles), _INPUTS):
            assert torch.equal(got, x * 2.5) and got.dtype == default  # as eagerly
    assert len(rule_tokens._TABLES) <= before + 1  # this table's, not one per policy
