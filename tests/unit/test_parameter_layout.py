"""A module converted (``.double()``, ``.half()``, ``.to(dtype)``) after its calls were
recorded: its later calls are recorded with the new parameters' specs.

A call site's signature cache outlives policies and is keyed on the per-example
inputs' specs, which for an embedding (integer indices) do not change with the
weights' dtype: after ``model.double()`` the cached float32 output spec was reused,
so compute failed ("returned torch.float64 ... where each call run alone returns
torch.float32 ... Register VmapKey") on code that runs eagerly, and every call
recorded on such a handle took the stale spec too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import batchgraph as bg


class _Decoder(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.cell = nn.GRUCell(4, 4)

    def step(self, token: int) -> object:
        return self.cell(self.embed(bg.batched_value(torch.tensor(token)))) * 2


def _batched(model: _Decoder, tokens: list[int]) -> list[torch.Tensor]:
    with bg.BatchingPolicy():
        handles = [model.step(t) for t in tokens]
    result: list[torch.Tensor] = bg.compute(handles)
    return result


def test_calls_after_a_dtype_conversion_take_the_new_dtype() -> None:
    model = _Decoder()
    _batched(model, [1, 2, 3])
    for dtype in (torch.float64, torch.bfloat16, torch.float32):
        model.to(dtype)
        for token, got in zip([1, 2, 3], _batched(model, [1, 2, 3])):
            want = model.step(token)
            assert got.dtype == want.dtype == dtype
            torch.testing.assert_close(got, want)


def test_a_function_reading_a_rebound_global_takes_its_new_dtype() -> None:
    global _TABLE
    scale = bg.batched_func(_scale)
    x = torch.randn(3)
    with bg.BatchingPolicy():
        assert scale(x).dtype == torch.float32
    _TABLE = _TABLE.double()
    with bg.BatchingPolicy():
        handle = scale(x)
        assert handle.dtype == torch.float64
    torch.testing.assert_close(bg.compute(handle), _scale(x), rtol=0, atol=0)


_TABLE = torch.randn(5, 3)


def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * _TABLE.sum(0)  # float32 times float64 is float64


def test_a_model_converted_between_recording_and_compute_is_refused() -> None:
    # Eagerly the calls ran in float32; the batch would run them with float64
    # weights (an embedding, whose indices do not show the change) or fail with
    # "mat1 and mat2 must have the same dtype" inside a BatchedCallError.
    model = _Decoder()
    with bg.BatchingPolicy():
        handles = [model.step(t) for t in (1, 2)]
    model.double()
    with pytest.raises(bg.ParameterChangedError, match=r"Embedding.* converted .*\.double\(\)"):
        bg.compute(handles)
    # Back as recorded: the parameters hold new data now (model.float() assigns
    # p.data), which batchgraph cannot tell from any other `p.data = t`: refused too.
    model.float()
    with pytest.raises(bg.ParameterChangedError, match=r"`p\.data = t`"):
        bg.compute(handles)
    with bg.BatchingPolicy():  # recorded again: computes, as eagerly
        handles = [model.step(t) for t in (1, 2)]
    for token, got in zip((1, 2), bg.compute(handles), strict=True):
        torch.testing.assert_close(got, model.step(token))
