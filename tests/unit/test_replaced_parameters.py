"""A module's parameters replaced by new tensors between recording and compute.

``load_state_dict(..., assign=True)`` or ``lin.weight = nn.Parameter(...)`` puts new
tensors in place of the parameters. batchgraph listed a module's parameters once per
graph and watched those: a call recorded before the replacement computed with the new
tensors (eagerly it used the old ones), and for the rest of a long-lived policy the
new tensors were not watched at all, so an optimizer step on them between recording
and compute went unrefused. Both silently gave other values than eager code.

So did a function reading the module (``bg.batched_func(lambda x: lin(x) * 2)``): it
watched the tensors it found once, so a parameter (or submodule) of the module replaced
between recording and compute went unseen, and its calls computed with the new one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


def _assign(lin: nn.Linear) -> None:
    lin.load_state_dict({k: v * 2 for k, v in lin.state_dict().items()}, assign=True)


def _new_weight(lin: nn.Linear) -> None:
    lin.weight = nn.Parameter(lin.weight.detach() * 2)


def _new_bias(lin: nn.Linear) -> None:
    lin.bias = nn.Parameter(lin.bias.detach() * 2)


REPLACE: dict[str, Callable[[nn.Linear], None]] = {
    "assign": _assign, "attribute": _new_weight, "bias": _new_bias}


def _reader(lin: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.tanh(lin(x)) * 2


def _closure(lin: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    layers = nn.Sequential(lin)

    def apply(x: torch.Tensor) -> torch.Tensor:
        return layers(x).sum()

    return apply


# What is recorded: the module itself, or a function reading it (by a closure cell, or
# through a container module).
SITES: dict[str, Callable[[nn.Linear], Callable[[torch.Tensor], torch.Tensor]]] = {
    "module": lambda lin: lin, "function": _reader, "container": _closure}


@pytest.mark.parametrize("site", sorted(SITES))
@pytest.mark.parametrize("how", sorted(REPLACE))
def test_a_replacement_between_recording_and_compute_is_refused(how: str, site: str) -> None:
    lin = nn.Linear(3, 3)
    with bg.BatchingPolicy() as policy:
        h = bg.batched_func(SITES[site](lin))(torch.ones(3))
    REPLACE[how](lin)
    with pytest.raises(bg.ParameterChangedError, match="replaced"):
        policy.compute(h)


def test_a_submodule_replaced_under_a_function_is_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    with bg.BatchingPolicy() as policy:
        h = bg.batched_func(lambda x: model(x) * 2)(torch.ones(3))
    model[0] = nn.Linear(3, 3)
    with pytest.raises(bg.ParameterChangedError, match="replaced"):
        policy.compute(h)


@settings(deadline=None, max_examples=10)
@given(how=st.sampled_from(sorted(REPLACE)), site_name=st.sampled_from(sorted(SITES)),
       rounds=st.integers(1, 3), seed=st.integers(0, 99))
def test_a_long_lived_policy_watches_the_new_parameters(how: str, site_name: str, rounds: int,
                                                         seed: int) -> None:
    """Each round: parameters replaced, calls recorded and computed (the new weights,
    as eagerly, with their gradients), then a call recorded before an optimizer step
    on the new tensors (refused at compute)."""
    torch.manual_seed(seed)
    lin = nn.Linear(3, 3).double()
    fn = SITES[site_name](lin)
    site, policy = bg.batched_func(fn), bg.BatchingPolicy()
    x = torch.randn(3, dtype=torch.float64)
    for _ in range(rounds):
        REPLACE[how](lin)
        with policy:
            h = site(x)
        got = policy.compute(h)
        torch.testing.assert_close(got, fn(x), rtol=0, atol=0)
        got_grads = torch.autograd.grad(got.sum(), list(lin.parameters()))
        eager_grads = torch.autograd.grad(fn(x).sum(), list(lin.parameters()))
        torch.testing.assert_close(got_grads, eager_grads, rtol=0, atol=1e-12)
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        fn(x).sum().backward()
        with policy:
            stale = site(x + 1)  # x itself merges with `h`, computed already
        opt.step()
        with pytest.raises(bg.ParameterChangedError):
            policy.compute(stale)


@pytest.mark.parametrize("reads", ["module", "function"])
def test_calls_recorded_after_a_refused_compute_compute_with_the_new_parameter(
    reads: str
) -> None:
    # The refused compute left the graph's stamp as it was, so the site's memo gave the
    # next call the refused calls' key id, and it was refused too, though recorded
    # after the replacement ("record the calls again" did not help).
    lin = nn.Linear(3, 3)
    site = bg.batched_func(lin) if reads == "module" else bg.batched_func(lambda x: lin(x) * 2)
    scale = 1 if reads == "module" else 2
    with bg.BatchingPolicy() as policy:
        policy.compute(site(torch.zeros(3)))
        lin.bias = nn.Parameter(torch.zeros(3))
        stale = site(torch.ones(3))
        lin.bias = nn.Parameter(torch.ones(3))
        with pytest.raises(bg.ParameterChangedError):
            policy.compute(stale)
        x = torch.randn(3)
        again = policy.compute(site(x))
    torch.testing.assert_close(again, lin(x) * scale)
