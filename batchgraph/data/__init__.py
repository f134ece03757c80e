"""Tree data for dynamic models: the ``Tree`` type, a ``Vocab``, and two data sets.

- ``stdlib_function_trees``: real trees — the function definitions of the Python
  standard library, as binarized ASTs, labelled by the stdlib package they come from.
- ``sst_like_trees``: random binary trees with SST's sentence-length distribution, for
  speed measurements.

Example:
    >>> from batchgraph.data import sst_like_trees, stdlib_function_trees
    >>> data = stdlib_function_trees(limit=50)
    >>> len(data.classes), data.train[0].label in range(len(data.classes))
    (8, True)
"""

from __future__ import annotations

from batchgraph.data.sst import SST_MAX_LEAVES, SST_MEAN_LEAVES, sst_like_trees
from batchgraph.data.stdlib import TreeDataset, ast_token, ast_tree, stdlib_function_trees
from batchgraph.data.trees import InvalidTreeError, Nested, Tree, Vocab

__all__ = [
    "SST_MAX_LEAVES",
    "SST_MEAN_LEAVES",
    "InvalidTreeError",
    "Nested",
    "Tree",
    "TreeDataset",
    "Vocab",
    "ast_token",
    "ast_tree",
    "sst_like_trees",
    "stdlib_function_trees",
]
