"""An ``nn.Sequential`` whose layers pass tuples (hidden state with token ids or a mask)
trains in a pipeline as on one device: a tuple crossing a cut reaches the next stage's
first layer as one value, as ``nn.Sequential`` hands it over."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from batchgraph.pipeline import SCHEDULE_NAMES, Pipeline

Pair = tuple[torch.Tensor, torch.Tensor]


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> Pair:
        return self.emb(ids), ids


class _Block(nn.Module):
    """Takes and returns (hidden, ids): the ids (int, no gradient) ride along."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, pair: Pair) -> Pair:
        h, ids = pair
        return torch.tanh(self.lin(h)) * (ids % 3 + 1).unsqueeze(-1), ids


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 2, dtype=torch.float64)

    def forward(self, pair: Pair) -> torch.Tensor:
        return self.out(pair[0])


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_sequential_passing_tuples_equals_single_device(schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Embed(), _Block(), _Block(), _Block(), _Head())
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 10, (9,))
    y = torch.randn(9, 2, dtype=torch.float64)
    want = nn.MSELoss()(twin(ids), y)
    want.backward()
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    with Pipeline(
        model, stages=2, microbatches=4, schedule=schedule, loss_fn=nn.MSELoss(),
        chunks=chunks, timeout=30,
    ) as pipe:  # fmt: skip
        loss = pipe.train_step(ids, y)
        out = pipe.forward(ids)
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(out, twin(ids).detach())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_tuple_batch_reaches_the_first_layer_as_one_tuple() -> None:
    # On one device an nn.Sequential takes a tuple batch as model((x, ids)).
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), _Head())
    twin = copy.deepcopy(model)
    x = torch.randn(6, 6, dtype=torch.float64)
    ids = torch.randint(0, 10, (6,))
    y = torch.randn(6, 2, dtype=torch.float64)
    nn.MSELoss()(twin((x, ids)), y).backward()
    with Pipeline(
        model, stages=3, microbatches=3, loss_fn=nn.MSELoss(), cost="profile", sample=(x, ids),
        timeout=30,
    ) as pipe:  # fmt: skip
        pipe.train_step((x, ids), y)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
