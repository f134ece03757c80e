"""@bg.batched_func above a method's def binds like the function would: obj.helper(x)
is helper(obj, x), eagerly and while recording, and batches with the same values and
gradients as the eager calls."""

from __future__ import annotations

import gc
import weakref

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager


class Scorer(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)

    @bg.batched_func
    def helper(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * scale

    def score(self, x: torch.Tensor) -> torch.Tensor:
        return self.helper(x, scale=2.0).sum()


class Plain:
    """Not a module: a user's own object with a decorated method."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    @bg.batched_func
    def shift(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


class Slotted:
    __slots__ = ("factor",)

    def __init__(self, factor: float) -> None:
        self.factor = factor

    @bg.batched_func
    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 6))
def test_a_decorated_method_batches_as_eagerly(count: int) -> None:
    # Before: "helper() missing 1 required positional argument: 'x'", eagerly too.
    model = Scorer().double()
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(count)]
    report = assert_batched_matches_eager(model.score, xs, rtol=0, atol=1e-12)
    assert report.gradients_compared == 2
    assert report.stats is not None and report.stats.launches <= 2


def test_methods_of_plain_and_slotted_objects_bind_their_own_object() -> None:
    plain, other, slotted = Plain(1.0), Plain(10.0), Slotted(3.0)
    x = torch.zeros(2)
    assert torch.equal(plain.shift(x), x + 1) and torch.equal(slotted.scale(x + 1), x + 3)
    with bg.BatchingPolicy():
        hs = [plain.shift(x), other.shift(x), slotted.scale(x + 1)]
    got = bg.compute(hs)
    for g, want in zip(got, (x + 1, x + 10, x + 3)):
        torch.testing.assert_close(g, want)


def test_read_through_the_class_it_is_the_function_s_site() -> None:
    model = Scorer()
    x = torch.randn(3)
    assert Scorer.helper is Scorer.__dict__["helper"]
    torch.testing.assert_close(Scorer.helper(model, x), model.helper(x))


def test_the_site_does_not_keep_its_object_alive() -> None:
    plain = Plain(1.0)
    with bg.BatchingPolicy():
        bg.compute(plain.shift(torch.zeros(2)))
    ref = weakref.ref(plain)
    del plain
    gc.collect()
    assert ref() is None
