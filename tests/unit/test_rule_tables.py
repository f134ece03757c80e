"""BatchingPolicy(rules=...) (and GraphCollate's, Binder's) refuses a rule table that
could not take effect, where it is given, instead of ignoring a rule without a word or
failing at the first call recorded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        # Before: accepted, and Linear still batched (no unbatched call): the rule a
        # user wrote to run hooks per example was ignored.
        ({"Linear": bg.UnbatchedKey}, r"rules key 'Linear' is a str, which no call is looked up by"),
        # Before: "TypeError: 'str' object is not callable" at the first call recorded.
        ({nn.Linear: "unbatched"}, r"rules\[<class 'torch.nn.modules.linear.Linear'>\] is "
                                   r"'unbatched', not a BatchKey class"),
        # Before: "AttributeError: 'list' object has no attribute 'items'".
        ([(nn.Linear, bg.UnbatchedKey)], r"rules must map callables to BatchKey classes, got list"),
    ],
)
def test_a_rule_that_could_not_take_effect_is_refused(rules: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        bg.BatchingPolicy(rules=rules)


def test_rules_by_class_instance_and_function_still_apply() -> None:
    lin, other = nn.Linear(2, 2), nn.Linear(2, 2)

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    rules = {lin: bg.UnbatchedKey, double: bg.UnbatchedKey, nn.Tanh: bg.UnbatchedKey}
    with bg.BatchingPolicy(rules=rules) as policy:
        hs = [bg.batched_func(f)(torch.full((2,), float(i)))  # distinct: none merge
              for f in (lin, other, double, nn.Tanh()) for i in range(2)]
    bg.compute(hs)
    assert policy.stats.unbatched_calls == 6  # all but `other`'s two


@pytest.mark.parametrize("batch_key", ["stack", bg.StackKey.__name__, 3])
def test_a_batch_key_attribute_that_is_no_key_class_names_the_module(batch_key: Any) -> None:
    # Before: "TypeError: 'str' object is not callable", naming neither.
    class Doubler(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    module = Doubler()
    module.batch_key = batch_key
    with bg.BatchingPolicy(), pytest.raises(
        TypeError, match=r"Doubler.batch_key is .*, not a BatchKey class: set it to the class"
    ):
        bg.batched_func(module)(torch.ones(2))


def test_a_key_class_with_an_unknown_combine_is_refused_where_it_is_defined() -> None:
    # Before: read as "stack", and the first batch failed ("returned 3 tensors for a
    # batch; its calls, run one at a time, return 1"), far from the typo.
    with pytest.raises(TypeError, match=r"PerExample.combine is 'lists'; it must be 'stack'"):

        class PerExample(bg.BatchKey):
            combine = "lists"
