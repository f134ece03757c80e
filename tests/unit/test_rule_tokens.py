"""Policies with the same rules reuse the signatures resolved under them
(batchgraph.rule_tokens): a policy made per batch with a rule table does not pay a
run on fake tensors per signature per batch; different rules still choose their own
keys."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph import rule_tokens
from batchgraph.recording import CallSite


@pytest.fixture
def resolves(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each signature a call site resolves (the slow path, with its fake-tensor run)."""
    seen: list[Any] = []
    original = CallSite._bg_resolve

    def counting(self: CallSite, *args: Any) -> Any:
        seen.append(self._bg_name)
        return original(self, *args)

    monkeypatch.setattr(CallSite, "_bg_resolve", counting)
    return seen


def _batch(lin: nn.Module, rules: dict[Any, Any]) -> tuple[bg.BatchingPolicy, list[torch.Tensor]]:
    policy = bg.BatchingPolicy(rules=rules)
    xs = [torch.randn(3) for _ in range(4)]
    with policy:
        handles = [lin(x) for x in xs]
    return policy, bg.compute(handles)


def test_a_policy_per_batch_with_the_same_rules_resolves_each_signature_once(
    resolves: list[Any],
) -> None:
    lin = bg.batched_func(nn.Linear(3, 2))
    for _ in range(5):
        # The table written anew per batch, as a training loop would.
        policy, _ = _batch(lin, {nn.Linear: bg.UnbatchedKey})
        assert policy.stats.unbatched_callables  # the rule applies
    assert len(resolves) == 1  # before: 5, one per policy


def test_different_rules_still_choose_their_own_keys(resolves: list[Any]) -> None:
    lin = bg.batched_func(nn.Linear(3, 2))
    unbatched, _ = _batch(lin, {nn.Linear: bg.UnbatchedKey})
    vmapped, _ = _batch(lin, {nn.Linear: bg.VmapKey})
    plain, _ = _batch(lin, {})
    assert unbatched.stats.unbatched_callables and not vmapped.stats.unbatched_callables
    assert not plain.stats.unbatched_callables
    assert len(resolves) == 3


def test_a_rule_object_gone_takes_its_tokens_along() -> None:
    # An id may be another object's once its object is gone: the entry goes with it.
    def make() -> tuple[tuple[int, int], ...]:
        lin = nn.Linear(3, 2)
        tokens = rule_tokens.tokens_for({lin: bg.UnbatchedKey})
        assert rule_tokens.tokens_for({lin: bg.UnbatchedKey}) is tokens
        ident = ((id(lin), id(bg.UnbatchedKey)),)
        assert ident in rule_tokens._TABLES
        return ident

    ident = make()
    gc.collect()
    assert ident not in rule_tokens._TABLES
