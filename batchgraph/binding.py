"""Running a ``PortableBatch`` against the live model: names to modules, then execute.

``Binder.run`` first resolves every key of the batch (and checks it) and only then
executes, so a schedule built for another model is refused before any computation:

1. the target resolves: a submodule path of the live model, or an importable function;
2. a module target has the class it had when recorded;
3. the key class resolves to a ``BatchKey`` subclass, and the live model's rules give
   that class for the call (or the worker fell back to ``UnbatchedKey``), with the same
   randomness (dropout in training mode is not merged; a mismatch would change results);
4. the live callable, run on fake tensors of the recorded per-example input specs,
   returns the recorded output spec (so weights of another shape are caught).

A checked key is cached per ``Binder``, so steady-state batches only look keys up
(and check that each module key's submodule is still the one at its path: a submodule
replaced since, a new head for fine-tuning, is checked again and its key made anew, so
the batch never runs the old module). Execution builds a ``Graph`` holding just what
the ``Executor`` reads (keys, constants, the model's own tensors the per-example code
used, the grad modes of calls recorded under ``no_grad``, locations) and runs the
batch's schedule: the real parameters are used, and autograd connects the outputs to
them.
"""

from __future__ import annotations

import time
import weakref
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgraph import gcpause
from batchgraph.autocasting import autocast_enabled
from batchgraph.buffers import Watch, computing, watches_read_by
from batchgraph.errors import BatchgraphError, ShapeMismatchError
from batchgraph.executor import Executor
from batchgraph.graph import Graph, RecordedGrad
from batchgraph.handle import ResultHandle
from batchgraph.held import held_on
from batchgraph.keys import BatchKey, ConstantKey, UnbatchedKey, callable_name
from batchgraph.lifetimes import bounded
from batchgraph.naming import qualified_name, resolve_function
from batchgraph.on_copy import on_copy
from batchgraph.portable import OutputRef, PortableBatch, PortableKey
from batchgraph.recording import CallSite
from batchgraph.rules import KeyFactory, choose_key, rule_table
from batchgraph.specs import (
    NO_TENSOR,
    TensorSpec,
    dataclass_fields,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
    spec_leaves,
)

__all__ = ["BindStats", "Binder", "ScheduleMismatchError", "bind"]

# Key ids no step uses need some entry: the executor never reads them.
_UNUSED = ConstantKey(TensorSpec((), torch.float32, torch.device("cpu")))


class ScheduleMismatchError(BatchgraphError, ValueError):
    """A portable batch does not fit the live model (names, classes or shapes)."""


@dataclass
class BindStats:
    """Counters of one ``Binder``: batches and examples run, keys checked, time spent.

    Attributes:
        batches, examples: batches run and examples in them.
        skipped: examples the workers skipped (``skip_errors=True``).
        cache_hits: batches whose schedule came from a worker's schedule cache.
        keys_checked: distinct keys resolved and checked (each once per binder).
        bind_seconds: resolving and checking; ``execute_seconds``: running the steps.
    """

    batches: int = 0
    examples: int = 0
    skipped: int = 0
    cache_hits: int = 0
    keys_checked: int = 0
    bind_seconds: float = 0.0
    execute_seconds: float = 0.0


