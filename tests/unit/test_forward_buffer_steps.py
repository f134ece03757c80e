"""A forward changing a buffer in place and computing its output from it.

Before: batchgraph's runs on fake tensors skip a real buffer's in-place change, so a
step kept in a buffer (``self.step.add_(1); return x + self.step``) or a
``spectral_norm`` pre-hook in training (its power iteration writes ``weight_u`` with
``out=``, and the weight is divided by a sigma read from it) looked like a forward
keeping no state: the calls batched, every call of the batch read one step and the
buffer moved once (3 calls: steps 1, 1, 1 and a step of 1 left, where eagerly 1, 2, 3
and 3), silently. Now such calls run one at a time in recorded order; a buffer only
updated (a count of calls nothing reads) still batches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


class BufferStep(nn.Module):
    """A step counted in a buffer in place; ``reads``: the output is computed from it
    (else it counts calls, and nothing reads it)."""

    def __init__(self, reads: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.reads = reads
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step.add_(1)
        return self.lin(x) * 2 + self.step if self.reads else self.lin(x)


def _spectral() -> nn.Module:
    return torch.nn.utils.spectral_norm(nn.Linear(4, 4))


MAKERS: dict[str, Callable[[], nn.Module]] = {"buffer step": BufferStep,
                                             "spectral_norm": _spectral}


def _batched_and_eager(module: nn.Module, eager: nn.Module, xs: list[torch.Tensor],
                       buffers: bool = True) -> bg.BatchingPolicy:
    """``module``'s calls on ``xs`` batched, checked against ``eager``'s (made alike)
    eager calls: values, gradients and (``buffers``) the buffers left; the policy."""
    module.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    want = [eager(x) for x in xs]
    f = bg.batched_func(lambda x: module(x))
    with bg.BatchingPolicy() as policy:
        handles = [f(x) for x in xs]
    got = bg.compute(handles)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.autograd.backward([w.sum() for w in want])
    torch.autograd.backward([g.sum() for g in got])
    for (name, a), b in zip(eager.named_parameters(), module.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    for (name, a), b in zip(eager.named_buffers(), module.buffers(), strict=True):
        if buffers:
            torch.testing.assert_close(b, a, msg=name)
    return policy


def _pair(make: Callable[[], nn.Module], seed: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    module = make()
    torch.manual_seed(seed)
    return module, make()


@pytest.mark.parametrize("kind", sorted(MAKERS))
@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(st.integers(1, 3), min_size=2, max_size=4), seed=st.integers(0, 99))
def test_a_buffer_changed_in_place_and_read_computes_as_eagerly(
        kind: str, lengths: list[int], seed: int) -> None:
    module, eager = _pair(MAKERS[kind], seed)
    _batched_and_eager(module, eager, [torch.randn(n, 4) for n in lengths])
    # identical calls are not merged, and a later eager call reads what they left
    _batched_and_eager(module, eager, [torch.randn(2, 4)] * 2)
    x = torch.randn(2, 4)
    torch.testing.assert_close(module(x), eager(x))


@pytest.mark.parametrize("make", [lambda: BufferStep(reads=False), lambda: _spectral().eval(),
                                  lambda: nn.BatchNorm1d(4).eval()])
def test_a_buffer_not_read_after_its_change_still_batches(make: Callable[[], nn.Module]) -> None:
    # (a count nothing reads counts once per batched call: README's limit)
    module, eager = _pair(make, 0)
    policy = _batched_and_eager(module, eager, [torch.randn(3, 4) for _ in range(4)],
                                buffers=False)
    assert policy.stats is not None and policy.stats.launches == 1
