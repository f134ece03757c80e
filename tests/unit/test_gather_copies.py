"""Launch and byte counts of the executor's gathers (in the style of tinygrad's
kernel-count tests).

Results stay right whether a batched input is passed as a view of the stored value
or copied out of it first, so only counts catch a gather that copies what it could
view. ``GatherCopies`` counts the copying ops (``index_select``, ``cat``, ``stack``,
``index``) that ``batchgraph/executor.py`` issues itself, with the bytes each writes:
the calls' own ops run from ``keys.py`` and below, handing values out from
``graph.py``, so neither is counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import batchgraph as bg
from batchgraph import executor
from batchgraph.testing import assert_batched_matches_eager
from tests.property.decoder_models import make_decoder, run_eagerly
from tests.property.models import TreeModel
from tests.unit.test_scheduling import _fixed_trees

COPYING = frozenset({"index_select", "cat", "stack", "index"})
_EXECUTOR = executor.__file__
_TORCH = torch.__file__.rsplit("/", 1)[0]


class GatherCopies(TorchDispatchMode):
    """Counts the copying ops the executor makes, and the bytes they write, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPYING and self._from_executor():
            self.launches[name] += 1
            self.bytes[name] += out.numel() * out.element_size()
        return out

    @staticmethod
    def _from_executor() -> bool:
        # The first frame outside torch is the code that issued the op (tensor
        # methods and torch functions are C, so they add no frame of their own).
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename == _EXECUTOR


class Chain(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4).double()
        self.second = torch.nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> Any:
        return self.second(torch.tanh(self.first(x)))


def test_a_chain_of_calls_over_a_batch_passes_each_output_on_as_is() -> None:
    # Every call takes all rows of the step before, in order: no gather copies a row.
    model = Chain()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(8)]
    with GatherCopies() as counts:
        report = assert_batched_matches_eager(model, xs, module=model, rtol=1e-12, atol=1e-12)
    assert report.stats is not None and report.stats.launches == 3
    assert report.gradients_compared == 4
    assert counts.launches == {}


class Projections(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(4, 4).double() for _ in range(3))

    def forward(self, x: torch.Tensor) -> Any:
        return self.q(x) * self.k(x) + self.v(x)


def test_projections_of_one_input_each_read_it_in_place() -> None:
    # q, k and v read the same batched input, and the * and + the projections: each
    # a view. Copying what the next calls still need into a carried pool at each
    # gather cost 3 cats and 4 index_selects (152 rows) for 8 examples.
    model = Projections()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(8)]
    with GatherCopies() as counts:
        report = assert_batched_matches_eager(model, xs, module=model, rtol=1e-12, atol=1e-12)
    assert report.stats is not None and report.stats.launches == 5
    assert report.gradients_compared == 6
    assert counts.launches == {}


def test_a_treelstm_batch_gathers_each_level_with_one_cat_and_one_select() -> None:
    # The 32 fixed trees of the pinned launch counts: 20 distinct leaves, 8 levels of
    # BinaryCell calls (91, 67, 45, 29, 20, 15, 7, 3 nodes), 32 roots. The embedding
    # and the leaf cell take the step before whole (views); each cell level and the
    # output layer gather with one cat of their sources (the carried rows, the level
    # before's h and c) and one index_select of the rows they need and carry.
    model = TreeModel()
    with GatherCopies() as counts:
        report = assert_batched_matches_eager(model.logits, _fixed_trees(32, seed=7))
    assert report.stats is not None and report.stats.launches == 11
    assert report.gradients_compared == len(list(model.parameters()))
    assert counts.launches == {"cat": 9, "index_select": 9}
    cell_inputs, roots, carried = 4 * (91 + 67 + 45 + 29 + 20 + 15 + 7 + 3), 32, 462
    row = 6 * 4  # float32
    assert counts.bytes == {"cat": 1056 * row,
                            "index_select": (cell_inputs + roots + carried) * row}


def _decode(
    model: Any, lengths: list[int], vocab: int
) -> list[Coroutine[Any, Any, list[Any]]]:
    """Example i (of 5 at most) runs ``lengths[i]`` steps (5 at most) of a GRU decoder
    and returns each step's logits. Its token at step t is ``(i + 5 * t) % vocab``:
    with ``vocab=1`` every example embeds token 0 (one merged call); with 25, each
    call a token of its own (an embedding merged with an earlier step's would be a
    row of an older store)."""

    async def example(i: int) -> list[Any]:
        h = bg.batched_value(torch.full((6,), 0.1 * i, dtype=torch.float64))
        logits = []
        for t in range(lengths[i]):
            h = model.cell(model.embed(bg.batched_value((i + 5 * t) % vocab)), h)
            logits.append(await bg.value(model.out(h)))
        return logits

    return [example(i) for i in range(len(lengths))]


