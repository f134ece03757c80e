"""Batched results and gradients equal the eager run, over generated trees and DAGs."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from batchgraph.testing import assert_batched_matches_eager
from tests.property.models import DagModel, TreeModel


def trees(max_leaves: int = 12, vocab: int = 20) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.integers(0, vocab - 1),
        lambda sub: st.tuples(sub, sub),
        max_leaves=max_leaves,
    )


def height(tree: Any) -> int:
    """Binary cells on the longest path from a leaf to the root."""
    return 0 if isinstance(tree, int) else 1 + max(height(tree[0]), height(tree[1]))


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 8) -> list[tuple[str, list[int]]]:
    size = draw(st.integers(1, max_nodes))
    dag = []
    for i in range(size):
        op = draw(st.sampled_from(DagModel.OPS))
        parents = [draw(st.integers(0, i)), draw(st.integers(0, i))]
        dag.append((op, parents))
    return dag


@given(
    batch=st.lists(trees(), min_size=1, max_size=8),
    scheduler=st.sampled_from(["agenda", "depth"]),
    dedupe=st.booleans(),
)
def test_tree_model_batched_equals_eager(batch: list[Any], scheduler: str, dedupe: bool) -> None:
    torch.manual_seed(0)
    model = TreeModel().double()
    report = assert_batched_matches_eager(
        model.logits, batch, rtol=0, atol=1e-10, scheduler=scheduler, dedupe=dedupe
    )
    assert report.gradients_compared >= 5  # cell parameters only when a tree has a pair
    assert report.stats is not None
    # The calls really batch. Per path, the embedding, leaf cell and output layer run
    # once and the binary cell once per level of the tallest tree: that is the lower
    # bound. By-depth scheduling runs one step per (depth, key): the embedding and leaf
    # cell (all leaves at one depth), the cell at each level, and the output layer once
    # per distinct tree height. Agenda scheduling runs the cell once per level too (its
    # ready calls are those of the next level) and the output layer at most once per
    # distinct height (each time it runs, it takes every finished tree), so never more;
    # it mostly reaches the bound, not always (leaves and one tree of height 2 take the
    # output layer twice).
    tallest = max(height(t) for t in batch)
    by_depth = 2 + tallest + len({height(t) for t in batch})
    assert report.stats.lower_bound == 3 + tallest
    if scheduler == "depth":
        assert report.stats.launches == by_depth
    else:
        assert 3 + tallest <= report.stats.launches <= by_depth


@given(
    examples=st.lists(dags(), min_size=1, max_size=6),
    scheduler=st.sampled_from(["agenda", "depth"]),
)
def test_dag_model_batched_equals_eager(
    examples: list[list[tuple[str, list[int]]]], scheduler: str
) -> None:
    torch.manual_seed(1)
    model = DagModel().double()
    inputs = [(torch.randn(4, dtype=torch.float64), dag) for dag in examples]
    report = assert_batched_matches_eager(
        lambda e: model.run(*e), inputs, module=model, rtol=0, atol=1e-10, scheduler=scheduler
    )
    assert report.gradients_compared >= 2  # inp.weight and inp.bias at least
    assert report.stats is not None
    assert report.stats.lower_bound <= report.stats.launches <= report.stats.nodes


@given(batch=st.lists(trees(), min_size=1, max_size=8))
def test_float32_within_1e5(batch: list[Any]) -> None:
    torch.manual_seed(2)
    model = TreeModel()
    assert_batched_matches_eager(model.logits, batch, rtol=1e-5, atol=1e-5)
