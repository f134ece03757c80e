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
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.rules import BatchedHooksWarning
from tests.unit.pending_calls import compute_pending


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


def _hooked_before_if(hooked: bool, hook: Any) -> tuple[_Model, list[torch.Tensor], Any]:
    """A model, three inputs, and ``hook``'s handle on the model's layer (None unless
    ``hooked``: a test that removes it registers it first)."""
    model = _Model()
    handle = model.lin.register_forward_hook(hook) if hooked else None
    return model, [torch.randn(4) for _ in range(3)], handle


def _first_two(module: nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
    return out[..., :2]  # per example under stacking: the last dim is each example's


@pytest.mark.filterwarnings("ignore::batchgraph.rules.BatchedHooksWarning")
@pytest.mark.parametrize("change", ["register", "remove"])
def test_results_follow_hooks_changed_between_batches_as_eagerly(change: str) -> None:
    # A hook reshaping the output: the cached signature's output spec was stale, and
    # the batch failed its shape check (BatchedCallError) instead of giving eager values.
    model, xs, handle = _hooked_before_if(change == "remove", _first_two)
    first = _batched(model, xs)
    assert [tuple(t.shape) for t in first] == [tuple(model.f(x).shape) for x in xs]
    if handle is None:
        model.lin.register_forward_hook(_first_two)
    else:
        handle.remove()
    for x, got in zip(xs, _batched(model, xs), strict=True):
        torch.testing.assert_close(got, model.f(x))


def _double(module: nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2  # per example under stacking: batched, as eagerly


@pytest.mark.filterwarnings("ignore::batchgraph.rules.BatchedHooksWarning")
@pytest.mark.parametrize("change", ["register", "remove"])
def test_a_hook_changed_between_record_and_compute_is_refused(change: str) -> None:
    # Eagerly the recorded calls ran the hooks of their time; batched, they ran those
    # of compute, silently (max diff 0.42 for a normalizing hook registered between).
    model, xs, handle = _hooked_before_if(change == "remove", _double)
    want = [model.f(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [model.f(x) for x in xs]
    if handle is None:
        handle = model.lin.register_forward_hook(_double)
    else:
        handle.remove()
    with pytest.raises(bg.HooksChangedError, match=r"hooks of StackKey\[Linear.*registered or "
                       r"removed after its calls in this batch \(3\) were recorded"):
        policy.compute(handles)
    if change == "register":  # put back as they were, the calls compute as eagerly
        handle.remove()
        for got, w in zip(policy.compute(handles), want, strict=True):
            torch.testing.assert_close(got, w)
    else:  # a hook registered anew is another hook: still refused
        model.lin.register_forward_hook(_double)
        with pytest.raises(bg.HooksChangedError):
            policy.compute(handles)


@pytest.mark.filterwarnings("ignore::batchgraph.rules.BatchedHooksWarning")
def test_calls_recorded_after_a_hook_change_compute_while_older_ones_are_refused() -> None:
    model = _Model()
    xs = [torch.randn(4) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        old = model.f(xs[0])
        policy.compute(model.f(xs[1]))  # a compute in between: the next call notes anew
        model.lin.register_forward_hook(_double)
        new = model.f(xs[2])
    torch.testing.assert_close(policy.compute(new), model.f(xs[2]))
    with pytest.raises(bg.HooksChangedError):
        policy.compute(old)


@pytest.mark.filterwarnings("ignore::batchgraph.rules.BatchedHooksWarning")
@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["record", "record", "toggle", "compute"]), max_size=12))
def test_random_record_hook_compute_sequences_match_eager_or_are_refused(ops: list[str]) -> None:
    """Each pending call computes as it ran eagerly (with the hooks of its time), and
    compute is refused exactly where some pending call was recorded with other hooks
    (a hook removed and registered anew is another hook), however the changes fall
    between calls and computes."""
    torch.manual_seed(0)
    model = _Model()
    lin = model.lin  # the module itself (read outside the policy): runs eagerly there
    xs = [torch.randn(4) for _ in range(len(ops) + 1)]
    handle: Any = None
    pending: list[tuple[Any, torch.Tensor, int | None]] = []  # handle, eager value, hook
    with bg.BatchingPolicy() as policy:
        for i, op in enumerate([*ops, "compute"]):
            hook = None if handle is None else handle.id
            if op == "record":
                with torch.no_grad():
                    want = torch.tanh(lin(xs[i]))
                pending.append((model.f(xs[i]), want, hook))
            elif op == "toggle":
                if handle is None:
                    handle = lin.register_forward_hook(_double)
                else:
                    handle.remove()
                    handle = None
            elif pending:
                stale = any(then != hook for _, _, then in pending)
                compute_pending(policy, pending, bg.HooksChangedError if stale else None)


def test_a_function_reading_a_hooked_module_warns_and_runs_per_example_when_asked() -> None:
    # Under vmap a hook keeping its module's output kept one vmap-internal tensor
    # ("tensor may have escaped" when used), without a word at recording.
    lin = nn.Linear(4, 4)
    kept: list[torch.Tensor] = []
    lin.register_forward_hook(lambda m, i, out: kept.append(out.detach()))
    step = bg.batched_func(lambda x: torch.tanh(lin(x)))
    xs = [torch.randn(4) for _ in range(3)]
    warned = pytest.warns(BatchedHooksWarning, match=r"<lambda> reads modules with forward hooks "
                          r"\(Linear\); batched by VmapKey.*rules=\{fn: bg\.UnbatchedKey\}")
    with warned as caught, bg.BatchingPolicy():
        handles = [step(bg.batched_value(x)) for x in xs]
        [torch.tanh(h) for h in handles]  # reading no module: no warning
    assert len(caught) == 1 and caught[0].filename == __file__
    with bg.BatchingPolicy(rules={step: bg.UnbatchedKey}):
        handles = [step(bg.batched_value(x)) for x in xs]
    kept.clear()
    bg.compute(handles)
    outs = list(kept)
    for x, out in zip(xs, outs, strict=True):  # each example's own output, usable
        torch.testing.assert_close(out + 0, lin(x).detach())
