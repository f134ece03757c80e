"""bg.batched_value of a handle is the handle, as eagerly bg.batched_value(t) is
torch.as_tensor(t), t itself: per-example code that wraps whatever token it holds
(one it was given, one it predicted) records as it runs eagerly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


class Decoder(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.cell = nn.Embedding(7, 4), nn.GRUCell(4, 4)
        self.out = nn.Linear(4, 7)

    def decode(self, start: int, steps: int) -> list[torch.Tensor]:
        tok, h, tokens = start, torch.zeros(4), []
        for _ in range(steps):
            h = self.cell(self.embed(bg.batched_value(tok)), h)  # a handle after step 1
            tok = self.out(h).argmax()
            tokens.append(tok)
        return tokens


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=5), st.integers(1, 4))
def test_feeding_predicted_tokens_back_equals_eager(starts: list[int], steps: int) -> None:
    # Before: torch.as_tensor(handle) failed ("len() of a 0-d tensor handle") at the
    # second step, though the same code runs eagerly.
    model = Decoder()
    eager = [model.decode(s, steps) for s in starts]
    with bg.BatchingPolicy():
        handles = [model.decode(s, steps) for s in starts]
    assert bg.compute(handles) == eager  # lists of 0-d int tensors: == compares values


def test_the_handle_itself_and_moved_with_device() -> None:
    x = torch.randn(3)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 2
        assert bg.batched_value(h) is h
        moved = bg.batched_value(h, device="cpu")
    torch.testing.assert_close(bg.compute(moved), x * 2)


def test_outside_its_policy_a_handle_cannot_be_moved() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)) * 2
    with pytest.raises(bg.PolicyClosedError):
        bg.batched_value(h, device="cpu")
