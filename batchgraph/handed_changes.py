"""Values handed out and changed afterwards without moving their version counter.

A call recorded on a handle whose value was handed out reads the stored row the value
is a copy of, unless the value's version moved since (``handle.unchanged``: then it
reads a copy of the value as it is, as the eager call would). A change through
``.data`` (``y.data.add_(1)``, ``y.data[0] = v``, ``y.data.copy_(t)``) moves the version
of ``.data``'s alias only, which is made anew at each ``.data``: the call read the row
as computed where eagerly it read the change (an output off by the change, silently).

Recording does not look at handed-out values' contents (a comparison per recorded
call would cost every call), so each compute does, once: for the calls it runs that
were recorded after a hand-out and read the handed-out node's row, the value handed
out is compared with that row (bit for bit: a NaN kept is no change, 0.0 set to -0.0
is one), where its version did not move. A difference is refused
(``ConstantChangedError``): whether the change came before the call (eagerly read) or after it (eagerly not) cannot be told, so the error says what
to write instead.

Hand-outs are noted weakly (a value dropped can no longer change) and the table is
scanned for dropped ones once it has doubled.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from batchgraph.errors import ConstantChangedError
from batchgraph.graph import ROW_MASK, STORE_SHIFT

if TYPE_CHECKING:
    from batchgraph.graph import Graph, Ref
    from batchgraph.passes import LiveGraph

__all__ = ["check", "keep_only", "note", "note_rows"]

# A value handed out: the value (weakly), its version then, and the number of nodes
# recorded then (the calls recorded before it read the row as computed, as eagerly).
_Handout = tuple[weakref.ref[torch.Tensor], int, int]


class _Table:
    __slots__ = ("columns", "handouts", "kept")

    def __init__(self) -> None:
        # Values handed out one by one, by (node, leaf); copies of a stored column
        # whose rows a compute handed out at once, by (store, leaf).
        self.handouts: dict[Ref, list[_Handout]] = {}
        self.columns: dict[tuple[int, int], list[_Handout]] = {}
        self.kept = 64


_TABLES: weakref.WeakKeyDictionary[Graph, _Table] = weakref.WeakKeyDictionary()


def note(graph: Graph, node: int, leaf: int, value: Any, version: Any) -> None:
    """Note ``value``, handed out for output ``leaf`` of ``node`` with ``version`` (an
    inference tensor's None: such a value counts as changed whatever is done to it)."""
    if type(version) is int and isinstance(value, torch.Tensor):
        _note(graph, lambda table: table.handouts, (node, leaf), value, version)


def note_rows(graph: Graph, store: int, leaf: int, rows: tuple[torch.Tensor, ...],
              version: Any) -> None:
    """Note the copy of column ``leaf`` of ``store`` whose ``rows`` (its views) a
    compute hands out at once: one note for all of them."""
    base = rows[0]._base if rows else None
    if type(version) is int and base is not None:
        _note(graph, lambda table: table.columns, (store, leaf), base, version)


def _note(graph: Graph, part: Callable[[_Table], dict[Any, list[_Handout]]], at: Any,
          value: torch.Tensor, version: int) -> None:
    table = _TABLES.get(graph)
    if table is None:
        table = _TABLES[graph] = _Table()
    noted = part(table)
    noted.setdefault(at, []).append((weakref.ref(value), version, len(graph.node_key)))
    if len(noted) >= 2 * table.kept:
        table.kept = keep_only(noted, lambda h: h[0]() is not None)


def keep_only(table: dict[Any, list[Any]], keep: Callable[[Any], bool]) -> int:
    """Keep in ``table`` the hand-outs ``keep`` names, and the keys left with some;
    the size to scan again at (twice the number left, 64 at least).

    Example:
        >>> table = {1: [1, 2], 2: [3]}
        >>> keep_only(table, lambda h: h < 3), table
        (64, {1: [1, 2]})
    """
    for ref in list(table):
        kept = [h for h in table[ref] if keep(h)]
        if kept:
            table[ref] = kept
        else:
            del table[ref]
    return max(len(table), 64)


def check(graph: Graph, live: LiveGraph) -> None:
    """Refuse where a call of ``live`` recorded after a hand-out reads the handed-out
    node's row and the value handed out differs from it with its version unmoved.

    Example:
        >>> import batchgraph as bg
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2)) * 2
        ...     y = bg.compute(h)
        ...     _ = y.data.add_(1)
        ...     later = h + 1
        >>> bg.compute(later)
        Traceback (most recent call last):
        ...
        batchgraph.errors.ConstantChangedError: the value handed out ...
    """
    table = _TABLES.get(graph)
    if table is None or not (table.handouts or table.columns):
        return
    handouts, columns = table.handouts, table.columns
    first = min(h[2] for noted in (handouts, columns) for outs in noted.values() for h in outs)
    inputs, loc, nodes, stores = graph.node_inputs, graph.node_loc, live.nodes, graph.stores
    alive: dict[Any, list[tuple[torch.Tensor, int]]] = {}  # per note: values unmoved
    same: dict[int, bool] = {}  # per copy of a column: equal to it
    for n in nodes[bisect.bisect_left(nodes, first):]:
        for ref in inputs[n]:
            where = loc[ref[0]]
            if where < 0:
                continue
            at = (where >> STORE_SHIFT, ref[1])
            for noted, key in ((handouts, ref), (columns, at)):
                if key not in noted:
                    continue
                if (values := alive.get((noted is columns, key))) is None:
                    values = alive[(noted is columns, key)] = _unmoved(noted[key])
                for value, mark in values:
                    store = stores[at[0]]
                    if n >= mark and store and _changed(
                            value, store[at[1]], where & ROW_MASK, noted is columns, same):
                        _refuse(graph, ref, n)


def _unmoved(outs: list[_Handout]) -> list[tuple[torch.Tensor, int]]:
    """The values handed out that are alive and whose version did not move (one that
    moved is read as a copy by the calls recorded after it: ``handle.unchanged``)."""
    return [(value, mark) for wr, version, mark in outs
            if (value := wr()) is not None and value._version == version]


def _changed(value: torch.Tensor, column: torch.Tensor, row: int, whole: bool,
             same: dict[int, bool]) -> bool:
    """Whether ``value`` (a copy of the ``whole`` column, or of its ``row``) differs
    from the stored row; a whole copy is compared with the column first, once
    (``same``), and its row only where they differ."""
    if not whole:
        return not _same_bits(value, column[row])
    if id(value) not in same:
        same[id(value)] = _same_bits(value, column)
    return not same[id(value)] and not _same_bits(value[row], column[row])


# Floating dtypes compared as integers of their width: bit for bit, as a copy is.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits: a NaN copied is unchanged (where
    ``torch.equal`` takes it for a change), 0.0 set to -0.0 is a change (1 / y
    differs), where ``torch.equal`` takes them for equal.

    Example:
        >>> nan = torch.tensor([float("nan"), 0.0])
        >>> _same_bits(nan, nan.clone()), _same_bits(nan, torch.tensor([float("nan"), -0.0]))
        (True, False)
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        bits = _BITS[a.element_size()]
        a, b = a.detach().view(bits), b.detach().view(bits)
    return torch.equal(a, b)


def _refuse(graph: Graph, ref: Ref, reader: int) -> None:
    key = graph.keys[graph.node_key[reader]]
    raise ConstantChangedError(
        f"the value handed out for node {ref[0]} (by compute or an await) was changed in "
        "place without moving its version counter (through .data: y.data.add_(1), "
        f"y.data[0] = v), and a call recorded after the hand-out ({key.label}, node "
        f"{reader}) reads its handle: eagerly it read the value before or after the "
        "change, which batchgraph cannot tell (it reads the value as computed). Change "
        "the value itself, under torch.no_grad() if it requires grad (y.add_(1): calls "
        "recorded after it read the change), or pass the changed value to the call "
        "(f(y) instead of f(h))."
    )
