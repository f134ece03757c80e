"""A bound batch computes with the live model as eager code does: the model's own tensors
the per-example code used, the grad mode it turned off, and submodules replaced since."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


class Decoder(bg.BatchedModule):
    """Uses its own parameter and buffers directly, not only through submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.h0 = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.cell = nn.GRUCell(3, 4).double()
        self.register_buffer("scale", torch.full((4,), 2.0, dtype=torch.float64))
        self.register_buffer("shift", torch.full((4,), -0.5, dtype=torch.float64))

    def decode(self, xs: list[list[float]]) -> Any:
        h = self.h0
        for x in xs:
            h = self.cell(bg.batched_value(torch.tensor(x, dtype=torch.float64)), h)
        zeros = torch.zeros(4, dtype=torch.float64)  # a real constant equal to nothing here
        return h * self.scale + self.shift + zeros

    def first(self, xs: list[list[float]]) -> Any:
        return self.decode(xs) + self.h0[0]  # a view taken in the per-example code

    def first_of_handle(self, xs: list[list[float]]) -> Any:
        return self.decode(xs) + bg.batched_value(self.h0)[0]


ITEMS = [[[1.0, 2.0, 3.0]], [[0.5, 0.5, 0.5], [1.0, 0.0, -1.0]], [[0.0, 1.0, 0.0]]]


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def eager_and_bound(model: nn.Module, method: str, collate: bg.GraphCollate) -> None:
    weights = [torch.rand(4, dtype=torch.float64) for _ in ITEMS]
    model.zero_grad()
    eager = [getattr(model, method)(x) for x in ITEMS]
    sum((e * w).sum() for e, w in zip(eager, weights)).backward()
    expected = grads(model)
    model.zero_grad()
    bound = bg.bind(collate(ITEMS), model)
    sum((b * w).sum() for b, w in zip(bound, weights)).backward()
    for e, b in zip(eager, bound):
        torch.testing.assert_close(b, e, rtol=0, atol=1e-12)
    got = grads(model)
    for name, e_grad in expected.items():
        assert e_grad is not None and got[name] is not None, name
        torch.testing.assert_close(got[name], e_grad, rtol=0, atol=1e-12)


def test_parameters_and_buffers_used_directly_are_read_from_the_live_model() -> None:
    # Before, the worker's weightless placeholders (zeros) were exported as constants:
    # h0, scale and shift computed as zeros, h0 got no gradient, and the small
    # placeholders were merged by value with each other and the real zeros.
    torch.manual_seed(0)
    model = Decoder()
    collate = bg.GraphCollate(model, "decode")
    eager_and_bound(model, "decode", collate)
    batch = collate(ITEMS)
    assert sorted(set(batch.model_tensors.values())) == ["h0", "scale", "shift"]
    # Read at bind time: a buffer changed since (and an optimizer step) counts.
    with torch.no_grad():
        model.scale.fill_(3.0)
        model.h0.add_(1.0)
    eager_and_bound(model, "decode", collate)


def test_indexing_a_handle_of_a_parameter_records_it() -> None:
    torch.manual_seed(1)
    model = Decoder()
    eager_and_bound(model, "first_of_handle", bg.GraphCollate(model, "first_of_handle"))


def test_a_view_of_a_placeholder_is_refused_at_export() -> None:
    model = Decoder()
    with pytest.raises(
        ValueError,
        match=r"constant node \d+ \(shape \(\)\) was computed in the worker from a weightless "
        r"placeholder.*self\.h0\[0\].*bg\.batched_value\(self\.h0\)\[0\]",
    ):
        bg.GraphCollate(model, "first")(ITEMS)


def test_a_placeholder_computed_from_in_the_worker_reads_nan_not_zeros() -> None:
    model = Decoder()

    def doubled(m: Decoder, xs: list[list[float]]) -> Any:
        return m.decode(xs) * (m.h0 * 2)  # a new tensor from a placeholder: not live

    bound = bg.bind(bg.GraphCollate(model, doubled)(ITEMS), model)
    assert all(torch.isnan(b).all() for b in bound)


def test_a_live_tensor_of_another_shape_is_refused_before_computing() -> None:
    model = Decoder()
    batch = bg.GraphCollate(model, "decode")(ITEMS)
    model.shift = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(
        bg.ScheduleMismatchError,
        match=r"reads the model's tensor 'shift' as \(4,\) float64.* but it is \(5,\) "
        r"torch\.float64 in the live model",
    ):
        bg.bind(batch, model)
    del model.shift
    with pytest.raises(bg.ScheduleMismatchError, match=r"has no tensor of that name"):
        bg.bind(batch, model)