def _decoder_copies(lengths: list[int], vocab: int = 25) -> GatherCopies:
    """The gather copies of a batched decode, whose logits and gradients must equal eager."""
    model = make_decoder(0, vocab=25)
    eager = [run_eagerly(c) for c in _decode(model, lengths, vocab)]
    with GatherCopies() as counts:
        got = bg.run_all(_decode(model, lengths, vocab))
    assert [len(g) for g in got] == lengths
    weights = [[torch.rand(25, dtype=torch.float64) for _ in range(n)] for n in lengths]
    grads = []
    for run in (eager, got):
        model.zero_grad()
        loss = sum((w * x).sum() for ws, xs in zip(weights, run, strict=True)
                   for w, x in zip(ws, xs, strict=True))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert len(grads[0]) == len(list(model.parameters()))
    for g, e in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    return counts


def test_a_decoder_step_after_the_last_examples_ended_takes_views_only() -> None:
    # Examples end last-first, so the ones still running are always the first rows of
    # the step before. The GRU cell's two inputs (this step's embeddings, the running
    # rows of the last state) are each a view: no cat of the two to split again.
    counts = _decoder_copies([5, 4, 3, 2])
    assert counts.launches == {}


def test_a_decoder_step_after_a_middle_example_ended_copies_the_running_rows_only() -> None:
    # Example 1 ends first: the second step's running states are rows (0, 2, 3) of
    # the first step's, taken by one index_select of those rows alone (not a cat of
    # the embeddings and the whole state, then a select of both); later steps' are
    # the first rows of the step before (views).
    counts = _decoder_copies([4, 1, 3, 2])
    assert counts.launches == {"index_select": 1}
    assert counts.bytes == {"index_select": 3 * 6 * 8}


def test_a_decoder_whose_examples_share_one_embedding_selects_each_input_alone() -> None:
    # Every example embeds token 0: one merged call, whose row each GRU input
    # repeats. Each step takes x by one index_select of that row and h as a view of
    # the running examples' states, or, after example 1 ended (rows 0, 2, 3), by one
    # index_select of those rows: never a cat of the embedding and the states, then a
    # select of both. The last step's single rows are views.
    counts = _decoder_copies([4, 1, 3, 2], vocab=1)
    assert counts.launches == {"index_select": 1 + 2 + 1}
    assert counts.bytes == {"index_select": (4 + 3 + 3 + 2) * 6 * 8}


@given(st.lists(st.integers(1, 5), min_size=1, max_size=5), st.sampled_from([1, 2, 25]))
def test_decoders_gather_each_step_with_two_launches_at_most(
    lengths: list[int], vocab: int
) -> None:
    # Whichever examples end when, the GRU inputs of each step after the first (the
    # last states of the running examples) are taken by two launches at most. With
    # tokens of their own (vocab 25) the embeddings are a view and the states a view
    # or one index_select: never a cat. With one token, an index_select of its row;
    # with two, embeddings also merge with an earlier step's (rows of two stores).
    counts = _decoder_copies(lengths, vocab)
    assert sum(counts.launches.values()) <= 2 * (max(lengths) - 1) + 2
    if vocab == 25:
        assert set(counts.launches) <= {"index_select"}
        assert counts.launches["index_select"] <= max(lengths) - 1
    if vocab == 1:
        assert "cat" not in counts.launches


def test_three_inputs_from_older_stores_with_a_hole_share_one_cat() -> None:
    # a, b and c of the 4 examples come from three stores of the first compute; the
    # second step runs examples 0, 2 and 3 only. Each input's rows (0, 2, 3) would
    # need a select of its own (3 launches): the three stores join one cat whole
    # (views) and one index_select takes the 9 rows, 2 launches. Values and weighted
    # gradients must equal eager.
    torch.manual_seed(0)
    lins = [torch.nn.Linear(6, 6).double() for _ in range(3)]
    xs = [torch.randn(6, dtype=torch.float64) for _ in range(4)]
    counts = GatherCopies()
    first_compute: list[Counter[str]] = []

    async def example(i: int, la: Any, lb: Any, lc: Any, mix: Any) -> list[Any]:
        a, b, c = la(xs[i]), lb(xs[i]), lc(xs[i])
        first = await bg.value(a + b + c)
        if i == 0:
            first_compute.extend([counts.launches.copy(), counts.bytes.copy()])
        if i == 1:
            return [first]
        return [first, await bg.value(mix(a, b, c))]

    eager = [run_eagerly(example(i, *lins, torch.addcmul)) for i in range(4)]
    batched = [bg.batched_func(m) for m in lins]
    first_compute.clear()
    with counts:
        got = bg.run_all([example(i, *batched, bg.batched_func(torch.addcmul))
                          for i in range(4)])
    assert [len(g) for g in got] == [2, 1, 2, 2]
    flat_got = [v for values in got for v in values]
    flat_eager = [v for values in eager for v in values]
    params = [p for m in lins for p in m.parameters()]
    grads = []
    for run in (flat_eager, flat_got):
        for p in params:
            p.grad = None
        sum((i + 1) * v.sum() for i, v in enumerate(run)).backward()
        grads.append([p.grad for p in params])
    for g, e in zip([*flat_got, *grads[1]], [*flat_eager, *grads[0]], strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    launches, written = first_compute
    assert counts.launches - launches == {"cat": 1, "index_select": 1}
    assert counts.bytes - written == {"cat": 3 * 4 * 6 * 8, "index_select": 3 * 3 * 6 * 8}
