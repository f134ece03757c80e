"""An ``nn.Sequential`` whose layers pass tuples (hidden state with token ids or a mask)
trains in a pipeline as on one device: a tuple crossing a cut reaches the next stage's
first layer as one value, as ``nn.Sequential`` hands it over."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from batchgraph.pipeline import SCHEDULE_NAMES, Pipeline, StageError, StageMismatchError

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


class _One(nn.Module):
    """Returns a tuple of one tensor, as some library layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.tanh(self.lin(h)),)


class _TakeFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(6, 2, dtype=torch.float64)

    def forward(self, one: tuple[torch.Tensor]) -> torch.Tensor:
        return self.out(one[0])


@pytest.mark.parametrize("check_shapes", [True, False])
def test_a_tuple_of_one_tensor_crossing_a_cut_is_refused(check_shapes: bool) -> None:
    # Stages pass tuples of tensors, where (h,) and h are the same: the next stage's
    # _TakeFirst got h and took its first row (one[0]), a silently wrong loss.
    model = nn.Sequential(nn.Linear(6, 6, dtype=torch.float64), _One(), _TakeFirst())
    x = torch.randn(4, 6, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    error = StageMismatchError if check_shapes else StageError
    with (
        Pipeline(
            model,
            stages=3,
            microbatches=2,
            loss_fn=nn.MSELoss(),
            check_shapes=check_shapes,
            timeout=30,
        ) as pipe,  # fmt: skip
        pytest.raises(error, match=r"\(_One\) returned a tuple of one tensor"),
    ):
        pipe.train_step(x, y)
    # Inside a stage it is one device's call: no cut in between.
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), cost="uniform") as pipe:
        assert [len(m) for m in pipe.stage_modules] == [1, 2]  # type: ignore[arg-type]
        torch.testing.assert_close(pipe.forward(x), model(x))
