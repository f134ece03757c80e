"""Blocks of a traced model whose forward keeps Python state: called, not traced through.

A model that is not an ``nn.Sequential`` is split by tracing it with ``torch.fx``, which
runs the Python of the modules it traces through (the model's own ``forward`` and its
non-``torch.nn`` blocks) once, when traced. A block whose forward keeps state of its own
in its attributes (``self.calls += 1``, ``self.seen.append(...)``, a cache) changed it at
the trace only (twice: the model is traced in both modes), never at a step, where one
device changes it at every call; and an attribute bound to a value of the trace kept an
``fx.Proxy``. Such a block is made a leaf of the trace (:func:`stateful_leaves`): the
graph calls it and its forward runs as written, once per microbatch, as an
``nn.Sequential``'s layers do. What the traces did to the attributes is put back. The
model's own forward cannot be called as a leaf of itself: one that keeps state is
refused, saying what to write instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import fx, nn

from batchgraph.attributes import MODULE_OWN
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.python_state import SavedAttributes

__all__ = ["LeafTracer", "Trace", "attributes_put_back", "stateful_leaves", "trace_with"]

Trace = Callable[[nn.Module], fx.GraphModule]


class LeafTracer(fx.Tracer):
    """``torch.fx``'s tracer, calling ``leaves`` (by identity) as it calls torch.nn layers."""

    def __init__(self, leaves: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return id(m) in self.leaves or super().is_leaf_module(m, module_qualified_name)


def trace_with(leaves: frozenset[int]) -> Trace:
    """A ``partition_graph`` tracer calling ``leaves`` (``fx.symbolic_trace`` without).

    Example:
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.ReLU())
        >>> [n.op for n in trace_with(frozenset({id(net[0])}))(net).graph.nodes]
        ['placeholder', 'call_module', 'call_module', 'output']
    """

    def trace(module: nn.Module) -> fx.GraphModule:
        graph = LeafTracer(leaves).trace(module)
        return fx.GraphModule(module, graph, type(module).__name__)

    return trace


@contextmanager
def attributes_put_back(modules: list[tuple[str, nn.Module]]) -> Iterator[dict[str, list[str]]]:
    """Yields, per module name, the attributes changed in the block (then put back).

    Example:
        >>> m = nn.Linear(2, 2)
        >>> m.calls = 0
        >>> with attributes_put_back([("lin", m)]) as changed:
        ...     m.calls += 1
        >>> changed, m.calls
        ({'lin': ['calls']}, 0)
    """
    saved = [(name, SavedAttributes(m, MODULE_OWN)) for name, m in modules]
    changed: dict[str, list[str]] = {}
    try:
        yield changed
    finally:
        for name, attrs in saved:
            names = attrs.changed(MODULE_OWN)
            attrs.put_back(names)
            if names:
                changed[name] = sorted(names)


def stateful_leaves(module: nn.Module, traced: Callable[[frozenset[int]], list[
        tuple[str, nn.Module]]], trace: Callable[[Trace], Any]) -> frozenset[int]:
    """The blocks to call as leaves: those whose forward changed an attribute while
    ``trace(tracer)`` traced ``module`` (``traced(leaves)``: the modules traced through).

    Raises:
        PipelineConfigError: if the model's own forward keeps state.

    Example:
        >>> from batchgraph.pipeline.traced_modes import traced_through
        >>> class Counted(nn.Linear):
        ...     calls = 0
        ...     def forward(self, x):
        ...         self.calls += 1
        ...         return super().forward(x)
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.block = Counted(2, 2)
        ...     def forward(self, x):
        ...         return self.block(x).relu()
        >>> net = Net()
        >>> leaves = stateful_leaves(net, lambda found: traced_through(net, found),
        ...                          lambda trace: trace(net))
        >>> leaves == {id(net.block)}, net.block.calls
        (True, 0)
    """
    leaves: frozenset[int] = frozenset()
    while True:
        through = traced(leaves)
        with attributes_put_back(through) as changed:
            trace(trace_with(leaves))
        if "" in changed:
            names = ", ".join(f"self.{n}" for n in changed[""])
            raise PipelineConfigError(
                f"the forward of {type(module).__name__} changes {names}, and the pipeline "
                "splits it by tracing it with torch.fx, which runs that Python once, when "
                "traced, not at each step: the state would never change where one device "
                "changes it at every call. Move it into a block of the model (a submodule "
                "whose forward keeps it: the pipeline calls such a block as written, once "
                "per microbatch), or give the layers as an nn.Sequential or a list of stage "
                "modules"
            )
        found = frozenset(id(m) for name, m in through if name in changed)
        if not found:
            return leaves
        leaves |= found
