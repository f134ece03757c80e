"""``Tree`` (a binary tree with integer leaf tokens and an optional label) and ``Vocab``.

A ``Tree`` is either a *leaf* holding a token id, or an *internal* node with exactly two
children. The whole-tree classification label lives on the root (``label``). Size,
height and leaf count are computed once, when a node is built from its (already built)
children, so reading them is O(1) and nothing here recurses: trees with thousands of
nodes are fine.

Treat trees as immutable: datasets share subtrees and cache whole trees in-process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Union

__all__ = ["InvalidTreeError", "Nested", "Tree", "Vocab"]

#: The nested form of a tree: an ``int`` token for a leaf, a ``(left, right)`` pair
#: for an internal node.
Nested = Union[int, tuple["Nested", "Nested"]]


class InvalidTreeError(ValueError):
    """A tree was built from arguments that do not describe a leaf or a binary node."""


class Tree:
    """A binary tree: a leaf with an integer ``token``, or a node with ``left``/``right``.

    Attributes:
        token: the leaf's token id (``None`` for internal nodes).
        left, right: the children (``None`` for leaves).
        label: the whole-tree class (usually set on the root only), or ``None``.
        size: number of nodes (leaves and internal nodes).
        depth: height: 0 for a leaf, 1 + the deeper child's height otherwise.
        num_leaves: number of leaves.

    Example:
        >>> t = Tree.node(Tree.leaf(3), Tree.node(Tree.leaf(1), Tree.leaf(4)), label=2)
        >>> t.size, t.depth, t.num_leaves, t.tokens(), t.label
        (5, 2, 3, [3, 1, 4], 2)
        >>> Tree.from_nested((3, (1, 4)), label=2) == t
        True
    """

    __slots__ = ("depth", "label", "left", "num_leaves", "right", "size", "token")

    token: int | None
    left: Tree | None
    right: Tree | None
    label: int | None
    size: int
    depth: int
    num_leaves: int

    def __init__(
        self,
        token: int | None = None,
        left: Tree | None = None,
        right: Tree | None = None,
        label: int | None = None,
    ) -> None:
        if token is not None:
            if left is not None or right is not None:
                raise InvalidTreeError(
                    f"a leaf (token={token!r}) cannot have children (left={left!r}, "
                    f"right={right!r}); build a leaf or a node, not both"
                )
            if type(token) is not int:
                raise InvalidTreeError(f"a leaf token must be an int, got {token!r}")
            self.size, self.depth, self.num_leaves = 1, 0, 1
        else:
            if not isinstance(left, Tree) or not isinstance(right, Tree):
                raise InvalidTreeError(
                    "an internal node needs two Tree children, got "
                    f"left={left!r}, right={right!r}"
                )
            self.size = 1 + left.size + right.size
            self.depth = 1 + (left.depth if left.depth > right.depth else right.depth)
            self.num_leaves = left.num_leaves + right.num_leaves
        self.token, self.left, self.right, self.label = token, left, right, label

    # -- construction ------------------------------------------------------------------
    @classmethod
    def leaf(cls, token: int, label: int | None = None) -> Tree:
        """A leaf holding ``token``.

        Example:
            >>> Tree.leaf(7).is_leaf
            True
        """
        return cls(token=token, label=label)

    @classmethod
    def node(cls, left: Tree, right: Tree, label: int | None = None) -> Tree:
        """An internal node over ``left`` and ``right``.

        Example:
            >>> Tree.node(Tree.leaf(1), Tree.leaf(2)).size
            3
        """
        return cls(left=left, right=right, label=label)

    @classmethod
    def from_nested(cls, nested: Nested, label: int | None = None) -> Tree:
        """Build a tree from its nested form (ints are leaves, pairs are nodes).

        Args:
            nested: e.g. ``((1, 2), 3)``.
            label: the label of the root.

        Returns:
            The tree; raises ``InvalidTreeError`` for anything but ints and pairs.

        Example:
            >>> Tree.from_nested(((1, 2), 3)).tokens()
            [1, 2, 3]
        """
        # Iterative post-order: deep nestings must not hit the recursion limit.
        built: list[Tree] = []
        stack: list[tuple[Nested, bool]] = [(nested, False)]
        while stack:
            item, expanded = stack.pop()
            if isinstance(item, int) and not isinstance(item, bool):
                built.append(cls(token=item))
            elif isinstance(item, tuple) and len(item) == 2:
                if expanded:
                    right = built.pop()
                    built.append(cls(left=built.pop(), right=right))
                else:
                    stack.extend([(item, True), (item[1], False), (item[0], False)])
            else:
                raise InvalidTreeError(
                    f"nested tree items must be ints or (left, right) pairs, got {item!r}"
                )
        root = built[0]
        root.label = label
        return root

    def with_label(self, label: int | None) -> Tree:
        """A new root with the same children (or token) and ``label``.

        Example:
            >>> Tree.leaf(1).with_label(4).label
            4
        """
        return Tree(self.token, self.left, self.right, label)

    # -- reading -------------------------------------------------------------------------
    @property
    def is_leaf(self) -> bool:
        """True for a leaf (a node holding a token)."""
        return self.token is not None

    def nodes(self) -> Iterator[Tree]:
        """All nodes in post-order (children before parents, left before right).

        Example:
            >>> [n.size for n in Tree.from_nested((1, (2, 3))).nodes()]
            [1, 1, 1, 3, 5]
        """
        stack: list[tuple[Tree, bool]] = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if node.token is not None or expanded:
                yield node
            else:
                assert node.left is not None and node.right is not None
                stack.extend([(node, True), (node.right, False), (node.left, False)])

    def leaves(self) -> list[Tree]:
        """The leaves, left to right.

        Example:
            >>> [leaf.token for leaf in Tree.from_nested((5, (6, 7))).leaves()]
            [5, 6, 7]
        """
        return [n for n in self.nodes() if n.token is not None]

    def tokens(self) -> list[int]:
        """The leaf tokens, left to right.

        Example:
            >>> Tree.from_nested(((1, 2), 3)).tokens()
            [1, 2, 3]
        """
        return [n.token for n in self.nodes() if n.token is not None]

    def to_nested(self) -> Nested:
        """The nested form (ints and pairs); the inverse of ``from_nested``.

        Example:
            >>> Tree.from_nested((1, (2, 3))).to_nested()
            (1, (2, 3))
        """
        built: list[Nested] = []
        for node in self.nodes():
            if node.token is not None:
                built.append(node.token)
            else:
                right = built.pop()
                built.append((built.pop(), right))
        return built[0]

    # -- comparison --------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tree):
            return NotImplemented
        if self is other:
            return True
        if (self.size, self.depth, self.label) != (other.size, other.depth, other.label):
            return False
        return self._flat() == other._flat()

    def __hash__(self) -> int:
        return hash((self._flat(), self.label))

    def _flat(self) -> tuple[int | None, ...]:
        # Post-order tokens with None for internal nodes determine the tree, and flat
        # tuples compare and hash without recursion (nested ones would overflow the
        # stack on deep trees).
        return tuple(n.token for n in self.nodes())

    def __repr__(self) -> str:
        if self.size > 63:
            return f"Tree(size={self.size}, depth={self.depth}, label={self.label})"
        return f"Tree({self.to_nested()!r}, label={self.label})"


class Vocab:
    """A bidirectional map between token strings and dense ids; id 0 is ``<unk>``.

    Args:
        tokens: tokens to add, in order (duplicates are ignored).
        unk: the string of the unknown token, which always has id 0.

    Example:
        >>> v = Vocab(["Call", "Name:Load", "Call"])
        >>> len(v), v.index("Call"), v.index("never seen"), v.token(2)
        (3, 1, 0, 'Name:Load')
    """

    def __init__(self, tokens: Iterable[str] = (), unk: str = "<unk>") -> None:
        self.unk = unk
        self._ids: dict[str, int] = {unk: 0}
        self._tokens: list[str] = [unk]
        for token in tokens:
            self.add(token)

    def add(self, token: str) -> int:
        """Add ``token`` if new; return its id."""
        found = self._ids.get(token)
        if found is not None:
            return found
        self._ids[token] = len(self._tokens)
        self._tokens.append(token)
        return len(self._tokens) - 1

    def index(self, token: str) -> int:
        """The id of ``token``, or 0 (``<unk>``) if it is not in the vocabulary."""
        return self._ids.get(token, 0)

    def token(self, index: int) -> str:
        """The token string of id ``index``.

        Raises:
            IndexError: if ``index`` is not in ``range(len(self))``.
        """
        if not 0 <= index < len(self._tokens):
            raise IndexError(
                f"token id {index} is out of range for a vocabulary of {len(self._tokens)} "
                "tokens"
            )
        return self._tokens[index]

    @property
    def tokens(self) -> tuple[str, ...]:
        """All tokens, in id order (``<unk>`` first)."""
        return tuple(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, token: object) -> bool:
        return token in self._ids

    def __repr__(self) -> str:
        return f"Vocab({len(self)} tokens)"
