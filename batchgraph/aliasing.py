"""Which recorded values share memory eagerly: views (``x[0]``, ``x.view(...)``,
``x.t()``) and calls that return their input itself (``x.contiguous()``).

Batched values never share memory across handles, so changing one in place cannot
reach the others as it would eagerly. ``h += g`` (``ResultHandle.__iadd__``, and the
in-place calls of ``batchgraph.on_copy``) makes ``h`` stand for the new value, which
is exact for ``h``; the values sharing memory with it eagerly (its views, what it is
a view of: ``alias_group``) keep the old one. They are noted as changed
(``Graph.changed``), and a compute that reads one afterwards, or hands one out, is
refused (``check_changed``): ``y[0] = y[0] + v`` and ``y += y[0]`` work, as the
view is read before the change, while ``row = y[0]; y += 1; row * 2`` is refused.
Changing a view itself (``row += 1``, and so ``y[0] += v``) is refused where it is
recorded: eagerly it changes the value it views, which lives on.

Asked only at such a change, so whether a call makes a view is worked out then, by
running it once on fake tensors, and kept on its key.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from batchgraph.graph import Graph
    from batchgraph.keys import BatchKey

__all__ = ["alias_group", "check_changed", "note_change", "view_of"]


def view_of(graph: Graph, node: int) -> str | None:
    """The call that made ``node``'s value a view of (or the same tensor as) one of its
    inputs, named; None where it is no view.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row = h[0]
        >>> view_of(policy.graph, row.node), view_of(policy.graph, h.node)
        ('getitem', None)
    """
    key = graph.keys[graph.node_key[node]]
    return _label(key) if graph.node_inputs[node] and _aliases(key) else None


def alias_group(graph: Graph, node: int) -> set[int]:
    """The nodes whose values share memory eagerly with ``node``'s, ``node`` included
    (views of it, what it is a view of, and theirs in turn); empty where none do.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row, total = h[0], h.sum()
        >>> sorted(alias_group(policy.graph, row.node)) == sorted([h.node, row.node])
        True
    """
    keys, node_key, inputs = graph.keys, graph.node_key, graph.node_inputs
    group, stack = {node}, [node]
    while stack:  # what it views, and what that views: the inputs of view calls
        n = stack.pop()
        if inputs[n] and _aliases(keys[node_key[n]]):
            for src, _ in inputs[n]:
                if src not in group:
                    group.add(src)
                    stack.append(src)
    # Views of any of them, and views of those: recorded after what they view, so one
    # pass in recording order from the oldest finds them all (for a handle with no
    # views, a pass over the calls recorded after it).
    for n in range(min(group) + 1, len(node_key)):
        if (n not in group and inputs[n] and any(src in group for src, _ in inputs[n])
                and _aliases(keys[node_key[n]])):
            group.add(n)
    return group if len(group) > 1 else set()


def note_change(graph: Graph, group: set[int], changed: int, how: str) -> None:
    """Note that node ``changed`` was changed in place (by ``how``), and with it, from
    now on, the other nodes of its ``alias_group``: calls recorded afterwards must not
    read those, nor merge with calls made before that read any node of the group.

    ``changed`` itself is not noted: its handle now stands for the new value, and
    another handle of that node is an identical call merged with it (hash-consing),
    eagerly a tensor of its own, which did not change."""
    after = len(graph.node_key)
    for n in group:
        if n != changed:
            graph.changed.setdefault(n, (after, how))
    # An identical call recorded later would be merged with one recorded before the
    # change (and read the old value): such calls are not merged any more.
    table = graph.dedupe_table
    for signature in [sig for sig, n in table.items() if _reads_any(sig, group)]:
        del table[signature]


def _reads_any(signature: object, nodes: set[int]) -> bool:
    refs = signature[1] if isinstance(signature, tuple) and len(signature) == 2 else ()
    return isinstance(refs, tuple) and any(
        isinstance(r, tuple) and len(r) == 2 and r[0] in nodes for r in refs)


def check_changed(graph: Graph, roots: list[int]) -> None:
    """Refuse to compute ``roots`` where they are, or read after the change, a value
    changed in place through a value sharing its memory (see the module docstring).

    Raises:
        TypeError: naming the change and what to write instead.
    """
    changed = graph.changed
    inputs = graph.node_inputs
    seen: set[int] = set()
    stack = list(roots)
    for root in roots:
        if root in changed:
            _refuse(graph, root, None)
    while stack:
        n = stack.pop()
        if n in seen or graph.node_loc[n] >= 0:
            continue
        seen.add(n)
        for src, _ in inputs[n]:
            mark = changed.get(src)
            if mark is not None and n >= mark[0]:
                _refuse(graph, src, n)
            stack.append(src)


def _refuse(graph: Graph, node: int, reader: int | None) -> None:
    _, how = graph.changed[node]
    what = (f"a call recorded after that ({_label(graph.keys[graph.node_key[reader]])}) "
            "reads it" if reader is not None else "it is asked for")
    raise TypeError(
        f"a value (node {node}) shares memory eagerly with a value changed in place by "
        f"{how} after it was recorded, and {what}: eagerly it has changed too, which "
        "batched values cannot follow (they never share memory). Take the view after "
        "the change, or make a new value instead of changing one in place "
        "(h = h + other)."
    )


def _aliases(key: BatchKey) -> bool:
    """Whether an output of ``key``'s calls shares memory with one of their inputs."""
    known: bool | None = getattr(key, "_aliases", None)
    if known is None:
        known = _run_and_see(key)
        # A key class with __slots__ cannot keep it: asked again next time.
        with contextlib.suppress(AttributeError):
            key._aliases = known  # type: ignore[attr-defined]
    return known


def _run_and_see(key: BatchKey) -> bool:
    call = getattr(key, "call", None)
    if call is None or any(s is None for s in call.input_specs):
        return False  # inputs of unknown structure: cannot be run on fakes
    from batchgraph.inference import on_fake_tensors  # it imports much of the package

    try:
        with on_fake_tensors():
            fakes = [torch.empty(s.shape, dtype=s.dtype, device=s.device)
                     for s in call.input_specs]
            out = call.apply(key.fn, fakes)
            inputs = {f.untyped_storage()._cdata for f in fakes}
            return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in inputs
                       for t in tree_leaves(out))
    except Exception:  # not runnable on fakes: as before, not a view
        return False


def _label(key: BatchKey) -> str:
    fn = key.fn
    return getattr(fn, "__name__", None) or type(fn).__name__
