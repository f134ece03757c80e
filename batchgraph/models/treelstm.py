"""Binary (constituency) TreeLSTM: the cells, a per-example classifier, and its ceiling.

- ``LeafCell`` and ``BinaryTreeLSTMCell`` are plain ``nn.Module``s that work on one
  example (``(d,)``) or on a batch (``(B, d)``) alike.
- ``TreeLSTMClassifier`` is per-example code (a ``bg.BatchedModule``): run it eagerly
  for the unbatched reference, or inside a ``bg.BatchingPolicy`` to batch it.
- ``HandBatchedTreeLSTM`` runs the *same* modules, batched by hand: one embedding and
  leaf-cell call for all leaves, then one cell call per tree level. It is the ceiling
  automatic batching is compared with (see ``batchgraph.models.handbatched``).

Cell equations (Tai et al. 2015, binary N-ary TreeLSTM; ``σ`` the logistic sigmoid)::

    leaf:  i, o, u = split(W x + b)            c = σ(i)·tanh(u)             h = σ(o)·tanh(c)
    node:  i, f_l, f_r, o, u = split(W [h_l; h_r] + b)
           c = σ(i)·tanh(u) + σ(f_l)·c_l + σ(f_r)·c_r                      h = σ(o)·tanh(c)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import batchgraph as bg
from batchgraph.data.trees import Tree

__all__ = ["BinaryTreeLSTMCell", "LeafCell", "TreeLSTMClassifier"]


class LeafCell(nn.Module):
    """The TreeLSTM cell of a leaf: ``x -> (h, c)`` from one ``Linear(in_dim, 3 * hidden)``.

    Args:
        in_dim: size of the input (the token embedding).
        hidden: size of ``h`` and ``c`` (defaults to ``in_dim``).

    Example:
        >>> cell = LeafCell(4)
        >>> [t.shape for t in cell(torch.randn(4))], [t.shape for t in cell(torch.randn(2, 4))]
        ([torch.Size([4]), torch.Size([4])], [torch.Size([2, 4]), torch.Size([2, 4])])
    """

    # Written for a leading batch dimension: batched calls are one plain call.
    batch_key = bg.StackKey

    def __init__(self, in_dim: int, hidden: int | None = None) -> None:
        super().__init__()
        self.hidden = in_dim if hidden is None else hidden
        self.proj = nn.Linear(in_dim, 3 * self.hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.hidden
        # One sigmoid over both gates and one tanh: fewer kernel launches per call.
        gates, u = self.proj(x).split([2 * d, d], dim=-1)
        i, o = torch.sigmoid(gates).chunk(2, dim=-1)
        c = i * torch.tanh(u)
        return o * torch.tanh(c), c


class BinaryTreeLSTMCell(nn.Module):
    """The binary TreeLSTM cell: ``(h_l, c_l, h_r, c_r) -> (h, c)``.

    Gates come from one ``Linear(2 * hidden, 5 * hidden)`` on ``[h_l; h_r]``, with a
    separate forget gate per child. Inputs may be ``(hidden,)`` or ``(B, hidden)``.

    Args:
        hidden: size of ``h`` and ``c``.

    Example:
        >>> cell = BinaryTreeLSTMCell(3)
        >>> h, c = cell(*[torch.randn(3) for _ in range(4)])
        >>> h.shape, c.shape
        (torch.Size([3]), torch.Size([3]))
    """

    # Written for a leading batch dimension: batched calls are one plain call.
    batch_key = bg.StackKey

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.proj = nn.Linear(2 * hidden, 5 * hidden)

    def forward(
        self, hl: torch.Tensor, cl: torch.Tensor, hr: torch.Tensor, cr: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.hidden
        # cat on the last dimension so the same code serves (d,) and (B, d).
        gates, u = self.proj(torch.cat([hl, hr], dim=-1)).split([4 * d, d], dim=-1)
        i, fl, fr, o = torch.sigmoid(gates).chunk(4, dim=-1)
        c = i * torch.tanh(u) + fl * cl + fr * cr
        return o * torch.tanh(c), c


class TreeLSTMClassifier(bg.BatchedModule):
    """Whole-tree classifier: a binary TreeLSTM over the tree, a linear layer on the root.

    Written for one tree. Outside a policy ``logits(tree)`` is plain PyTorch (the
    unbatched reference); inside ``bg.BatchingPolicy`` it records and returns a handle.

    Args:
        vocab_size: number of token ids (rows of the embedding).
        classes: number of output classes.
        hidden: size of the TreeLSTM state.
        embed_dim: size of the token embedding (defaults to ``hidden``).

    Example:
        >>> import batchgraph as bg
        >>> model = TreeLSTMClassifier(vocab_size=10, classes=3, hidden=8)
        >>> trees = [Tree.from_nested((1, (2, 3))), Tree.leaf(4)]
        >>> eager = [model.logits(t) for t in trees]
        >>> with bg.BatchingPolicy():
        ...     handles = [model.logits(t) for t in trees]
        >>> batched = bg.compute(handles)
        >>> all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager, batched))
        True
    """

    def __init__(
        self, vocab_size: int, classes: int, hidden: int = 128, embed_dim: int | None = None
    ) -> None:
        super().__init__()
        embed_dim = hidden if embed_dim is None else embed_dim
        self.hidden = hidden
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.leaf = LeafCell(embed_dim, hidden)
        self.cell = BinaryTreeLSTMCell(hidden)
        self.out = nn.Linear(hidden, classes)

    def encode(self, tree: Tree) -> Any:
        """``(h, c)`` of the tree's root (a handle for that pair while recording).

        Recursive per-example code: the recursion depth is the tree's ``depth``.
        """
        if tree.token is not None:
            # A Python int, not torch.tensor(token): batchgraph turns the ints of a
            # batch into one tensor, which is much cheaper than one tensor per leaf.
            return self.leaf(self.embed(bg.batched_value(tree.token)))
        assert tree.left is not None and tree.right is not None
        (hl, cl), (hr, cr) = self.encode(tree.left), self.encode(tree.right)
        return self.cell(hl, cl, hr, cr)

    def logits(self, tree: Tree) -> Any:
        """Class scores of one tree: a ``(classes,)`` tensor, or a handle for it."""
        h, _ = self.encode(tree)
        return self.out(h)
