"""A recorded call keeps the autocast state it was made in, as eager code would.

Before: shape inference inside an autocast region left fake tensors in autocast's
weight cache (batched results, and the user's own eager calls after them, came back
as FakeTensors); a call's spec was cached whatever the state it was made in (a
Linear recorded outside autocast after one inside reported bfloat16); and a call
ran in the state in force at ``compute``, not the one it was recorded in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import batchgraph as bg
from tests.property.decoder_models import run_eagerly

BF16 = torch.bfloat16


def _autocast() -> Any:
    return torch.autocast("cpu", dtype=BF16)


@pytest.fixture
def lin() -> Any:
    torch.manual_seed(0)
    return bg.batched_func(nn.Linear(4, 4))  # a new site: no signature cached yet


XS = [torch.randn(4, generator=torch.Generator().manual_seed(i)) for i in range(3)]


def _assert_like(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is torch.Tensor  # not a FakeTensor
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_recording_inside_autocast_leaves_no_fake_tensor_behind(lin: Any) -> None:
    with _autocast():
        with bg.BatchingPolicy():
            handles = [lin(bg.batched_value(x)) for x in XS]
        got = bg.compute(handles)
        after = lin(XS[0])  # the user's own eager call, in the same region
    assert not isinstance(after, FakeTensor)
    for x, value in zip(XS, got, strict=True):
        with _autocast():
            _assert_like(value, lin(x))


def test_a_call_recorded_in_autocast_computes_in_it_wherever_compute_runs(lin: Any) -> None:
    with bg.BatchingPolicy():
        with _autocast():
            inside = [lin(bg.batched_value(x)) for x in XS]
        outside = [lin(bg.batched_value(x)) for x in XS]
        assert inside[0].dtype == BF16 and outside[0].dtype == torch.float32
    with _autocast():  # computing in autocast does not change the calls made outside it
        got_inside, got_outside = bg.compute([inside, outside])
    for x, a, b in zip(XS, got_inside, got_outside):
        with _autocast():
            _assert_like(a, lin(x))
        _assert_like(b, lin(x))


def test_specs_cached_in_autocast_do_not_serve_calls_outside_it(lin: Any) -> None:
    with _autocast(), bg.BatchingPolicy():
        assert lin(bg.batched_value(XS[0])).dtype == BF16
    with bg.BatchingPolicy():
        h = torch.tanh(lin(bg.batched_value(XS[0])))
        assert h.dtype == torch.float32  # was bfloat16, from the cached signature
        value = bg.compute(h)
    _assert_like(value, torch.tanh(lin(XS[0])))


def test_calls_in_and_out_of_autocast_do_not_batch_together(lin: Any) -> None:
    with bg.BatchingPolicy() as policy:
        with _autocast():
            a = lin(bg.batched_value(XS[0]))
        b = lin(bg.batched_value(XS[1]))
        got = bg.compute([a, b])
    assert policy.stats.launches == 2
    assert (got[0].dtype, got[1].dtype) == (BF16, torch.float32)


async def _example(
    region: Callable[[], Any], lin: Any, x: torch.Tensor, in_autocast: bool
) -> list[torch.Tensor]:
    if in_autocast:
        with region():
            first = await bg.value(lin(x))  # suspends inside the region
            second = lin(x)
        third = lin(x)
    else:
        first = await bg.value(lin(x))
        second = lin(x)
        third = lin(x)
    return [first, second, third]


def check_awaiting_in_autocast(
    region: Callable[[], Any], lin: Any, xs: list[torch.Tensor], groups: int,
    assert_like: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Examples that await inside ``region`` (an autocast) or not give the eager
    values, and leave no autocast behind (also used by tests/gpu)."""
    flags = [True, False, True, False]
    want = [run_eagerly(_example(region, lin, x, f)) for x, f in zip(xs, flags)]
    got = bg.run_all([_example(region, lin, x, f) for x, f in zip(xs, flags)], groups=groups)
    assert not torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cuda")
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            assert_like(b, a)


@pytest.mark.parametrize("groups", [1, 2])
def test_an_example_awaiting_in_autocast_keeps_it_to_itself(lin: Any, groups: int) -> None:
    check_awaiting_in_autocast(_autocast, lin, [*XS, XS[0]], groups, _assert_like)


def test_binding_a_worker_batch_inside_autocast_is_refused_clearly() -> None:
    from tests.property.models import TreeModel

    model = TreeModel()
    batch = bg.GraphCollate(model, "logits")([((1, 2), 3), 4])
    with _autocast(), pytest.raises(RuntimeError, match=r"recorded \(in a worker\) without it"):
        bg.bind(batch, model)
    assert bg.bind(batch, model)[0].dtype == torch.float32


def test_exporting_calls_recorded_in_autocast_is_refused_clearly(lin: Any) -> None:
    class Model(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    model = Model()
    with _autocast(), bg.BatchingPolicy() as policy:
        handles = [model.lin(bg.batched_value(x)) for x in XS]
    with pytest.raises(ValueError, match=r"recorded under torch\.autocast cannot"):
        bg.export(policy, handles, model)


def test_a_vmapped_call_autocast_does_not_reach_gets_the_eager_dtype() -> None:
    # vmap runs prelu outside autocast's reach: float32 rows where eager code gives
    # bfloat16; the executor gives the rows the recorded dtype.
    prelu = nn.PReLU(4)
    site = bg.batched_func(prelu)
    xs = [torch.randn(2, 4) for _ in range(2)]
    with torch.no_grad(), _autocast():
        with bg.BatchingPolicy():
            handles = [site(bg.batched_value(x)) for x in xs]
        got = bg.compute(handles)
        want = [prelu(x) for x in xs]
    for g, w in zip(got, want, strict=True):
        _assert_like(g, w)
