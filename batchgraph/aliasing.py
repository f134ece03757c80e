"""Which recorded values share memory eagerly: views (``x[0]``, ``x.view(...)``,
``x.t()``) and calls that return their input itself (``x.contiguous()``).

Batched values never share memory across handles, so changing one in place cannot
reach the others as it would eagerly. ``h += g`` (``ResultHandle.__iadd__``) makes
``h`` stand for the new value, which is exact unless ``h`` shares memory with
another value; it asks here, and refuses then.

Asked only at an augmented assignment, so the answer is worked out then, by running
the call once on fake tensors, and kept on its key.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from batchgraph.graph import Graph
    from batchgraph.keys import BatchKey

__all__ = ["shares_memory"]


def shares_memory(graph: Graph, node: int, leaf: int) -> str | None:
    """How output ``leaf`` of ``node`` shares memory with another recorded value, or
    None: it is a view of (or is) one of its call's inputs, or a later call's output
    is a view of it.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as policy:
        ...     h = bg.batched_value(torch.ones(2, 2)) * 1
        ...     row = h[0]
        >>> shares_memory(policy.graph, row.node, 0)
        'it is a view of another value (getitem)'
        >>> shares_memory(policy.graph, h.node, 0)
        'another value is a view of it (getitem)'
    """
    keys, node_key, inputs = graph.keys, graph.node_key, graph.node_inputs
    key = keys[node_key[node]]
    if _aliases(key):
        return f"it is a view of another value ({_label(key)})"
    ref = (node, leaf)
    for n in range(node + 1, len(node_key)):
        if ref in inputs[n] and _aliases(keys[node_key[n]]):
            return f"another value is a view of it ({_label(keys[node_key[n]])})"
    return None


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
