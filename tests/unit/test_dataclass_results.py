"""Handles in dataclass fields are computed as in lists, tuples and dicts: by compute,
in a coroutine example's result and awaited values, and through a worker's batch."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import batchgraph as bg


@dataclasses.dataclass
class Output:
    logits: Any
    length: int
    extra: list[Any] = dataclasses.field(default_factory=list)
    note: str = dataclasses.field(default="", init=False)  # not an __init__ argument


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: Any

    def __post_init__(self) -> None:  # must not run again when values replace handles
        assert not isinstance(self.value, torch.Tensor) or self.value.dim() == 1


def test_compute_replaces_handles_in_dataclass_fields() -> None:
    lin = bg.batched_func(nn.Linear(3, 2))
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy():
        outs = [Output(lin(x), i, [lin(x) * 2]) for i, x in enumerate(xs)]
        for o in outs:
            o.note = "kept"
        frozen = Frozen(lin(xs[0]))
    got = bg.compute([outs, frozen])
    for (o, x), i in zip(zip(got[0], xs, strict=True), range(3), strict=True):
        assert type(o) is Output and o.length == i and o.note == "kept"
        torch.testing.assert_close(o.logits, lin(x))
        torch.testing.assert_close(o.extra[0], lin(x) * 2)
    assert type(got[1]) is Frozen
    torch.testing.assert_close(got[1].value, lin(xs[0]))
    plain = Output(None, 1)
    assert bg.compute(plain) is plain  # no handle in it: itself


def test_coroutine_examples_return_and_await_dataclasses() -> None:
    lin = bg.batched_func(nn.Linear(3, 3))
    xs = [torch.randn(3) for _ in range(4)]

    async def example(x: Any) -> Output:
        first = await bg.value(Frozen(lin(x)))  # awaited inside a dataclass
        assert isinstance(first.value, torch.Tensor)
        return Output(lin(first.value), 7)  # returned uncomputed

    results = bg.run_all([example(x) for x in xs])
    for r, x in zip(results, xs, strict=True):
        assert type(r) is Output and r.length == 7
        torch.testing.assert_close(r.logits, lin(lin(x)))


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def run(self, item: list[float]) -> Output:
        return Output(self.lin(bg.batched_value(torch.tensor(item))), len(item))


def test_a_worker_batch_of_dataclass_results_binds_to_values() -> None:
    model = Model()
    items = [[1.0, 2.0], [0.0, -1.0]]
    got = bg.bind(bg.GraphCollate(model, "run")(items), model)
    for o, item in zip(got, items, strict=True):
        assert type(o) is Output and o.length == 2
        torch.testing.assert_close(o.logits, model.lin(torch.tensor(item)))
