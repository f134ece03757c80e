"""Rules keyed by one module instance (or a batched_func wrapper) rather than a class."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.keys import StackKey


def _normalised(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    # Reads the whole output: per example eagerly, across the batch when batched.
    return out / out.norm()


def _layers() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    hooked, plain = nn.Linear(3, 3), nn.Linear(3, 3)
    hooked.register_forward_hook(_normalised)
    return hooked, plain


XS = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(4)]


@pytest.mark.parametrize("as_wrapper", [False, True])
def test_an_instance_rule_runs_that_module_alone_as_eagerly(as_wrapper: bool) -> None:
    # rules={hooked: UnbatchedKey} was looked up by type(hooked) and ignored: the hook
    # normalised across the batch, and the results differed from eager silently.
    hooked, plain = _layers()
    first, second = bg.batched_func(hooked), bg.batched_func(plain)
    key = first if as_wrapper else hooked
    with warnings.catch_warnings():
        warnings.simplefilter("error", bg.BatchedHooksWarning)  # nothing batches hooked
        with bg.BatchingPolicy(rules={key: bg.UnbatchedKey}) as policy:
            handles = [second(first(x)) for x in XS]
            got = bg.compute(handles)
    assert policy.stats is not None
    # Four calls of the hooked layer, one at a time; the plain one batched in one.
    assert policy.stats.launches == len(XS) + 1
    assert policy.stats.unbatched_calls == len(XS)
    for x, g in zip(XS, got, strict=True):
        torch.testing.assert_close(g, plain(hooked(x)))


def test_other_instances_of_the_class_keep_their_rule() -> None:
    # A class rule still applies to every other Linear, under the instance's own.
    hooked, plain = _layers()
    first, second = bg.batched_func(hooked), bg.batched_func(plain)

    class Counted(StackKey):
        runs = 0

        def run(self, fn: Any, inputs: Any, size: int) -> Any:
            Counted.runs += 1
            return super().run(fn, inputs, size)

    with bg.BatchingPolicy(rules={hooked: bg.UnbatchedKey, nn.Linear: Counted}) as policy:
        got = bg.compute([second(first(x)) for x in XS])
    assert policy.stats is not None and policy.stats.launches == len(XS) + 1
    assert Counted.runs == 1  # the plain layer's one batch; never the hooked one
    for x, g in zip(XS, got, strict=True):
        torch.testing.assert_close(g, plain(hooked(x)))


def test_worker_collate_refuses_an_instance_rule_it_could_never_match() -> None:
    # A worker records with its own copy of the model: a rule keyed by the main
    # process's module would be ignored there, as it was everywhere before.
    hooked, _ = _layers()
    with pytest.raises(TypeError, match=r"batch_key = "):
        bg.GraphCollate(hooked, "forward", rules={hooked: bg.UnbatchedKey})
