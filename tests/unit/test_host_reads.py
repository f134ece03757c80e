"""A recorded function that reads its input's values on the host runs unbatched.

``x.numpy()`` and ``np.asarray(x)`` are value-dependent Python, as ``x.item()`` is:
the run on fake tensors cannot know their result. Before, the fake tensor's
RuntimeError was taken for a shape error (``ShapeMismatchError ... check the
shapes``) although the shapes were fine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import batchgraph as bg


def _numpy_sum(x: torch.Tensor) -> torch.Tensor:
    return x + float(np.sum(x.detach().numpy()))


def _asarray_max(x: torch.Tensor) -> torch.Tensor:
    return x * float(np.asarray(x.detach()).max())


def _cpu_numpy_sorted(x: torch.Tensor) -> torch.Tensor:
    return x * torch.from_numpy(np.sort(x.detach().cpu().numpy()))


def _tolist_max(x: torch.Tensor) -> torch.Tensor:
    return x * max(x.tolist())


@pytest.mark.parametrize("fn", [_numpy_sum, _asarray_max, _cpu_numpy_sorted, _tolist_max])
def test_host_reads_run_unbatched_with_eager_values_and_gradients(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    torch.manual_seed(0)
    xs = [torch.randn(4, requires_grad=True) for _ in range(3)]
    f = bg.batched_func(fn)
    with bg.BatchingPolicy() as policy:
        handles = [f(bg.batched_value(x) * 2) for x in xs]
    got = bg.compute(handles)
    grads = torch.autograd.grad(sum(g.sum() for g in got), xs)
    for x, value, grad in zip(xs, got, grads, strict=True):
        want = fn(x * 2)
        torch.testing.assert_close(value, want)
        (want_grad,) = torch.autograd.grad(want.sum(), [x])
        torch.testing.assert_close(grad, want_grad)
    assert policy.stats is not None and policy.stats.unbatched_calls == 3


# torch warns when the values read are a fake's memory ("Accessing the data pointer of
# FakeTensor"): the real tensor must be read outside the fake mode, when the output
# is inferred and when vmap is probed.
@pytest.mark.filterwarnings("error::UserWarning")
def test_a_held_real_tensor_read_on_the_host_still_batches() -> None:
    # Only the fake inputs' values are unknown: a constant the function holds is read.
    scale = torch.tensor([1.0, 2.0, 3.0])

    def scaled(x: torch.Tensor) -> Any:
        return x * float(scale.numpy().sum())

    f = bg.batched_func(scaled)
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        handles = [f(bg.batched_value(x)) for x in xs]
    for x, value in zip(xs, bg.compute(handles), strict=True):
        torch.testing.assert_close(value, x * 6.0)
    assert policy.stats is not None and policy.stats.unbatched_calls == 0
    assert policy.stats.launches == 1


def test_a_shape_error_after_a_held_tensors_host_read_is_still_a_shape_error() -> None:
    weight = torch.ones(5)

    def bad(x: torch.Tensor) -> Any:
        return x * float(weight.numpy().sum()) + weight  # (3,) + (5,)

    f = bg.batched_func(bad)
    with bg.BatchingPolicy(), pytest.raises(bg.ShapeMismatchError, match="check the shapes"):
        f(bg.batched_value(torch.ones(3)))


# Tensor methods that run a Python function on each element's value. On the fake
# tensors of shape inference ``apply_`` read memory a fake has not: the process died
# of a segmentation fault. ``map_`` failed as a shape error ("check the shapes").
_PER_ELEMENT: dict[str, Callable[[Any], Any]] = {
    "apply_ on a handle": lambda h: h.apply_(lambda v: v * v + 1.0),
    "map_ on a handle": lambda h: h.map_(h * 2, lambda a, b: a - b / 4),
    "map2_ on a handle": lambda h: h.map2_(h + 1, h * 3, lambda a, b, c: a * b + c),
    "apply_ in a recorded function": lambda h: bg.batched_func(
        lambda x: x.clone().apply_(lambda v: abs(v) - 0.5))(h),
}


@pytest.mark.parametrize("name", sorted(_PER_ELEMENT))
def test_per_element_python_methods_run_one_at_a_time_with_eager_values(name: str) -> None:
    op = _PER_ELEMENT[name]
    xs = [torch.randn(2, 3) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        handles = []
        for x in xs:
            h = bg.batched_value(x) * 2
            alias = h
            out = op(h)
            handles.append((out, alias))
    for x, (out, alias) in zip(xs, bg.compute(handles), strict=True):
        eager = x * 2
        eager_alias = eager
        want = op(eager)
        torch.testing.assert_close(out, want)
        # In place on a handle: every name bound to it sees the change, as eagerly.
        torch.testing.assert_close(alias, eager_alias)
    assert policy.stats is not None and policy.stats.unbatched_calls >= 3
