"""Hypothesis strategies for property tests of batched code: trees and DAGs.

Needs ``hypothesis`` (the ``test`` extra). Typical use — batched equals eager over
generated inputs::

    from hypothesis import given, strategies as st
    from batchgraph.testing.strategies import trees

    @given(st.lists(trees(max_leaves=10, vocab_size=20), min_size=1, max_size=8))
    def test_batched_equals_eager(batch):
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hypothesis import strategies as st

from batchgraph.data.trees import Nested, Tree

__all__ = ["DagNode", "DagSpec", "dags", "trees"]

T = TypeVar("T")


def trees(
    max_leaves: int = 12, vocab_size: int = 20, labels: int | None = None
) -> st.SearchStrategy[Tree]:
    """Binary ``Tree``s with 1 to ``max_leaves`` leaves and tokens in ``range(vocab_size)``.

    Shapes range over all bracketings (left- and right-deep chains, balanced trees,
    single leaves); hypothesis shrinks failures towards small trees with token 0.

    Args:
        max_leaves: the largest number of leaves a tree may have (>= 1).
        vocab_size: tokens are drawn from ``range(vocab_size)`` (>= 1).
        labels: if given, each root gets a label from ``range(labels)``; else ``None``.

    Returns:
        A strategy of ``Tree``.

    Raises:
        ValueError: for ``max_leaves``, ``vocab_size`` or ``labels`` below 1.

    Example:
        >>> from hypothesis import given
        >>> @given(trees(max_leaves=5, vocab_size=3))
        ... def check(tree):
        ...     assert 1 <= tree.num_leaves <= 5 and max(tree.tokens()) < 3
        >>> check()
    """
    if max_leaves < 1 or vocab_size < 1 or (labels is not None and labels < 1):
        raise ValueError(
            "max_leaves, vocab_size and labels must be >= 1, got "
            f"max_leaves={max_leaves}, vocab_size={vocab_size}, labels={labels}"
        )
    nested: st.SearchStrategy[Nested] = st.recursive(
        st.integers(0, vocab_size - 1),
        lambda sub: st.tuples(sub, sub),
        max_leaves=max_leaves,
    )
    label: st.SearchStrategy[int | None] = (
        st.none() if labels is None else st.integers(0, labels - 1)
    )
    return st.builds(Tree.from_nested, nested, label)


@dataclass(frozen=True)
class DagNode:
    """One node of a ``DagSpec``: an operation name and the nodes it reads.

    Attributes:
        op: ``"input"`` for a source, else one of the ``ops`` given to ``dags``.
        parents: indices of earlier nodes (empty for inputs; may repeat an index).
    """

    op: str
    parents: tuple[int, ...]


@dataclass(frozen=True)
class DagSpec:
    """A small DAG in topological order: node ``i`` reads only nodes ``< i``.

    Attributes:
        nodes: the nodes; the first ``inputs`` are sources (``op == "input"``).
        inputs: how many source nodes there are.
        outputs: indices of the requested nodes (sorted, non-empty).
    """

    nodes: tuple[DagNode, ...]
    inputs: int
    outputs: tuple[int, ...]

    def children(self) -> list[list[int]]:
        """For each node, the nodes that read it (each reader once, ascending)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for p in sorted(set(node.parents)):
                out[p].append(i)
        return out

    def depths(self) -> list[int]:
        """Longest path from a source to each node (sources have depth 0)."""
        depth: list[int] = []
        for node in self.nodes:
            depth.append(1 + max(depth[p] for p in node.parents) if node.parents else 0)
        return depth

    def needed(self) -> set[int]:
        """Nodes some output depends on (the outputs included); the rest are dead."""
        seen: set[int] = set()
        stack = list(self.outputs)
        while stack:
            i = stack.pop()
            if i not in seen:
                seen.add(i)
                stack.extend(self.nodes[i].parents)
        return seen

    def run(self, inputs: Sequence[T], apply: Callable[[str, list[T]], T]) -> list[T]:
        """Evaluate the DAG: ``apply(op, parent_values)`` per node, in order.

        The same ``apply`` runs eagerly on tensors or, inside a policy, on handles, so
        one DAG gives both sides of a batched-equals-eager test.

        Args:
            inputs: one value per source node.
            apply: computes a node's value from its op and its parents' values.

        Returns:
            The values of the ``outputs``, in ``outputs`` order.

        Raises:
            ValueError: if ``len(inputs)`` is not ``self.inputs``.

        Example:
            >>> dag = DagSpec((DagNode("input", ()), DagNode("add", (0, 0))), 1, (1,))
            >>> dag.run([3], lambda op, xs: sum(xs))
            [6]
        """
        if len(inputs) != self.inputs:
            raise ValueError(f"the DAG has {self.inputs} inputs, got {len(inputs)} values")
        values: list[T] = list(inputs)
        for node in self.nodes[self.inputs :]:
            values.append(apply(node.op, [values[p] for p in node.parents]))
        return [values[i] for i in self.outputs]


@st.composite
def dags(
    draw: st.DrawFn,
    max_nodes: int = 10,
    max_inputs: int = 2,
    max_parents: int = 2,
    ops: Sequence[str] = ("unary", "binary"),
    dead_nodes: bool = False,
) -> DagSpec:
    """Random DAG descriptions (``DagSpec``) for property tests of a batching core.

    Each non-source node gets an op from ``ops`` and 1 to ``max_parents`` parents drawn
    from earlier nodes (repeats allowed, so ``x + x`` shapes appear). Every node that
    no other node reads is an output, plus a random selection of the others; with
    ``dead_nodes=True`` outputs are any non-empty selection, so some nodes may be
    needed by no output (for testing pruning).

    Args:
        max_nodes: the most nodes in all, inputs included (>= 2).
        max_inputs: the most source nodes (>= 1).
        max_parents: the most parents of a node (>= 1).
        ops: op names to draw from (non-empty; ``"input"`` is reserved).
        dead_nodes: allow nodes that no output needs.

    Returns:
        A strategy of ``DagSpec``.

    Example:
        >>> from hypothesis import given
        >>> @given(dags(max_nodes=6))
        ... def check(dag):
        ...     assert all(p < i for i, n in enumerate(dag.nodes) for p in n.parents)
        ...     assert dag.needed() == set(range(len(dag.nodes)))  # no dead nodes
        >>> check()
    """
    if max_nodes < 2 or max_inputs < 1 or max_parents < 1 or not ops or "input" in ops:
        raise ValueError(
            "dags needs max_nodes >= 2, max_inputs >= 1, max_parents >= 1 and a non-empty "
            f"ops without 'input'; got max_nodes={max_nodes}, max_inputs={max_inputs}, "
            f"max_parents={max_parents}, ops={tuple(ops)!r}"
        )
    inputs = draw(st.integers(1, min(max_inputs, max_nodes - 1)))
    size = draw(st.integers(inputs + 1, max_nodes))
    nodes = [DagNode("input", ()) for _ in range(inputs)]
    for i in range(inputs, size):
        arity = draw(st.integers(1, max_parents))
        parents = tuple(draw(st.integers(0, i - 1)) for _ in range(arity))
        nodes.append(DagNode(draw(st.sampled_from(list(ops))), parents))
    read = {p for node in nodes for p in node.parents}
    extra = draw(st.sets(st.integers(0, size - 1), max_size=size))
    if dead_nodes:
        outputs = extra or {size - 1}
    else:
        outputs = extra | {i for i in range(size) if i not in read}
    return DagSpec(tuple(nodes), inputs, tuple(sorted(outputs)))
