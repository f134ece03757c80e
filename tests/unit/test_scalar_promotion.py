"""Stacked elementwise calls promote 0-d inputs as each example did eagerly.

Before: a true division of an integer tensor by a 0-d integer tensor of another dtype
cast the 0-d one to the tensor's dtype first (``uint8_vec / torch.tensor(256)``
divided by 0, ``/ torch.tensor(-3)`` by 253), where eagerly it is converted to float
as it is; a complex 0-d input beside float16 tensors made complex64 where eager code
makes complex32 (``BatchedCallError``); ``7 / h`` computed ``torch.div(7, h)``
where a tensor computes ``h.reciprocal() * 7``, one float32 ulp apart; and a 0-d CPU
input beside CUDA values, fine eagerly, failed the batch ("not on the expected
device").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg
from batchgraph.keys import ElementwiseKey
from batchgraph.specs import CallSignature, InputSlot, TensorSpec

_INTS = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def _batched(fn: Callable[..., Any], examples: Sequence[tuple[Any, ...]]) -> list[torch.Tensor]:
    with bg.BatchingPolicy():
        handles = [fn(*(bg.batched_value(x) if isinstance(x, torch.Tensor) else x
                        for x in example)) for example in examples]
    return bg.compute(handles)  # type: ignore[no-any-return]


def _comparable(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex64) if t.dtype == torch.complex32 else t


def _assert_same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(_comparable(g), _comparable(w), rtol=0, atol=0,
                                   equal_nan=True)


def _int_tensor(dtype: torch.dtype, values: Any) -> torch.Tensor:
    t = torch.tensor(values)
    return t != 0 if dtype == torch.bool else t.to(dtype)


_DIVISIONS: list[Callable[..., Any]] = [
    lambda a, b: a / b, lambda a, b: torch.div(a, b), lambda a, b: a.div(b),
    lambda a, b: b / a, lambda a, b: torch.true_divide(b, a),
]


@settings(max_examples=60, deadline=None)
@given(
    division=st.sampled_from(_DIVISIONS),
    vector_dtype=st.sampled_from(_INTS),
    scalar_dtype=st.sampled_from(_INTS),
    rows=st.lists(st.tuples(st.lists(st.integers(-128, 127), min_size=3, max_size=3),
                            st.sampled_from([-3, -1, 1, 2, 7, 100, 127])),
                  min_size=1, max_size=3),
)
def test_a_true_division_of_integers_converts_a_0d_input_as_it_is(
    division: Callable[..., Any], vector_dtype: torch.dtype, scalar_dtype: torch.dtype,
    rows: list[tuple[list[int], int]],
) -> None:
    examples = [(_int_tensor(vector_dtype, v), _int_tensor(scalar_dtype, c)) for v, c in rows]
    _assert_same(_batched(division, examples), [division(*e) for e in examples])


def test_an_image_divided_by_a_0d_count_above_its_range() -> None:
    images = [torch.tensor([0, 128, 255], dtype=torch.uint8) for _ in range(2)]
    counts = [torch.tensor(256), torch.tensor(1000)]
    examples = list(zip(images, counts))
    _assert_same(_batched(lambda x, n: x / n, examples), [x / n for x, n in examples])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@settings(max_examples=40, deadline=None)
@given(
    vector_dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    scalar_dtype=st.sampled_from([torch.complex64, torch.complex128]),
    op=st.sampled_from([torch.add, torch.mul, torch.sub]),
    rows=st.lists(st.tuples(st.lists(st.floats(-4, 4, width=16), min_size=3, max_size=3),
                            st.complex_numbers(max_magnitude=4, allow_nan=False,
                                               allow_infinity=False)),
                  min_size=1, max_size=3),
)
def test_a_complex_0d_input_beside_float_tensors_gives_the_eager_complex_dtype(
    vector_dtype: torch.dtype, scalar_dtype: torch.dtype, op: Callable[..., Any],
    rows: list[tuple[list[float], complex]],
) -> None:
    examples = [(torch.tensor(v, dtype=vector_dtype), torch.tensor(c, dtype=scalar_dtype))
                for v, c in rows]
    for pair in (examples, [(c, v) for v, c in examples]):
        _assert_same(_batched(op, pair), [op(*e) for e in pair])


@settings(max_examples=40, deadline=None)
@given(
    number=st.one_of(st.floats(-100, 100, allow_subnormal=False), st.integers(-9, 9)),
    rows=st.lists(st.lists(st.floats(0.125, 50, width=32), min_size=3, max_size=3),
                  min_size=1, max_size=3),
)
def test_a_number_divided_by_a_handle_rounds_as_by_a_tensor(
    number: float, rows: list[list[float]]
) -> None:
    examples = [(torch.tensor(v), number) for v in rows]

    def divide(x: Any, c: float) -> Any:
        return c / x

    _assert_same(_batched(divide, examples), [divide(*e) for e in examples])


def test_seven_divided_by_three_is_the_tensor_result() -> None:
    x = torch.tensor([3.0, 7.0, 11.0])
    _assert_same(_batched(lambda h: 7 / h, [(x,)]), [7 / x])


def test_a_0d_cpu_input_moves_to_the_device_of_the_others() -> None:
    # Eagerly `x_cuda * torch.tensor(0.5)` works (a 0-d CPU tensor is read as a number);
    # the batched call gets it stacked, (B,) on the CPU. Shown on the meta device, which
    # every machine has (tests/gpu checks values on CUDA).
    x = TensorSpec((3,), torch.float32, torch.device("meta"))
    c = TensorSpec((), torch.float64, torch.device("cpu"))
    key = ElementwiseKey(torch.mul, CallSignature((InputSlot(0), InputSlot(1)), (), (x, c), None))
    out = key.run(torch.mul, [torch.ones(2, 3, device="meta"), torch.tensor([2.0, 3.0]).double()], 2)
    want = torch.mul(torch.ones(3, device="meta"), torch.tensor(2.0).double())
    assert (out.shape, out.device, out.dtype) == ((2, 3), want.device, want.dtype)


_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
           torch.bfloat16, torch.float32, torch.float64, torch.complex64]
_BINARY: list[Callable[..., Any]] = [
    torch.add, torch.sub, torch.mul, torch.div, torch.floor_divide, torch.remainder,
    torch.maximum, torch.lt, torch.eq, torch.bitwise_and, torch.logical_and,
    lambda a, b: torch.where(b != 0, a, b), lambda a, b: a * 2.5 + b, lambda a, b: (a / b) > 1,
]


def _value(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5
    if dtype == torch.bool:
        return x > 0
    return torch.complex(x, -x).to(dtype) if dtype.is_complex else x.to(dtype)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=80, deadline=None)
@given(
    op=st.sampled_from(_BINARY),
    dtypes=st.tuples(st.sampled_from(_DTYPES), st.sampled_from(_DTYPES)),
    shapes=st.sampled_from([((), (3,)), ((3,), ()), ((2, 3), ()), ((), ()), ((3,), (2, 3))]),
    seed=st.integers(0, 1000),
)
def test_binary_ops_on_mixed_dtypes_and_ranks_give_the_eager_dtypes_and_values(
    op: Callable[..., Any], dtypes: tuple[torch.dtype, torch.dtype],
    shapes: tuple[tuple[int, ...], tuple[int, ...]], seed: int,
) -> None:
    examples = [(_value(dtypes[0], shapes[0], seed + i), _value(dtypes[1], shapes[1], -seed - i))
                for i in range(3)]
    try:
        want = [op(*e) for e in examples]
    except (RuntimeError, TypeError, NotImplementedError):
        # Values are compared here; refusals are not (a bool 0-d input of `-` is
        # refused eagerly but cast to the other input's dtype when stacked).
        return
    # float16/bfloat16 results with a wider 0-d operand too (mul and the divisions
    # read it in float32 eagerly: tests/unit/test_half_scalar_operands.py).
    _assert_same(_batched(op, examples), want)
