"""Runs on fake tensors (a new call signature's shape inference, the vmap probe, the
aliasing and requires-grad checks) leave the real tensors a callable holds as they are.

With no fake operand, torch runs an in-place op for real even inside its fake mode:
``BatchNorm``'s ``num_batches_tracked += 1`` in training mode counted a batch per new
signature, which with ``momentum=None`` weighs the running statistics, so they
differed from eager training; a module counting its calls counted too many.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import batchgraph as bg


class Normed(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3, momentum=None)  # cumulative average: weighs by count

    def f(self, x: Any) -> Any:
        return self.bn(x)


def test_batchnorm_statistics_and_count_equal_eager_training() -> None:
    torch.manual_seed(0)
    eager, batched = Normed(), Normed()
    batched.load_state_dict(eager.state_dict())
    xs = [torch.randn(4, 3) for _ in range(3)]
    want = [eager.f(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [batched.f(x) for x in xs]
    assert int(batched.bn.num_batches_tracked) == 0  # recording changed nothing
    for got, w in zip(bg.compute(handles), want, strict=True):
        torch.testing.assert_close(got, w)
    assert int(batched.bn.num_batches_tracked) == int(eager.bn.num_batches_tracked) == 3
    torch.testing.assert_close(batched.bn.running_mean, eager.bn.running_mean)
    torch.testing.assert_close(batched.bn.running_var, eager.bn.running_var)


class Counting(nn.Module):
    """Counts its calls in buffers, through each way Python changes a tensor in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("by_method", torch.zeros((), dtype=torch.long))
        self.register_buffer("by_operator", torch.zeros((), dtype=torch.long))
        self.register_buffer("by_index", torch.zeros(1, dtype=torch.long))
        self.register_buffer("by_out", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.by_method.add_(1)
        self.by_operator += 1
        self.by_index[0] = self.by_index[0] + 1
        torch.add(self.by_out, 1, out=self.by_out)
        return x * 2.0


def test_in_place_changes_of_held_tensors_happen_only_when_calls_compute() -> None:
    counting = Counting()
    site = bg.batched_func(counting)
    xs = [torch.randn(3), torch.randn(2, 3), torch.randn(3)]  # two signatures
    with bg.BatchingPolicy():
        handles = [site(bg.batched_value(x)) for x in xs]
    counts = [int(b.sum()) for b in counting.buffers()]
    assert counts == [0, 0, 0, 0]
    for got, x in zip(bg.compute(handles), xs, strict=True):
        torch.testing.assert_close(got, x * 2.0)
    # Once per batched call, as documented for side effects: one per signature.
    assert [int(b.sum()) for b in counting.buffers()] == [2, 2, 2, 2]
    assert not isinstance(counting.by_operator, FakeTensor)  # `+=` rebinds: still the real one
