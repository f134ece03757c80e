"""CUDA autocast: a recorded call keeps the autocast state it was made in, as on the
CPU (``tests/unit/test_autocast.py``); skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import batchgraph as bg
from tests.unit.test_autocast import check_awaiting_in_autocast

pytestmark = pytest.mark.gpu

F16 = torch.float16


def _autocast() -> Any:
    return torch.autocast("cuda", dtype=F16)


@pytest.fixture
def lin() -> Any:
    torch.manual_seed(0)
    return bg.batched_func(nn.Linear(4, 4).cuda())  # a new site: no signature cached yet


def _xs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, generator=gen).cuda() for _ in range(3)]


def _assert_like(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is torch.Tensor  # not a FakeTensor
    assert got.is_cuda and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_calls_recorded_in_cuda_autocast_compute_in_it_wherever_compute_runs(lin: Any) -> None:
    xs = _xs()
    with bg.BatchingPolicy() as policy:
        with _autocast():
            inside = [lin(bg.batched_value(x)) for x in xs]
        outside = [lin(bg.batched_value(x)) for x in xs]
        assert inside[0].dtype == F16 and outside[0].dtype == torch.float32
    with _autocast():  # computing in autocast does not change the calls made outside it
        got_inside, got_outside = bg.compute([inside, outside])
        after = lin(xs[0])  # the user's own eager call, in the same region
    assert not isinstance(after, FakeTensor)
    assert policy.stats is not None and policy.stats.launches == 2  # one per state
    for x, a, b in zip(xs, got_inside, got_outside):
        with _autocast():
            _assert_like(a, lin(x))
        _assert_like(b, lin(x))


def test_cpu_autocast_does_not_reach_cuda_calls(lin: Any) -> None:
    # Only the device's own autocast changes a CUDA call; a CPU region around it
    # still gives it its own key id (the state differs), and eager dtypes.
    xs = _xs()
    with bg.BatchingPolicy():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(bg.batched_value(xs[0]))
        assert h.dtype == torch.float32
        got = bg.compute(h)
    _assert_like(got, lin(xs[0]))


@pytest.mark.parametrize("groups", [1, 2])
def test_an_example_awaiting_in_cuda_autocast_keeps_it_to_itself(lin: Any, groups: int) -> None:
    check_awaiting_in_autocast(_autocast, lin, [*_xs(), _xs()[0]], groups, _assert_like)
