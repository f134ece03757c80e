"""A call batched through vmap computes in the dtypes its eager run computes in.

Before: ``torch.addcmul``/``addcdiv`` with a 0-d input of a wider dtype failed at
``compute`` (vmap gave the batch that dtype; a recorded function computed in it and
returned other values, silently); under CPU autocast ``torch.mv``, ``torch.dot`` and
``torch.addmv`` computed in bfloat16 where eager code computes in float32 (autocast
acts on the matrix products their batching rules make), their float32 results off
by bfloat16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg

BF16 = torch.bfloat16


def _batched(fn: Callable[..., Any], examples: Sequence[tuple[torch.Tensor, ...]]) -> Any:
    with bg.BatchingPolicy() as policy:
        handles = [fn(*(bg.batched_value(x) for x in example)) for example in examples]
    return bg.compute(handles), policy.stats


def _assert_same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


_FLOATS = st.floats(-4, 4, allow_nan=False, width=32)
_ADDC = [torch.addcmul, torch.addcdiv]


@settings(max_examples=25, deadline=None)
@given(
    op=st.sampled_from(_ADDC),
    wide=st.sampled_from([torch.float64, torch.int64, torch.float16]),
    rows=st.lists(st.tuples(st.lists(_FLOATS, min_size=3, max_size=3),
                            st.floats(0.5, 4, width=32)), min_size=1, max_size=4),
)
def test_a_0d_input_keeps_its_promotion_rank_under_vmap(
    op: Callable[..., torch.Tensor], wide: torch.dtype, rows: list[tuple[list[float], float]]
) -> None:
    examples = [(torch.tensor(v), torch.tensor(v[::-1]), torch.tensor(c).to(wide))
                for v, c in rows]
    if op is torch.addcdiv and not wide.is_floating_point:
        examples = [(a, b, c.double()) for a, b, c in examples]
    got, _ = _batched(op, examples)
    _assert_same(got, [op(*example) for example in examples])


def test_a_function_computing_with_a_wider_0d_input_gives_the_eager_values() -> None:
    # Eagerly a + b * c is float32, equal to the float32 target; computed in float64
    # it is off by float32's rounding of 0.1, which the cast back to float32 keeps.
    target = torch.full((3,), 0.1)
    fn = bg.batched_func(lambda a, b, c: (torch.addcmul(a, b, c) - target).float())
    examples = [(torch.zeros(3), torch.ones(3) * k, torch.tensor(0.1 / k, dtype=torch.float64))
                for k in (1.0, 2.0, 4.0)]
    got, _ = _batched(fn, examples)
    _assert_same(got, [fn(*example) for example in examples])


_MATS = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
_VECS = [torch.randn(5, generator=torch.Generator().manual_seed(10 + i)) for i in range(3)]
_BIAS = torch.randn(3, generator=torch.Generator().manual_seed(20))


@pytest.mark.parametrize(
    ("name", "fn", "examples"),
    [
        ("mv", torch.mv, list(zip(_MATS, _VECS))),
        ("dot", torch.dot, list(zip(_VECS, _VECS[::-1]))),
        ("addmv", lambda m, v: torch.addmv(_BIAS, m, v), list(zip(_MATS, _VECS))),
        ("dot in a function", bg.batched_func(lambda a, b: torch.dot(a, b) * b),
         list(zip(_VECS, _VECS[::-1]))),
    ],
)
def test_under_autocast_an_op_eager_code_runs_in_float32_is_not_batched_in_bfloat16(
    name: str, fn: Callable[..., torch.Tensor], examples: list[tuple[torch.Tensor, ...]]
) -> None:
    with torch.autocast("cpu", dtype=BF16):
        want = [fn(*example) for example in examples]
        got, stats = _batched(fn, examples)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        # bfloat16 arithmetic is off by ~1e-2 here; float32 by rounding only.
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert stats.unbatched_calls == len(examples), name  # each runs as eagerly


def test_under_autocast_a_linear_inside_a_function_still_batches() -> None:
    # vmap adds the bias in float32 after a bfloat16 product: finer than eager code,
    # tolerated (cast to the eager dtype), so the calls still run as one batch.
    torch.manual_seed(0)
    lin = nn.Linear(5, 4)
    fn = bg.batched_func(lambda x: lin(x).tanh())
    examples = [(v,) for v in _VECS]
    with torch.autocast("cpu", dtype=BF16):
        want = [fn(*example) for example in examples]
        got, stats = _batched(fn, examples)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == BF16
        torch.testing.assert_close(g, w, rtol=1e-2, atol=1e-2)
    assert stats.launches == 1


_INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
_MIXED: list[Callable[..., Any]] = [
    torch.atan2, torch.copysign,
    bg.batched_func(lambda a, b: (a < b).long() + 1),
    bg.batched_func(lambda a, b: a / b * 2),
    bg.batched_func(lambda a, b: torch.ge(a, b) & (a != 0)),
]


@settings(max_examples=40, deadline=None)
@given(
    op=st.sampled_from(_MIXED),
    vector_dtype=st.sampled_from(_INTS),
    scalar_dtype=st.sampled_from(_INTS),
    rows=st.lists(st.tuples(st.lists(st.integers(0, 127), min_size=3, max_size=3),
                            st.sampled_from([-3, -1, 1, 5, 100])), min_size=1, max_size=3),
)
def test_a_0d_integer_input_of_another_integer_dtype_compares_and_divides_as_eagerly(
    op: Callable[..., torch.Tensor], vector_dtype: torch.dtype, scalar_dtype: torch.dtype,
    rows: list[tuple[list[int], int]],
) -> None:
    # Eagerly uint8 [10] < int8 -3 compares with 253 (the 0-d input takes the uint8
    # dtype) and uint8 [10] / int8 -3 divides by -3.0; vmap gave the other answers.
    examples = [(torch.tensor(v).to(vector_dtype), torch.tensor(c).to(scalar_dtype))
                for v, c in rows]
    got, _ = _batched(op, examples)
    _assert_same(got, [op(*example) for example in examples])


def test_a_function_adding_integers_of_two_dtypes_still_batches() -> None:
    fn = bg.batched_func(lambda a, b: (a + b) * 2)  # computed in uint8 either way
    examples = [(torch.tensor([10, 20], dtype=torch.uint8) + i, torch.tensor(-3)) for i in range(3)]
    got, stats = _batched(fn, examples)
    _assert_same(got, [fn(*example) for example in examples])
    assert stats.launches == 1
