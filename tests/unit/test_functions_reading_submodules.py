"""A batched function that reads a ``BatchedModule``'s submodule (``model.lin``).

While a policy records, that attribute reads as the submodule's stub. Shape
inference ran the function under the recording policy, so the stub recorded a call
instead of computing: the function never batched (UnbatchedKey, one call per
example); computed inside the ``with`` block, a batched step returned a handle
(NotATensorError); and code wanting a module (``torch.func.functional_call``) got
the stub ("is not an instance of torch.nn.Module").
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


class _Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def encode(self, x: Any) -> Any:
        return self.lin(x)


_MODEL = _Model()
_DOUBLED = {"weight": _MODEL.lin.weight * 2, "bias": _MODEL.lin.bias}


def _through_submodule(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(_MODEL.lin(x)) + 1


def _functional(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.func.functional_call(_MODEL.lin, _DOUBLED, (x,))
    return out


@pytest.mark.parametrize("inside", [False, True])
def test_a_function_calling_a_submodule_batches_and_matches_eager(inside: bool) -> None:
    f = bg.batched_func(_through_submodule)
    xs = [torch.randn(4) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        handles = [f(bg.batched_value(x)) for x in xs]
        if inside:  # computed inside the `with` block too
            got = bg.compute(handles)
    if not inside:
        got = bg.compute(handles)
    assert policy.stats.unbatched_calls == 0
    for x, value in zip(xs, got, strict=True):
        torch.testing.assert_close(value, _through_submodule(x))


def test_functional_call_of_a_submodule_inside_a_batched_function() -> None:
    f = bg.batched_func(_functional)
    xs = [torch.randn(4) for _ in range(3)]
    with bg.BatchingPolicy():
        handles = [f(bg.batched_value(x)) for x in xs]
        _MODEL.encode(bg.batched_value(xs[0]))  # reads (and pins) the submodule's stub
        got = bg.compute(handles)  # inside the block, the stub pinned
    for x, value in zip(xs, got, strict=True):
        torch.testing.assert_close(value, _functional(x))
