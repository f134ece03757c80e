"""A function decorated with ``@bg.batched_func`` keeps what ``functools.wraps`` keeps
for tools: its ``__name__``, ``__wrapped__`` and so its ``inspect.signature``. It had
none of them ("no signature found for builtin <CallSite ...>")."""

from __future__ import annotations

import inspect

import torch

import batchgraph as bg


@bg.batched_func
def step(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return x * scale


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    @bg.batched_func
    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_decorated_function_keeps_its_name_and_signature() -> None:
    assert step.__name__ == "step"
    assert step.__wrapped__ is inspect.unwrap(step)
    assert str(inspect.signature(step)) == "(x: 'torch.Tensor', scale: 'float' = 2.0) -> 'torch.Tensor'"
    assert bg.batched_func(torch.tanh).__name__ == "tanh"


def test_a_decorated_method_binds_with_its_signature() -> None:
    model = Model()
    assert model.helper.__name__ == "helper"
    assert list(inspect.signature(model.helper).parameters) == ["x"]


def test_a_module_site_has_no_name_as_the_module_has_none() -> None:
    model = Model()
    site = bg.batched_func(model.lin)
    assert getattr(site, "__name__", None) is None
    with bg.BatchingPolicy():
        assert getattr(model.lin, "__name__", None) is None
        assert model.lin.out_features == 2
