"""Hooks on a batched module run once per batched call, not once per example.

By design (a hook cannot be split per example): under a stacking rule a hook sees
the whole batch, so a forward hook normalizing its module's output normalized the
batch, a silently wrong result. Recording now warns (BatchedHooksWarning), once per
call signature, with what to register; under UnbatchedKey results equal eager.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.rules import BatchedHooksWarning


class _Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def f(self, x: Any) -> Any:
        return torch.tanh(self.lin(x))


def _normalize(module: nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
    return out / out.norm()


def _batched(model: _Model, xs: list[torch.Tensor], **policy: Any) -> list[torch.Tensor]:
    with bg.BatchingPolicy(**policy):
        handles = [model.f(x) for x in xs]
    result: list[torch.Tensor] = bg.compute(handles)
    return result


def test_a_hooked_module_batched_by_stacking_warns_once_per_signature() -> None:
    model = _Model()
    model.lin.register_forward_hook(_normalize)
    xs = [torch.randn(4) for _ in range(4)]
    with pytest.warns(BatchedHooksWarning, match=r"Linear.* forward hooks; batched by StackKey.*"
                      r"whole batch.*rules=\{Linear: bg\.UnbatchedKey\}") as caught:
        _batched(model, xs)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the recording line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _batched(model, xs)  # the signature is cached: no second warning


@pytest.mark.filterwarnings("ignore::batchgraph.rules.BatchedHooksWarning")
@pytest.mark.parametrize("rule", [bg.UnbatchedKey, bg.VmapKey])
def test_a_hook_transforming_each_output_matches_eager_under_the_advised_rules(
    rule: type[bg.BatchKey],
) -> None:
    model = _Model()
    model.lin.register_forward_hook(_normalize)
    xs = [torch.randn(4) for _ in range(4)]
    for x, got in zip(xs, _batched(model, xs, rules={nn.Linear: rule})):
        torch.testing.assert_close(got, model.f(x))


def test_a_module_without_hooks_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedHooksWarning)
        _batched(_Model(), [torch.randn(4) for _ in range(3)])


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
def test_weight_norms_hook_does_not_warn_and_equals_eager() -> None:
    # weight_norm computes the weight in a forward pre-hook that reads no activations and
    # keeps no state: once per batched call is what each eager call gets, so no warning.
    model = _Model()
    model.lin = nn.utils.weight_norm(model.lin)
    xs = [torch.randn(4) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedHooksWarning)
        got = _batched(model, xs)
    for x, g in zip(xs, got, strict=True):
        torch.testing.assert_close(g, model.f(x))


def test_spectral_norms_hook_warns() -> None:
    # In train mode it takes a power-iteration step per call: per example eagerly.
    model = _Model()
    model.lin = nn.utils.spectral_norm(model.lin)
    with pytest.warns(BatchedHooksWarning, match="forward pre hooks"):
        _batched(model, [torch.randn(4) for _ in range(3)])


def test_a_hook_registered_after_a_first_batch_warns_when_recorded_again() -> None:
    # The signature was resolved (and cached) without hooks: recording it again after
    # register_forward_hook warned nowhere, and the hook normalized whole batches.
    model = _Model()
    xs = [torch.randn(4) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchedHooksWarning)
        _batched(model, xs)
    model.lin.register_forward_hook(_normalize)
    with pytest.warns(BatchedHooksWarning, match="forward hooks; batched by StackKey") as caught:
        _batched(model, xs)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # the line that recorded, as for a new signature


def _first_two(module: nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
    return out[..., :2]  # per example under stacking: the last dim is each example's


@pytest.mark.filterwarnings("ignore::batchgraph.rules.BatchedHooksWarning")
@pytest.mark.parametrize("change", ["register", "remove"])
def test_results_follow_hooks_changed_between_batches_as_eagerly(change: str) -> None:
    # A hook reshaping the output: the cached signature's output spec was stale, and
    # the batch failed its shape check (BatchedCallError) instead of giving eager values.
    model = _Model()
    xs = [torch.randn(4) for _ in range(3)]
    handle = model.lin.register_forward_hook(_first_two) if change == "remove" else None
    first = _batched(model, xs)
    assert [tuple(t.shape) for t in first] == [tuple(model.f(x).shape) for x in xs]
    if handle is None:
        model.lin.register_forward_hook(_first_two)
    else:
        handle.remove()
    for x, got in zip(xs, _batched(model, xs), strict=True):
        torch.testing.assert_close(got, model.f(x))
