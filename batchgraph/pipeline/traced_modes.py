"""Graph-split stages that follow ``model.train()`` / ``model.eval()``.

A module that is not an ``nn.Sequential`` is split by tracing it with ``torch.fx``
(:func:`~batchgraph.pipeline.partition.partition_graph`). Tracing runs the Python of
every module it traces through (the model's own ``forward`` and its non-``torch.nn``
blocks) once, and a read of ``self.training`` there becomes a constant of the graph::

    x = F.dropout(x, 0.1, self.training)   ->   dropout(x, p=0.1, training=True)
    if self.training: x = x + noise        ->   the branch taken while tracing

so the stages kept the mode the model had when the pipeline was built: after
``model.eval()``, ``pipe.forward`` still dropped activations out. (``torch.nn`` layers,
``nn.Dropout`` and ``nn.BatchNorm1d`` say, are not traced through: they are called and
read their mode at every call.)

:func:`partition_graph_by_mode` traces the model in both modes. Where the two traces
have the same code (the model's Python does not read the mode), the parts are returned
as they are. Where they differ only in constants (the ``F.dropout`` case), each stage is
a :class:`ModeParts` that runs the part traced in the mode the traced-through modules
are in now. Where they differ in their operations (an ``if self.training:`` branch), a
stage cannot switch: it runs in the traced mode, and refuses the other with a
:class:`~batchgraph.pipeline.errors.PipelineConfigError` that says what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import fx, nn

from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.traced_state import (
    LeafTracer,
    Trace,
    attributes_put_back,
    stateful_leaves,
    trace_with,
)

__all__ = ["ModeParts", "partition_graph_by_mode", "traced_through"]


def traced_through(
    module: nn.Module, leaves: frozenset[int] = frozenset()
) -> list[tuple[str, nn.Module]]:
    """The modules whose Python ``torch.fx.symbolic_trace(module)`` runs (named), i.e. whose
    ``self.training`` reads become constants: the root and the non-leaf modules below it
    that are reached without passing through a leaf (``torch.nn`` layers are leaves, and
    ``leaves``, by identity: see :mod:`batchgraph.pipeline.traced_state`).

    Example:
        >>> from torch import nn
        >>> class Block(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(2, 2)
        >>> [name for name, _ in traced_through(nn.Sequential(Block(), nn.ReLU()))]
        ['', '0']
    """
    tracer = LeafTracer(leaves)
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, mod: nn.Module) -> None:
        # A ModuleList or ModuleDict is never called (a forward iterates it and calls its
        # blocks, which the trace goes into): looked into, not listed, though a leaf.
        container = isinstance(mod, (nn.ModuleList, nn.ModuleDict))
        if id(mod) in seen or (name and not container and tracer.is_leaf_module(mod, name)):
            return
        seen.add(id(mod))
        if not container:
            found.append((name, mod))
        for child_name, child in mod.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return found


@contextmanager
def _in_mode(modules: Sequence[nn.Module], training: bool) -> Iterator[None]:
    """Set the ``training`` flag of exactly ``modules`` (no ``train()`` recursion into
    leaves, no overridden ``train()`` run), restored afterwards."""
    before = [m.training for m in modules]
    try:
        for m in modules:
            m.training = training
        yield
    finally:
        for m, flag in zip(modules, before):
            m.training = flag


def _structure(part: fx.GraphModule) -> list[tuple[str, Any]]:
    return [(n.op, n.target) for n in part.graph.nodes]


def _modes(flags: Sequence[bool]) -> str:
    if all(flags):
        return "training mode"
    if not any(flags):
        return "eval mode"
    return "mixed modes"


class ModeParts(nn.Module):
    """One graph-split stage traced in both modes; runs the part of the current mode.

    Args:
        part: the part traced in the modes the model had (``flags``).
        other: the same part traced with every traced-through module in mode
            ``other_mode``, or ``None`` where that trace has other operations.
        traced: the traced-through modules (see :func:`traced_through`), named.
        flags: their ``training`` flags when ``part`` was traced.
        other_mode: the mode ``other`` was traced in.
        root: the name of the model's class, for messages.

    Both parts hold the model's own submodules and parameters (no copies).
    """

    def __init__(
        self,
        part: fx.GraphModule,
        other: fx.GraphModule | None,
        traced: Sequence[tuple[str, nn.Module]],
        flags: Sequence[bool],
        other_mode: bool,
        root: str,
    ) -> None:
        super().__init__()
        self.part = part
        # Not a submodule: it holds the same submodules and parameters as ``part``, and a
        # module reachable by two names breaks torch.func.functional_call (the shape
        # probe), which swaps a tied tensor back twice and leaves the probe's in place.
        # _apply moves its own tensors (lifted constants) along with ``part``'s.
        self.__dict__["other"] = other
        # Plain attributes, not submodules: the stage's parameters are its parts' only.
        self.__dict__["_traced"] = tuple(m for _, m in traced)
        self.__dict__["_names"] = tuple(name or root for name, _ in traced)
        self._flags = tuple(flags)
        self._other_mode = other_mode
        self._root = root

    def select(self) -> fx.GraphModule:
        """The part for the traced-through modules' current modes.

        Raises:
            PipelineConfigError: if no part was traced in these modes.
        """
        flags = tuple([m.training for m in self.__dict__["_traced"]])
        if flags == self._flags:
            return self.part
        other: fx.GraphModule | None = self.__dict__["other"]
        if other is not None and all(f == self._other_mode for f in flags):
            return other
        names: tuple[str, ...] = self.__dict__["_names"]
        changed = [
            f"{name}.training={now}" for name, now, then in zip(names, flags, self._flags)
            if now != then
        ]  # fmt: skip
        why = (
            "its traced code also differs in its operations between the modes (an "
            "`if self.training:` branch?), so the pipeline cannot switch"
            if other is None
            else f"it was traced in {_modes(self._flags)} and in "
            f"{_modes([self._other_mode])} only, not in these mixed modes"
        )
        raise PipelineConfigError(
            f"the pipeline split {self._root} by tracing it with torch.fx in "
            f"{_modes(self._flags)}, and its forward reads self.training (tracing fixes "
            f"the value it read); now {', '.join(changed)}, but {why}. Build the pipeline "
            "in the mode you run it in (e.g. a second Pipeline after model.eval() for "
            "evaluation), or give an nn.Sequential or a list of stage modules (their "
            "layers read their mode at every call)"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> ModeParts:
        super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        other: fx.GraphModule | None = self.__dict__["other"]
        if other is not None:
            other._apply(fn, recurse)  # type: ignore[no-untyped-call]  # idempotent conversions
        return self

    def forward(self, *args: Any) -> Any:
        return self.select()(*args)


def partition_graph_by_mode(
    module: nn.Module,
    stages: int,
    partition: Callable[[nn.Module, int, Trace], list[fx.GraphModule]],
) -> list[nn.Module]:
    """``partition(module, stages)``, with stages that follow the model's mode (see the
    module docstring).

    Args:
        module: the model.
        stages: the number of parts.
        partition: traces (with the tracer given) and splits ``module``
            (``partition_graph`` with its cost).

    Returns:
        The parts as they are when the traced code does not read the mode; else one
        :class:`ModeParts` per part.
    """
    # Blocks keeping Python state are called, not traced through (see traced_state).
    leaves = stateful_leaves(module, lambda found: traced_through(module, found),
                             lambda trace: trace(module))
    trace = trace_with(leaves)
    traced = traced_through(module, leaves)
    modules = [m for _, m in traced]
    flags = [m.training for m in modules]
    with attributes_put_back(traced):
        parts = partition(module, stages, trace)
    other_mode = not module.training
    try:
        with _in_mode(modules, other_mode), attributes_put_back(traced):
            others: list[fx.GraphModule] | None = partition(module, stages, trace)
    except Exception:  # not traceable in the other mode: it cannot be switched to
        others = None
    if others is not None and all(a.code == b.code for a, b in zip(parts, others)):
        return list(parts)
    if others is not None and not all(
        _structure(a) == _structure(b) for a, b in zip(parts, others)
    ):
        others = None
    root = type(module).__name__
    return [
        ModeParts(part, None if others is None else others[k], traced, flags, other_mode, root)
        for k, part in enumerate(parts)
    ]