class Frozen(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def logits(self, x: list[float]) -> Any:
        with torch.no_grad():  # a frozen encoder, as eager code writes it
            e = self.enc(bg.batched_value(torch.tensor(x)))
        return self.head(torch.tanh(e))


def test_calls_recorded_under_no_grad_run_without_grad_when_bound() -> None:
    # Before, the grad mode was dropped on export: the encoder got gradients that eager
    # code never gives it.
    torch.manual_seed(2)
    model = Frozen()
    items = [[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]]
    batch = bg.GraphCollate(model, "logits")(items)
    bound = bg.bind(batch, model, stack=True)
    bound.sum().backward()
    assert model.enc.weight.grad is None and model.head.weight.grad is not None
    assert set(batch.key_grad.values()) == {False}
    expected = model.head.weight.grad.clone()
    model.zero_grad()
    torch.stack([model.logits(x) for x in items]).sum().backward()
    torch.testing.assert_close(model.head.weight.grad, expected)
    # The recording's own mode is not kept: bound under no_grad, nothing records.
    with torch.no_grad():
        assert not bg.bind(batch, model, stack=True).requires_grad
    with torch.inference_mode():
        assert bg.bind(batch, model, stack=True).is_inference()


def test_a_submodule_replaced_after_a_batch_was_bound_is_used_by_the_next() -> None:
    # Before, the binder's cached key kept the old module: the new head's parameters
    # were neither used nor given gradients.
    torch.manual_seed(3)
    model = Frozen()
    collate = bg.GraphCollate(model, "logits")
    items = [[1.0, 2.0, 3.0], [0.5, -1.0, 2.0]]
    binder = bg.Binder(model)
    binder.run(collate(items))
    model.head = nn.Linear(4, 2)
    bound = torch.stack(binder.run(collate(items)))
    torch.testing.assert_close(bound, torch.stack([model.logits(x) for x in items]))
    bound.sum().backward()
    assert model.head.weight.grad is not None
    model.head = nn.Linear(4, 3)  # another shape: checked again, and refused
    with pytest.raises(bg.ScheduleMismatchError, match=r"returns \(3,\) float32 on cpu per example"):
        binder.run(collate(items))


def test_stacking_a_batch_whose_examples_were_all_skipped_says_so() -> None:
    # Before: "needs every example's output to be one tensor of the same per-example
    # shape", about a batch with no outputs at all.
    model = Frozen()

    def failing(m: Frozen, x: list[float]) -> Any:
        raise ValueError(f"bad example {x}")

    batch = bg.GraphCollate(model, failing, skip_errors=True)([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    assert bg.bind(batch, model) == []
    with pytest.raises(
        ValueError,
        match=r"stack=True on a batch with no examples: all 2 of its examples were skipped "
        r"\(the first: example 0, dataset index 0: ValueError: bad example \[1.0, 2.0, 3.0\]\)"
        r"\. Check len\(batch\)",
    ):
        bg.bind(batch, model, stack=True)
    with pytest.raises(ValueError, match=r"with no examples: it was made from no examples"):
        bg.bind(bg.GraphCollate(model, "logits")([]), model, stack=True)


class Shifter(bg.BatchedModule):
    """Uses an integer buffer directly, next to a real integer constant of zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("offset", torch.tensor([1, 2, 3]))
        self.embed = nn.Embedding(8, 2).double()

    def lookup(self, tokens: list[int]) -> Any:
        zeros = torch.zeros(3, dtype=torch.long)  # equal to a placeholder (which reads 0)
        picked = self.embed(bg.batched_value(torch.tensor(tokens)) + self.offset)
        return picked + self.embed(bg.batched_value(torch.tensor(tokens)) + zeros)


def test_an_integer_placeholder_is_not_merged_with_an_equal_constant() -> None:
    # Integer placeholders read 0: in the worker, the buffer was merged by value with the
    # real zeros, so one of the two computed with the other's values once bound.
    model = Shifter()
    items = [[0, 1, 2], [4, 3, 2]]
    bound = bg.bind(bg.GraphCollate(model, "lookup")(items), model)
    for b, tokens in zip(bound, items, strict=True):
        torch.testing.assert_close(b, model.lookup(tokens), rtol=0, atol=0)


class InPlace(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.act = nn.ReLU(inplace=True)

    def run(self, x: list[float]) -> Any:
        return self.act(self.lin(bg.batched_value(torch.tensor(x))))


def test_in_place_calls_on_handles_in_a_worker_batch_bind_to_eager_values() -> None:
    # Recorded on a copy (batchgraph.on_copy): the batch names the in-place layer and
    # the main process runs it on a copy too.
    torch.manual_seed(0)
    model = InPlace()
    items = [[1.0, -2.0, 3.0], [0.0, 1.0, 2.0], [-1.0, -1.0, 5.0]]
    batch = bg.GraphCollate(model, "run")(items)
    for _ in range(2):  # the second bind reuses the checked keys
        got = bg.bind(batch, model)
        for g, item in zip(got, items, strict=True):
            torch.testing.assert_close(g, model.run(item))
