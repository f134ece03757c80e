"""Synthetic trees shaped like the Stanford Sentiment Treebank's (SST) parse trees.

Only the *shapes* follow SST (sentence lengths: mean about 19 words, longest 56):
bracketing, tokens and labels are random, so these trees are for measuring speed, not
for learning anything.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from batchgraph.data.trees import Tree

__all__ = ["SST_MAX_LEAVES", "SST_MEAN_LEAVES", "sst_like_trees"]

SST_MEAN_LEAVES = 19.0
SST_MAX_LEAVES = 56
# Gamma(k, theta) with mean k * theta = 19 and standard deviation sqrt(k) * theta = 9,
# roughly SST's sentence-length spread. Draws above the maximum are redrawn, which
# lowers the mean by well under 0.1 (the tail beyond 56 holds about 0.2% of the mass).
_SHAPE = (SST_MEAN_LEAVES / 9.0) ** 2
_SCALE = 81.0 / SST_MEAN_LEAVES


def sst_like_trees(
    n: int, seed: int = 0, vocab_size: int = 5000, classes: int = 5
) -> list[Tree]:
    """``n`` random binary trees whose leaf counts follow SST's sentence lengths.

    Leaf counts are drawn from a gamma distribution (mean 19, sd 9), rounded, at least
    1 and redrawn when above 56. Each subtree of ``m > 1`` leaves splits at a point
    drawn uniformly from ``1..m-1`` (random bracketing). Tokens are uniform over
    ``range(vocab_size)``, labels uniform over ``range(classes)`` (set on the roots).

    Args:
        n: number of trees.
        seed: seed of the generator; the same arguments give the same trees.
        vocab_size: number of distinct tokens.
        classes: number of labels (SST's fine-grained task has 5).

    Returns:
        A list of ``n`` trees.

    Raises:
        ValueError: for a negative ``n`` or a ``vocab_size``/``classes`` below 1.

    Example:
        >>> trees = sst_like_trees(1000)
        >>> 17.5 < sum(t.num_leaves for t in trees) / 1000 < 20.5
        True
        >>> max(t.num_leaves for t in trees) <= 56
        True
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if vocab_size < 1 or classes < 1:
        raise ValueError(
            f"vocab_size and classes must be >= 1, got vocab_size={vocab_size}, "
            f"classes={classes}"
        )
    rng = random.Random(seed)
    trees: list[Tree] = []
    for _ in range(n):
        leaves = 0
        while not 1 <= leaves <= SST_MAX_LEAVES:
            leaves = max(1, round(rng.gammavariate(_SHAPE, _SCALE)))
        root = _random_bracketing(leaves, rng.random, vocab_size)
        root.label = int(rng.random() * classes)
        trees.append(root)
    return trees


def _random_bracketing(leaves: int, draw: Callable[[], float], vocab_size: int) -> Tree:
    # ``int(draw() * k)`` instead of ``randrange(k)``: several times cheaper, and the
    # bias (< k / 2**53) is irrelevant here.
    if leaves == 1:
        return Tree(token=int(draw() * vocab_size))
    split = 1 + int(draw() * (leaves - 1))
    left = _random_bracketing(split, draw, vocab_size)
    return Tree(left=left, right=_random_bracketing(leaves - split, draw, vocab_size))
