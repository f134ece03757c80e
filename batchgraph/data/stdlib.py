"""Real trees: the function definitions of the Python standard library's own source.

``stdlib_function_trees`` parses the stdlib (``sysconfig.get_paths()["stdlib"]``) with
``ast`` and turns every function definition into a binary ``Tree`` labelled by the
top-level stdlib package or module it comes from (``asyncio``, ``email``, ``tkinter``...).

**Which files.** Every ``*.py`` under the stdlib directory, walked in sorted order,
skipping the directories ``test``, ``tests``, ``idle_test``, ``site-packages``,
``dist-packages`` and ``__pycache__``; files that do not parse are skipped.

**Which classes.** The label of a function is the first path component below the
stdlib directory (``email/mime/text.py`` -> ``email``; ``typing.py`` -> ``typing``).
Only the ``classes`` labels with the most ``def``/``async def`` lines are kept (counted by
a quick textual scan, so that only the files of those packages need parsing — that keeps
a cold load to about a second or two); classes are numbered in that order, most common
first.

**Which functions.** Every ``FunctionDef``/``AsyncFunctionDef`` in those files (methods
and nested functions included, found by ``ast.walk``). Functions whose binary tree would
have more than ``max_nodes`` nodes are *skipped* (never truncated, so every tree is a
complete function). Exact duplicates — the same tree with the same label, e.g. the
boilerplate codec methods of ``encodings`` — are kept once, so they cannot appear in
both train and test.

**AST node -> token.** Each AST node becomes one token string, in the ``Vocab``:

- ``ast.Constant``: ``"Constant:" + type(value).__name__`` (``Constant:str``,
  ``Constant:int``, ``Constant:NoneType``, ``Constant:bool``, ``Constant:ellipsis``...);
- nodes with an expression context (``Name``, ``Attribute``, ``Subscript``, ``Starred``,
  ``List``, ``Tuple``): type name + ``":"`` + context name (``Name:Load``,
  ``Attribute:Store``, ``Tuple:Del``); the context nodes themselves are not tree nodes;
- every other node: its type name (``FunctionDef``, ``Call``, ``arguments``, ``Add``...).
  Operators (``Add``, ``Eq``, ``And``...) are nodes with no children, so they are leaves.

**AST -> binary tree (left-branching).** A node with token ``T`` and children
``c1..cn`` (``ast.iter_child_nodes`` order, context nodes left out) becomes
``leaf(T)`` when ``n == 0``, else ``node(...node(node(leaf(T), B(c1)), B(c2))..., B(cn))``.
So an AST of ``n`` nodes gives exactly ``n`` leaves and ``2n - 1`` tree nodes, and each
node's type token is the leftmost leaf of its subtree.

**Order and split.** Functions are listed in (file, position) order, deduplicated, then
shuffled with ``random.Random(seed)``; ``limit`` keeps the first ``limit``; the last
``round(len * test_fraction)`` are the test split. Same Python + same arguments ->
same trees in the same order.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import re
import sysconfig
from collections import Counter
from dataclasses import dataclass

from batchgraph.data.trees import Tree, Vocab

__all__ = ["TreeDataset", "ast_token", "ast_tree", "stdlib_function_trees"]

_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                        "__pycache__"})
_DEF_LINE = re.compile(rb"^[ \t]*(?:async[ \t]+)?def[ \t]", re.MULTILINE)


@dataclass(frozen=True)
class TreeDataset:
    """A labelled tree classification data set.

    Attributes:
        train: training trees (each root carries its ``label``).
        test: held-out trees.
        vocab: the token vocabulary (leaf ``token`` ids index it).
        classes: class names; ``label`` ``i`` is ``classes[i]``.
    """

    train: list[Tree]
    test: list[Tree]
    vocab: Vocab
    classes: tuple[str, ...]

    def majority_baseline(self) -> float:
        """Test accuracy of always predicting the most common *training* label."""
        if not self.train or not self.test:
            return 0.0
        top = Counter(t.label for t in self.train).most_common(1)[0][0]
        return sum(t.label == top for t in self.test) / len(self.test)


def ast_token(node: ast.AST) -> str:
    """The token string of one AST node (see the module docstring for the mapping).

    Example:
        >>> ast_token(ast.parse("x = 1").body[0].targets[0])
        'Name:Store'
        >>> ast_token(ast.Constant(value=None))
        'Constant:NoneType'
    """
    name = type(node).__name__
    if isinstance(node, ast.Constant):
        return f"Constant:{type(node.value).__name__}"
    ctx = getattr(node, "ctx", None)
    if isinstance(ctx, ast.expr_context):
        return f"{name}:{type(ctx).__name__}"
    return name


def ast_tree(node: ast.AST, vocab: Vocab, add: bool = False) -> Tree:
    """The binary tree of one AST node, with the data set's token mapping and binarization.

    Args:
        node: any AST node, e.g. a parsed ``FunctionDef``.
        vocab: maps token strings to ids.
        add: add unseen tokens to ``vocab`` (else they become ``<unk>``, id 0).

    Returns:
        The left-branching binary tree; its ``tokens()`` are the AST's tokens in
        pre-order (each node's type token comes before its children's).

    Example:
        >>> vocab = Vocab()
        >>> fn = ast.parse("def f(x): return x + 1").body[0]
        >>> [vocab.token(t) for t in ast_tree(fn, vocab, add=True).tokens()]
        ['FunctionDef', 'arguments', 'arg', 'Return', 'BinOp', 'Name:Load', 'Add', 'Constant:int']
    """
    ids: dict[str, int] = {}
    raw, _ = _convert(node, ids, [])
    remap = [vocab.add(tok) if add else vocab.index(tok) for tok in ids]
    return _build(raw, remap)


def stdlib_function_trees(
    limit: int | None = None,
    max_nodes: int = 255,
    seed: int = 0,
    classes: int = 8,
    test_fraction: float = 0.2,
) -> TreeDataset:
    """Binary trees of the stdlib's function definitions, labelled by stdlib package.

    The parse is cached in-process per ``classes`` and the trees per ``(max_nodes,
    classes)``, so later calls (other seeds, limits) cost only a shuffle.

    Args:
        limit: keep at most this many functions (after the seeded shuffle), or all.
        max_nodes: skip functions whose binary tree has more nodes than this.
        seed: seed of the shuffle that fixes the order and the train/test split.
        classes: how many of the most common packages to keep as classes (>= 2).
        test_fraction: fraction of the kept functions held out as ``test``.

    Returns:
        A ``TreeDataset``; every tree's ``label`` indexes ``classes``.

    Raises:
        ValueError: for ``classes < 2``, ``max_nodes < 1``, a negative ``limit`` or a
            ``test_fraction`` outside ``[0, 1)``.

    Example:
        >>> data = stdlib_function_trees(limit=100)
        >>> len(data.train), len(data.test), len(data.classes)
        (80, 20, 8)
        >>> all(t.size <= 255 for t in data.train)
        True
    """
    if classes < 2:
        raise ValueError(f"classes must be at least 2, got {classes}")
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be positive, got {max_nodes}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    trees, vocab, names = _load(max_nodes, classes)
    order = list(trees)
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    n_test = round(len(order) * test_fraction)
    split = len(order) - n_test
    return TreeDataset(order[:split], order[split:], vocab, names)


def stdlib_dir() -> str:
    """The directory of the running Python's standard library source."""
    return sysconfig.get_paths()["stdlib"]


