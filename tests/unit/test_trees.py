"""Tree data: the Tree type, the stdlib AST data set and the SST-like random trees."""

from __future__ import annotations

import ast
import statistics

import pytest
from hypothesis import given

from batchgraph.data import (
    SST_MAX_LEAVES,
    InvalidTreeError,
    Nested,
    Tree,
    Vocab,
    ast_tree,
    sst_like_trees,
    stdlib_function_trees,
)
from batchgraph.testing.strategies import trees


# -- Tree --------------------------------------------------------------------------------
def test_tree_counts_and_order() -> None:
    t = Tree.from_nested(((1, 2), (3, (4, 5))), label=3)
    assert (t.size, t.depth, t.num_leaves, t.label) == (9, 3, 5, 3)
    assert t.tokens() == [1, 2, 3, 4, 5]
    assert [n.size for n in t.nodes()] == [1, 1, 3, 1, 1, 1, 3, 5, 9]  # post-order
    assert t.left is not None and t.left.label is None


@given(trees(max_leaves=16, vocab_size=7, labels=3))
def test_tree_nested_round_trip(tree: Tree) -> None:
    again = Tree.from_nested(tree.to_nested(), label=tree.label)
    assert again == tree and hash(again) == hash(tree)
    assert tree.size == 2 * tree.num_leaves - 1
    assert tree.num_leaves == len(tree.leaves()) <= 16
    assert tree.depth >= (tree.num_leaves - 1).bit_length()  # a binary tree's height


def test_tree_equality_sees_label_and_shape() -> None:
    assert Tree.from_nested((1, 2), label=0) != Tree.from_nested((1, 2), label=1)
    assert Tree.from_nested(((1, 2), 3)) != Tree.from_nested((1, (2, 3)))
    assert Tree.leaf(1).with_label(2) == Tree.leaf(1, label=2)


def test_deep_trees_do_not_recurse() -> None:
    nested: Nested = 0
    for i in range(5000):
        nested = (nested, i)
    t = Tree.from_nested(nested)
    assert t.depth == 5000 and t.tokens() == [0, *range(5000)]
    assert t == Tree.from_nested(t.to_nested()) and hash(t) == hash(Tree.from_nested(nested))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token": 1, "left": Tree.leaf(0)}, r"leaf \(token=1\) cannot have children"),
        ({"left": Tree.leaf(0)}, r"needs two Tree children, got left=.*right=None"),
        ({"token": 1.5}, r"token must be an int, got 1.5"),
    ],
)
def test_invalid_trees_say_why(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidTreeError, match=match):
        Tree(**kwargs)  # type: ignore[arg-type]
    assert issubclass(InvalidTreeError, ValueError)


def test_from_nested_rejects_other_items() -> None:
    with pytest.raises(InvalidTreeError, match=r"ints or \(left, right\) pairs, got 'x'"):
        Tree.from_nested((1, "x"))  # type: ignore[arg-type]


def test_vocab() -> None:
    v = Vocab(["b", "a", "b"])
    assert (len(v), v.index("b"), v.index("a"), v.index("zzz")) == (3, 1, 2, 0)
    assert v.tokens == ("<unk>", "b", "a") and "a" in v and "zzz" not in v
    with pytest.raises(IndexError, match="token id 3 is out of range for a vocabulary of 3"):
        v.token(3)


# -- stdlib AST trees ----------------------------------------------------------------------
def test_ast_mapping_is_preorder_left_branching() -> None:
    vocab = Vocab()
    fn = ast.parse("def f(x, y=None):\n    x.a = y[0]\n    return -x.a").body[0]
    tree = ast_tree(fn, vocab, add=True)
    assert [vocab.token(t) for t in tree.tokens()] == [
        "FunctionDef", "arguments", "arg", "arg", "Constant:NoneType",
        "Assign", "Attribute:Store", "Name:Load", "Subscript:Load", "Name:Load",
        "Constant:int", "Return", "UnaryOp", "USub", "Attribute:Load", "Name:Load",
    ]  # fmt: skip
    # Left-branching: the root's left spine ends at the FunctionDef token, one step per
    # child (arguments, Assign, Return).
    spine = tree
    for _ in range(3):
        assert spine.left is not None
        spine = spine.left
    assert spine.is_leaf and vocab.token(spine.token or 0) == "FunctionDef"
    assert tree.size == 2 * 16 - 1


def test_stdlib_trees_are_real_and_capped() -> None:
    data = stdlib_function_trees(max_nodes=255)
    assert len(data.classes) == 8 and len(set(data.classes)) == 8
    assert {"asyncio", "email"} & set(data.classes)
    everything = data.train + data.test
    assert len(everything) > 2000
    labels = {t.label for t in everything}
    assert labels == set(range(8))  # every package contributes functions
    assert all(1 <= t.size <= 255 for t in everything)
    assert max(t.size for t in everything) > 200  # the cap binds: big functions exist
    assert abs(len(data.test) - 0.2 * len(everything)) <= 1
    function_def = {data.vocab.index("FunctionDef"), data.vocab.index("AsyncFunctionDef")}
    assert all(next(iter(t.nodes())).token in function_def for t in everything[:200])
    assert len(set(map(hash, everything))) == len(everything)  # exact duplicates removed


def test_stdlib_trees_are_deterministic_and_limited() -> None:
    a = stdlib_function_trees(limit=300, seed=3)
    b = stdlib_function_trees(limit=300, seed=3)
    c = stdlib_function_trees(limit=300, seed=4)
    assert a.train == b.train and a.test == b.test and a.classes == b.classes
    assert a.vocab.tokens == b.vocab.tokens
    assert (len(a.train), len(a.test)) == (240, 60)
    assert a.train != c.train
    small = stdlib_function_trees(limit=100, max_nodes=31)
    assert all(t.size <= 31 for t in small.train + small.test)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"classes": 1}, "classes must be at least 2, got 1"),
        ({"max_nodes": 0}, "max_nodes must be positive, got 0"),
        ({"limit": -1}, "limit must be None or >= 0, got -1"),
        ({"test_fraction": 1.0}, r"test_fraction must be in \[0, 1\), got 1.0"),
    ],
)
def test_stdlib_bad_arguments(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        stdlib_function_trees(**kwargs)  # type: ignore[arg-type]


# -- SST-like trees --------------------------------------------------------------------------
def test_sst_like_lengths_follow_sst() -> None:
    forest = sst_like_trees(3000, seed=0, vocab_size=100, classes=5)
    leaves = [t.num_leaves for t in forest]
    assert abs(statistics.mean(leaves) - 19.0) < 0.75
    assert 6.0 < statistics.pstdev(leaves) < 12.0
    assert min(leaves) >= 1 and max(leaves) <= SST_MAX_LEAVES
    assert max(leaves) >= 45  # the long tail is there
    assert all(0 <= tok < 100 for t in forest[:100] for tok in t.tokens())
    assert {t.label for t in forest} == set(range(5))
    # Random bracketing: neither chains nor perfectly balanced, on average.
    big = [t for t in forest if t.num_leaves >= 32]
    assert all((t.num_leaves - 1).bit_length() <= t.depth < t.num_leaves - 1 for t in big)


def test_sst_like_is_deterministic() -> None:
    assert sst_like_trees(50, seed=1) == sst_like_trees(50, seed=1)
    assert sst_like_trees(50, seed=1) != sst_like_trees(50, seed=2)
    with pytest.raises(ValueError, match="vocab_size=0"):
        sst_like_trees(1, vocab_size=0)