class Binder:
    """Runs portable batches against one live model; checks each distinct key once.

    Args:
        model: the live model (with the weights) the batches were recorded against.
        rules: the ``rules`` the workers' ``BatchingPolicy`` used, if any.

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 3)
        >>> m = M()
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [m.lin(torch.ones(2)) for _ in range(4)]
        >>> batch = bg.export(p, hs, m)              # in a worker, in real use
        >>> Binder(m).run(batch, stack=True).shape
        torch.Size([4, 3])
    """

    def __init__(self, model: nn.Module, rules: Mapping[Any, KeyFactory] | None = None) -> None:
        self.model = model
        self.rules: dict[Any, KeyFactory] = rule_table(rules)
        self.stats = BindStats()
        self._checked: dict[PortableKey, BatchKey] = {}
        # In-place callables run on a copy (batchgraph.on_copy), one wrapper each, so
        # that their keys compare equal from batch to batch.
        self._copying: dict[int, tuple[Any, Any]] = {}
        # The buffers each key's calls read (batchgraph.buffers): a batch's run is a
        # computation, so the running statistics it updates are not a change from
        # outside for calls of the same modules recorded in this process and pending.
        self._buffers: weakref.WeakKeyDictionary[BatchKey, tuple[Watch, ...]] = (
            weakref.WeakKeyDictionary()
        )

    def keys(self, batch: PortableBatch) -> list[BatchKey]:
        """Resolve and check every key of ``batch`` (see the module docstring).

        Raises:
            ScheduleMismatchError: naming the key, the module and the mismatch.
        """
        out: list[BatchKey] = []
        live: dict[str, nn.Module | None] = {}  # submodule by path, looked up once per batch
        for pk in batch.keys:
            if pk is None:
                out.append(_UNUSED)
                continue
            try:
                key = self._checked.get(pk)
            except TypeError:  # an unhashable static argument: check it every time
                out.append(self._check(pk))
                continue
            if key is not None and pk.is_module:
                # The cached key holds the module it was checked against; a submodule
                # replaced since must not run in its place (stale parameters, no grads
                # for the new ones).
                target = pk.target
                module = live[target] if target in live else live.setdefault(
                    target, self._lookup(target))
                if module is not key.fn:
                    key = None
            if key is None:
                # Bounded: the model's binder lives as long as the model, and varying
                # static arguments (a float per batch) made a key each, for good.
                key = self._check(pk)
                self._checked = bounded(self._checked, pk, key)
            out.append(key)
        return out

    def _lookup(self, target: str) -> nn.Module | None:
        try:
            return self.model.get_submodule(target)
        except AttributeError:
            return None

    def run(self, batch: PortableBatch, *, stack: bool = False) -> Any:
        """Check ``batch`` against the live model, execute it, return its outputs.

        Args:
            batch: a ``PortableBatch`` (from a worker, or ``bg.export``).
            stack: return the outputs as one batched tensor (needs every example's
                output to be one tensor of the same shape) instead of a list.

        Returns:
            ``batch.outputs`` with every reference replaced by its per-example tensor
            (or tuple), connected by autograd to the model's parameters; with
            ``stack=True``, one tensor whose row ``i`` is example ``i``'s output.

        Raises:
            ScheduleMismatchError: before any computation, if the batch does not fit.
            ValueError: ``stack=True`` for outputs that do not stack.
            BatchedCallError: if a batched call raises (names the dataset index).
        """
        with gcpause.fewer_collections():
            return self._run(batch, stack)

    def _run(self, batch: PortableBatch, stack: bool) -> Any:
        start = time.perf_counter()
        if stack and batch.output_plan is None and not len(batch):
            # Not "outputs of other shapes": there are none, so no shape to stack to.
            skipped = batch.skipped
            why = (
                f"all {len(skipped)} of its examples were skipped (the first: example "
                f"{skipped[0].position}, dataset index {skipped[0].index}: {skipped[0].error})"
                if skipped else "it was made from no examples"
            )
            raise ValueError(
                f"stack=True on a batch with no examples: {why}. Check len(batch) before "
                "binding with stack=True (and skip such a batch), or bind with stack=False "
                "(an empty list)"
            )
        if stack and batch.output_plan is None:
            raise ValueError(
                "stack=True needs every example's output to be one tensor of the same "
                "per-example shape; this batch's outputs are not (use stack=False)"
            )
        graph = Graph("portable")
        graph.keys = self.keys(batch)
        graph.constants = batch.constants
        if batch.model_tensors:
            graph.constants = self._model_tensors(batch, graph)
        if batch.key_grad:
            graph.key_grad = _key_grad(batch.key_grad)
        graph.node_loc = [-1] * batch.num_nodes
        checked = time.perf_counter()
        executor = Executor(graph, example_of=_ExampleOf(batch))
        with computing(self._watched(graph.keys)):
            executor.run(batch.schedule, locate=not stack)
        if stack:
            assert batch.output_plan is not None
            # The executor's own gather: a view when outputs are contiguous and in order.
            result: Any = executor._gather(batch.output_plan)
        else:
            result = _values(batch.outputs, graph)
        done = time.perf_counter()
        stats = self.stats
        stats.batches += 1
        stats.examples += len(batch)
        stats.skipped += len(batch.skipped)
        stats.cache_hits += batch.cache_hit
        stats.bind_seconds += checked - start
        stats.execute_seconds += done - checked
        return result

    def _watched(self, keys: list[BatchKey]) -> list[Watch]:
        watched: dict[int, Watch] = {}
        known = self._buffers
        for key in keys:
            found = known.get(key)
            if found is None:
                found = known[key] = watches_read_by(key.fn)
            for w in found:
                watched[id(w)] = w
        return list(watched.values())

    def _model_tensors(self, batch: PortableBatch, graph: Graph) -> dict[int, Any]:
        """The batch's constants with the model's own tensors read from the live model.

        A parameter (or buffer) the per-example code passed to a call itself was
        exported by name; the live one is stacked, with grad where it requires grad
        (as when computing in process), so its gradient reaches it.
        """
        constants = dict(batch.constants)
        specs = {n: graph.keys[step.key] for step in batch.schedule.steps for n in step.nodes
                 if n in batch.model_tensors}
        with_grad = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        for n, name in batch.model_tensors.items():
            tensor = self._tensor(name)
            key = specs.get(n)
            spec = key.spec if isinstance(key, ConstantKey) else None
            if spec is not None and (tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype):
                raise ScheduleMismatchError(
                    f"the batch reads the model's tensor {name!r} as {spec.describe()}, but "
                    f"it is {tuple(tensor.shape)} {tensor.dtype} in the live model. Was the "
                    "batch recorded for another model?"
                )
            constants[n] = tensor
            if with_grad and tensor.requires_grad:
                graph.grad_constants.add(n)
        return constants

    def _tensor(self, name: str) -> torch.Tensor:
        path, _, attr = name.rpartition(".")
        owner = self._lookup(path)
        tensor = getattr(owner, attr, None) if owner is not None else None
        if not isinstance(tensor, torch.Tensor):
            raise ScheduleMismatchError(
                f"the batch reads the model's tensor {name!r} (a parameter or buffer the "
                f"per-example code used), but {type(self.model).__name__} has no tensor of "
                "that name. Was the batch recorded for another model?"
            )
        return tensor

    # -- checking one key ---------------------------------------------------------------
    def _module(self, pk: PortableKey) -> nn.Module:
        module = self._lookup(pk.target)
        if module is None:
            names = [name for name, _ in self.model.named_modules()]
            shown = ", ".join(repr(n) for n in names[1:12])
            raise ScheduleMismatchError(
                f"the batch calls submodule {pk.target!r} ({pk.describe()}), but "
                f"{type(self.model).__name__} has no submodule of that name (it has "
                f"{shown or 'none'}). Was the batch recorded for another model?"
            )
        return module

    def _check(self, pk: PortableKey) -> BatchKey:
        self.stats.keys_checked += 1
        try:
            cls = resolve_function(pk.kind)
        except LookupError as err:
            raise ScheduleMismatchError(f"key class of {pk.describe()}: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, BatchKey)):
            raise ScheduleMismatchError(f"{pk.kind!r} ({pk.describe()}) is not a BatchKey class")
        if cls is ConstantKey:
            assert isinstance(pk.out_spec, TensorSpec)
            return ConstantKey(pk.out_spec)
        fn: Any
        if pk.is_module:
            fn = self._module(pk)
            if qualified_name(fn) != pk.module_type:
                raise ScheduleMismatchError(
                    f"submodule {pk.target!r} is a {qualified_name(fn)} in the live model, "
                    f"but the batch was recorded with a {pk.module_type}. Was the batch "
                    "recorded for another model?"
                )
        else:
            try:
                fn = resolve_function(pk.target)
            except LookupError as err:
                raise ScheduleMismatchError(f"{pk.describe()}: {err}") from err
        if pk.on_copy:
            held = self._copying.get(id(fn))
            if held is None or held[0] is not fn:
                held = self._copying[id(fn)] = (fn, on_copy(fn, callable_name(fn)))
            fn = held[1]
        live = choose_key(fn, pk.call, self.rules)
        if type(live) is not cls and cls is not UnbatchedKey:
            raise ScheduleMismatchError(
                f"{pk.target!r} was recorded with key class {pk.kind}, but the live model's "
                f"rules give {qualified_name(live)}; pass the workers' rules to the Binder "
                "(Binder(model, rules=...)) or record against the same model"
            )
        if live.deterministic != pk.deterministic:
            raise ScheduleMismatchError(
                f"{pk.describe()} was recorded with deterministic={pk.deterministic} but is "
                f"deterministic={live.deterministic} now (dropout in train vs eval mode?); "
                "record with the model in the mode it runs in"
            )
        key = live if type(live) is cls else UnbatchedKey(fn, pk.call)
        self._check_shapes(pk, fn)
        return key

    def _check_shapes(self, pk: PortableKey, fn: Any) -> None:
        # The recording path's own inference: the call on fake tensors, no real compute.
        site = CallSite(fn)
        try:
            spec, _, _ = site._bg_infer_spec(pk.call)
        except (ShapeMismatchError, TypeError, RuntimeError) as err:
            raise ScheduleMismatchError(
                f"{pk.describe()} does not accept the recorded per-example inputs in the live "
                f"model: {err}. Was the batch recorded for another model?"
            ) from err
        if pk.out_spec is not None and spec != pk.out_spec:
            raise ScheduleMismatchError(
                f"{pk.describe()} returns {_show(spec)} per example in the live model, but "
                f"{_show(pk.out_spec)} when the batch was recorded. "
                + _mismatch_hint(spec, pk.out_spec)
            )


def _mismatch_hint(live: Any, recorded: Any) -> str:
    """Why the live and the recorded output specs may differ."""
    a, b = spec_leaves(live), spec_leaves(recorded)
    if len(a) == len(b) and all(
        isinstance(x, TensorSpec) and isinstance(y, TensorSpec) and x.shape == y.shape
        for x, y in zip(a, b)
    ):
        # Same shapes, another dtype or device: the worker's copy of the model is the
        # one GraphCollate was made from, so a conversion after that does not reach it.
        return (
            "Was the live model converted (.double(), .half(), .to(device)) after the "
            "GraphCollate was made from it? Make the GraphCollate from the converted model "
            "(or a factory that converts it)."
        )
    return "Was the batch recorded for another model (different sizes)?"


def _show(spec: Any) -> str:
    if isinstance(spec, TensorSpec):
        return spec.describe()
    if isinstance(spec, tuple):
        return "(" + ", ".join(_show(s) for s in spec) + ")"
    return "None" if spec is NO_TENSOR else "an unknown structure"


class _ExampleOf:
    """Maps a node to the dataset index of the first example that needed it."""

    def __init__(self, batch: PortableBatch) -> None:
        self.ends = batch.example_ends
        self.indices = batch.indices

    def __call__(self, node: int) -> int | None:
        i = bisect_right(self.ends, node)
        return self.indices[i] if i < len(self.indices) else None


def _key_grad(recorded: dict[int, RecordedGrad]) -> dict[int, RecordedGrad]:
    """The recorded grad modes to run in: all of them, but in inference mode those
    without grad (they run in it, as the rest of the batch does)."""
    if not torch.is_inference_mode_enabled():
        return recorded
    return {kid: grad for kid, grad in recorded.items() if grad is True}


def _values(obj: Any, graph: Graph) -> Any:
    if type(obj) is OutputRef:
        # A handle on the bound graph reads values exactly as compute() does.
        return ResultHandle(graph, obj.node, obj.leaf, obj.spec).value
    if isinstance(obj, list):
        return [_values(x, graph) for x in obj]
    if isinstance(obj, tuple):
        values = [_values(x, graph) for x in obj]
        return rebuild_sequence(type(obj), values)
    if isinstance(obj, dict):
        return rebuild_mapping(obj, [(k, _values(v, graph)) for k, v in obj.items()])
    if (names := dataclass_fields(obj)) is not None:
        return rebuild_dataclass(obj, names, lambda v: _values(v, graph))
    return obj


# The attribute holding bind's Binder on the model (batchgraph.held): a Binder refers
# to its model, so a WeakKeyDictionary of them kept every model bound for good.
_BINDER = "_batchgraph_binder"


def bind(
    batch: PortableBatch,
    model: nn.Module,
    *,
    rules: Mapping[Any, KeyFactory] | None = None,
    stack: bool = False,
) -> Any:
    """Run a portable batch on ``model``'s live parameters; see ``Binder.run``.

    Uses one ``Binder`` per model (per rules), so keys are checked once per model.

    Args:
        batch: the batch recorded and scheduled elsewhere.
        model: the live model.
        rules: the workers' policy rules, if any.
        stack: return one batched tensor instead of a list of per-example outputs.

    Returns:
        The outputs, autograd intact.

    Raises:
        ScheduleMismatchError: if the batch does not fit ``model`` (nothing computed).
        RuntimeError: inside ``torch.autocast``: the batch was recorded without it.

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 3)
        >>> m = M()
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [m.lin(torch.ones(2)) for _ in range(2)]
        >>> len(bg.bind(bg.export(p, hs, m), m))
        2
    """
    if autocast_enabled():
        raise RuntimeError(
            "bg.bind runs inside torch.autocast, but the batch was recorded (in a worker) "
            "without it: its calls' dtypes are full precision. Call bind outside the "
            "autocast region, or record in the main process inside it (BatchingPolicy)."
        )
    # A list, so that other rules replace the Binder in place.
    held: list[Binder] = held_on(model, _BINDER, list)
    if not held or held[0].rules != rule_table(rules):
        held[:] = [Binder(model, rules)]
    return held[0].run(batch, stack=stack)