def _source_files(root: str) -> list[tuple[str, str]]:
    """``(label, path)`` of every stdlib source file, in sorted walk order."""
    found: list[tuple[str, str]] = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            top = os.path.relpath(path, root).split(os.sep)[0]
            found.append((top[:-3] if top.endswith(".py") else top, path))
    return found


@functools.lru_cache(maxsize=8)
def _load(max_nodes: int, classes: int) -> tuple[tuple[Tree, ...], Vocab, tuple[str, ...]]:
    functions, tokens, names = _parse(classes)
    raw: list[tuple[_Raw, int]] = []
    seen: set[tuple[_Raw, int]] = set()
    for fn_raw, count, label in functions:
        if 2 * count - 1 > max_nodes:
            continue
        item = (fn_raw, label)
        if item not in seen:
            seen.add(item)
            raw.append(item)
    # The vocabulary holds every token of the parsed files (skipped functions' too), and
    # ids follow sorted token strings, so it depends neither on the order of the files
    # nor on ``max_nodes``.
    vocab = Vocab(sorted(tokens))
    remap = [vocab.index(tok) for tok in tokens]
    trees = tuple(_build(r, remap).with_label(label) for r, label in raw)
    return trees, vocab, names


@functools.lru_cache(maxsize=2)
def _parse(classes: int) -> tuple[list[tuple[_Raw, int, int]], list[str], tuple[str, ...]]:
    """Every function of the ``classes`` biggest packages as ``(raw, AST nodes, label)``.

    Cached apart from ``_load`` so that other ``max_nodes`` do not parse again.
    """
    files = _source_files(stdlib_dir())
    sources: dict[str, bytes] = {}
    counts: Counter[str] = Counter()
    for label, path in files:
        try:
            with open(path, "rb") as f:
                sources[path] = f.read()
        except OSError:
            continue
        counts[label] += len(_DEF_LINE.findall(sources[path]))
    # most_common breaks ties by first occurrence, and files are in sorted order.
    names = tuple(name for name, _ in counts.most_common(classes))
    class_of = {name: i for i, name in enumerate(names)}
    token_ids: dict[str, int] = {}
    functions: list[tuple[_Raw, int, int]] = []
    for label, path in files:
        if label not in class_of or path not in sources:
            continue
        try:
            module = ast.parse(sources[path], filename=path)
        except (SyntaxError, ValueError):
            continue
        functions.extend(
            (fn_raw, count, class_of[label])
            for fn_raw, count in _module_functions(module, token_ids)
        )
    return functions, list(token_ids), names


