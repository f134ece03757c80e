"""RowwiseKey: row-wise modules over sequences of any lengths run as one call."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager


class RowMLP(nn.Module):
    """Linear, LayerNorm, tanh, Linear: each row on its own."""

    batch_key = bg.RowwiseKey

    def __init__(self, d: int = 3, h: int = 5, out: int = 2) -> None:
        super().__init__()
        self.a = nn.Linear(d, h)
        self.norm = nn.LayerNorm(h)
        self.b = nn.Linear(h, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.tanh(self.norm(self.a(x))))
        return out


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=7))
def test_mlp_over_any_lengths_is_one_launch(lengths: list[int]) -> None:
    # Lengths include 0 (eagerly a Linear takes 0 rows) and repeats; one launch for
    # all of them, values and weighted gradients as eager, inputs' gradients too.
    torch.manual_seed(len(lengths))
    model = RowMLP().double()
    mlp = bg.batched_func(model)
    xs = [torch.randn(n, 3, dtype=torch.float64, requires_grad=True) for n in lengths]
    report = assert_batched_matches_eager(mlp, xs, module=model, rtol=0, atol=1e-10)
    assert report.gradients_compared == len(list(model.parameters())) + len(xs)
    assert report.stats is not None and report.stats.launches == 1


def test_embedding_ids_through_the_policy_rules() -> None:
    # (T,) word ids: T rows of one value each, the common case; nn.Embedding and
    # nn.Linear by type, one launch each for five lengths.
    embed, proj = nn.Embedding(20, 4).double(), nn.Linear(4, 3).double()
    e, p = bg.batched_func(embed), bg.batched_func(proj)
    ids = [torch.randint(0, 20, (n,)) for n in (4, 1, 7, 0, 2)]
    rules = {nn.Embedding: bg.RowwiseKey, nn.Linear: bg.RowwiseKey}
    report = assert_batched_matches_eager(
        lambda x: p(e(x)), ids, module=nn.ModuleList([embed, proj]), rtol=0, atol=1e-10,
        rules=rules,
    )
    assert report.gradients_compared == 3
    assert report.stats is not None and report.stats.launches == 2
    # The default keys: one launch per distinct length and module.
    with bg.BatchingPolicy() as policy:
        bg.compute([p(e(x)) for x in ids])
    assert policy.stats is not None and policy.stats.launches == 10


def test_two_row_inputs_tuple_output_and_static_argument() -> None:
    # An elementwise function of two (T, F) inputs with a static scale, returning a
    # tuple (one part a plain tensor, one a rows view): every part split back.
    def gate(x: torch.Tensor, y: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
        return x * torch.sigmoid(y) * scale, (x - y)[:, :2]

    f = bg.batched_func(gate)
    cases = [(torch.randn(n, 3, dtype=torch.float64, requires_grad=True),
              torch.randn(n, 3, dtype=torch.float64, requires_grad=True)) for n in (2, 5, 3)]
    report = assert_batched_matches_eager(
        lambda c: f(c[0], c[1], 0.5), cases, rtol=0, atol=1e-12, rules={gate: bg.RowwiseKey}
    )
    assert report.gradients_compared == 6
    assert report.stats is not None and report.stats.launches == 1
    # A different static value does not batch with these.
    with bg.BatchingPolicy(rules={gate: bg.RowwiseKey}) as policy:
        bg.compute([f(x, y, s) for (x, y), s in zip(cases, (0.5, 2.0, 0.5))])
    assert policy.stats is not None and policy.stats.launches == 2


def test_rows_of_unequal_lengths_in_one_call_are_refused_where_recorded() -> None:
    f = bg.batched_func(lambda x, y: x + y)
    with (bg.BatchingPolicy(rules={f: bg.RowwiseKey}),
          pytest.raises(bg.ShapeMismatchError, match="same leading length")):
        f(torch.randn(3, 2), torch.randn(2))  # a (2,) vector has no rows


def test_zero_dim_inputs_are_refused_where_recorded() -> None:
    lookup = bg.batched_func(nn.Embedding(5, 2))
    with (bg.BatchingPolicy(rules={nn.Embedding: bg.RowwiseKey}),
          pytest.raises(bg.ShapeMismatchError, match="0-d")):
        lookup(torch.tensor(3))


@pytest.mark.parametrize(("fn", "shape", "says"), [
    (lambda x: x.sum(0), (3, 4), r"output 0 has shape \(4,\) for 3 rows and \(4,\) for 4"),
    (nn.Linear(4, 2), (4,), "given 5 rows where the call has 4, it raised"),
])
def test_callables_without_rows_are_refused_where_recorded(
    fn: object, shape: tuple[int, ...], says: str
) -> None:
    # A reduction over the rows, and a per-example vector into a Linear (4 rows of
    # one value to RowwiseKey): both run alone, neither batches by rows.
    f = bg.batched_func(fn)
    with (bg.BatchingPolicy(rules={f: bg.RowwiseKey}),
          pytest.raises(bg.ShapeMismatchError, match=says)):
        f(torch.randn(shape))


def test_a_module_mixing_rows_is_caught_on_its_first_batch() -> None:
    # Centering over the sequence keeps the shape: only values tell it mixes rows.
    class Center(nn.Module):
        batch_key = bg.RowwiseKey

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x - x.mean(0)

    f = bg.batched_func(Center())
    with bg.BatchingPolicy():
        hs = [f(torch.randn(n, 3)) for n in (2, 4)]
    with pytest.raises(bg.BatchedCallError, match="mixes the rows"):
        bg.compute(hs)


def test_the_row_check_runs_once_and_outside_the_stats() -> None:
    calls: list[int] = []

    class Counted(RowMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.shape[0])
            return super().forward(x)

    f = bg.batched_func(Counted())
    for _ in range(2):
        with bg.BatchingPolicy() as policy:
            bg.compute([f(torch.randn(n, 3)) for n in (2, 4, 1)])
        assert policy.stats is not None and policy.stats.launches == 1
    # Recording infers each new length's shape on fake tensors (2, 4, 1), and at the
    # first RowwiseKey checks the rows at 2 and one more (2, 3); the first batch
    # checks two examples alone (2, 4) after its one call (7); the second batch
    # makes its one call only.
    assert calls == [2, 2, 3, 4, 1, 7, 2, 4, 7]


def test_dropout_in_training_is_not_taken_for_mixing() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5))
    f = bg.batched_func(model)
    with bg.BatchingPolicy(rules={nn.Sequential: bg.RowwiseKey}) as policy:
        hs = [f(torch.randn(n, 3)) for n in (2, 5)]
    assert [tuple(o.shape) for o in bg.compute(hs)] == [(2, 4), (5, 4)]
    assert policy.stats is not None and policy.stats.launches == 1


def test_not_chosen_by_default() -> None:
    lin = bg.batched_func(nn.Linear(3, 2))
    with bg.BatchingPolicy() as policy:
        bg.compute([lin(torch.randn(n, 3)) for n in (2, 3)])
    assert policy.stats is not None and policy.stats.launches == 2


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6),
       st.sampled_from(["agenda", "depth"]))
def test_a_chain_of_rowwise_calls_with_ids_pairs_and_tuples(
    lengths: list[int], scheduler: str
) -> None:
    # ids -> embedding, a two-input gate returning a tuple, a Linear on one part and
    # the sum of both: three RowwiseKey calls and one elementwise add per example,
    # whatever the lengths (0 included); values and weighted gradients as eager.
    torch.manual_seed(sum(lengths))
    embed, proj = nn.Embedding(9, 4).double(), nn.Linear(4, 4).double()
    e, p = bg.batched_func(embed), bg.batched_func(proj)

    def pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(x) * y, x - y

    g = bg.batched_func(pair)

    def per_example(ids: torch.Tensor) -> object:
        x = e(ids)
        a, b = g(x, p(x))
        return p(a) + b

    ids = [torch.randint(0, 9, (n,)) for n in lengths]
    rules = {nn.Embedding: bg.RowwiseKey, nn.Linear: bg.RowwiseKey, pair: bg.RowwiseKey}
    report = assert_batched_matches_eager(
        per_example, ids, module=nn.ModuleList([embed, proj]), rtol=0, atol=1e-10,
        rules=rules, scheduler=scheduler,
    )
    assert report.gradients_compared == 3
    distinct = len(set(lengths))  # the add batches by shape, as by default
    assert report.stats is not None and report.stats.launches == 4 + distinct


def test_a_batch_whose_output_loses_rows_fails_when_it_runs() -> None:
    # Row-wise at each length it was recorded with (and one more), but not at the
    # batch's 9 rows: the split refuses rather than hand out wrong rows.
    f = bg.batched_func(lambda x: x[:1] if x.shape[0] > 8 else x * 2)
    with bg.BatchingPolicy(rules={f: bg.RowwiseKey}):
        hs = [f(torch.randn(n, 2)) for n in (3, 6)]
    with pytest.raises(bg.BatchedCallError, match=r"returned a \(1, 2\) tensor for 2 "):
        bg.compute(hs)