# An AST in compact form: (provisional token id, children...). Hashable, for dedupe.
_Raw = tuple[object, ...]


_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _module_functions(module: ast.Module, ids: dict[str, int]) -> list[tuple[_Raw, int]]:
    """``(raw, AST node count)`` of every function definition in ``module``.

    Only statement bodies are searched outside functions (a ``def`` is always a
    statement), and each function is converted once: converting an outer function
    reports the functions nested in it on the way, so no node is visited twice.
    """
    found: list[tuple[_Raw, int]] = []
    stack: list[ast.AST] = [module]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _convert(node, ids, found)
            continue
        for field in _BODIES:
            stack.extend(reversed(getattr(node, field, ())))
    return found


def _convert(node: ast.AST, ids: dict[str, int], found: list[tuple[_Raw, int]]) -> tuple[_Raw, int]:
    """``(raw, count)`` of ``node``; functions met on the way are appended to ``found``.

    A hand-rolled child loop: ``ast.iter_child_nodes`` was most of the load time.
    """
    token = ids.setdefault(ast_token(node), len(ids))
    parts: list[object] = [token]
    count = 1
    for field in node._fields:
        if field == "ctx":
            continue
        value = getattr(node, field, None)
        if isinstance(value, list):
            for item in value:
                if isinstance(item, ast.AST):
                    child, n = _convert(item, ids, found)
                    parts.append(child)
                    count += n
        elif isinstance(value, ast.AST):
            child, n = _convert(value, ids, found)
            parts.append(child)
            count += n
    result = (tuple(parts), count)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        found.append(result)
    return result


def _build(raw: _Raw, remap: list[int]) -> Tree:
    """Left-branching binarization: ``(T, c1, c2)`` -> ``((T, B(c1)), B(c2))``."""
    token = raw[0]
    assert isinstance(token, int)
    tree = Tree(token=remap[token])
    for child in raw[1:]:
        assert isinstance(child, tuple)
        tree = Tree(left=tree, right=_build(child, remap))
    return tree
