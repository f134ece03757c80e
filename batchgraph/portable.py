"""A recorded and scheduled batch as plain data, to build in one process and run in another.

The worker side (``Exporter.export``) turns a recorded policy into a ``PortableBatch``:

```
worker:  per-example code ──record──▶ Graph ──prune, schedule──▶ Schedule
                                        │                           │
            keys named, not held:       ▼                           ▼
            PortableKey("cell", StackKey, CallSignature, out spec)  Steps, GatherPlans (ints)
                                        └──────────┬────────────────┘
                                                   ▼  pickle (plain data only)
main:    bind(batch, model): names ─▶ live modules, shapes checked ─▶ Executor ─▶ tensors
```

Nothing in a ``PortableBatch`` holds a module, a parameter or a tensor that requires
grad: callables are *named* (a submodule path such as ``"cell"``, or an importable
``"torch:tanh"``), keys by their class name and ``CallSignature`` (per-example
``TensorSpec``s and static arguments), constants are Python scalars or tensors without
grad, and a parameter or buffer of the model that the per-example code passed to a call
itself (``self.cell(x, self.h0)``) is named too (``model_tensors``). The main process
resolves the names against its live model (``binding.py``), which is where the
parameters, and so autograd, come from.

The grad mode travels too: a call recorded where the per-example code turned grad off
(``with torch.no_grad():`` around a frozen encoder) runs without grad when bound, as it
did eagerly (``key_grad``). The mode the recording ran in as a whole (grad on, in a
worker) is not kept: the main process's mode at bind time stands for it, so a batch
bound under ``no_grad`` for validation builds no autograd graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from batchgraph import gcpause
from batchgraph.aliasing import check_changed
from batchgraph.gathering import GatherPlan, plan_gather
from batchgraph.graph import INFERENCE, LEAF_SHIFT, STORE_SHIFT, Graph, RecordedGrad
from batchgraph.handle import ResultHandle
from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.lifetimes import bounded
from batchgraph.naming import function_name, module_names, qualified_name
from batchgraph.on_copy import in_place_of
from batchgraph.passes import prune
from batchgraph.placeholders import is_placeholder
from batchgraph.policy import UNTRAVERSED, BatchingPolicy, refuse_hidden_handles
from batchgraph.schedule_cache import ScheduleCache
from batchgraph.scheduling import Schedule, build_schedule
from batchgraph.specs import (
    CallSignature,
    OutSpec,
    TensorSpec,
    dataclass_fields,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)

__all__ = [
    "Exporter", "OutputRef", "PortableBatch", "PortableKey", "SkippedExample", "export",
    "grad_mode",
]

CONSTANT_KIND = qualified_name(ConstantKey)


@dataclass(frozen=True)
class PortableKey:
    """A ``BatchKey`` described without live objects.

    Attributes:
        kind: the key class, ``"module:qualname"`` (``"batchgraph.keys:StackKey"``).
        target: the callable: a submodule path (``"cell"``, ``"layers.0"``; ``""`` is
            the model itself) when ``is_module``, else an importable function name;
            ``""`` for constants.
        is_module: whether ``target`` names a submodule.
        module_type: the submodule's class name (checked against the live module).
        call: the call signature (static arguments, per-example input specs).
        out_spec: the per-example output spec the call had when recorded.
        deterministic: False for random calls (dropout in training mode).
        batchable: False for keys whose calls run one at a time.
        on_copy: the target changes its first argument in place, and runs on a copy
            of it (``batchgraph.on_copy``).
    """

    kind: str
    target: str
    is_module: bool
    module_type: str | None
    call: CallSignature
    out_spec: OutSpec
    deterministic: bool
    batchable: bool
    on_copy: bool = False

    def describe(self) -> str:
        """How errors name this key: ``StackKey[cell]``."""
        return f"{self.kind.rpartition(':')[2]}[{self.target or 'constant'}]"


@dataclass(frozen=True)
class OutputRef:
    """Where a requested output lives: output ``leaf`` (or subtree) of ``node``."""

    node: int
    leaf: int
    spec: OutSpec


@dataclass
class SkippedExample:
    """An example whose recording raised, skipped under ``skip_errors=True``.

    Attributes:
        position: its position in the minibatch as sampled.
        index: its dataset index (the position when the index is unknown).
        error: ``"TypeName: message"`` of the exception.
        traceback: the original traceback, formatted.
    """

    position: int
    index: int
    error: str
    traceback: str


@dataclass
class PortableBatch:
    """One minibatch, recorded and scheduled, as plain picklable data.

    Attributes:
        keys: per key id of the schedule, its ``PortableKey`` (None for keys no step uses).
        num_nodes: nodes in the recorded graph (node ids are below this).
        constants: the per-example constants the schedule stacks, by node id.
        schedule: the steps, in order, with their gather plans.
        outputs: what the per-example function returned for each kept example, with
            every handle replaced by an ``OutputRef``.
        output_plan: when ``outputs`` is a list of single tensors of one spec, the plan
            that gathers them into one batched tensor (``bind(..., stack=True)``).
        example_ends: ``example_ends[i]`` is the node count after recording example
            ``i``: node ``n`` was first needed by the first ``i`` with ``n < ends[i]``.
        indices: dataset index of each kept example (positions when unknown).
        targets: the collated targets of the kept examples, or None.
        skipped: examples skipped because their recording raised.
        cache_hit: whether the schedule came from the schedule cache.
        record_seconds, schedule_seconds: time spent in the worker.
        model_tensors: constants that are the model's own parameters or buffers, by node
            id: their names (``"h0"``, ``"cell.bias"``), read from the live model.
        key_grad: the grad mode of the calls of a key id recorded in another mode than
            the recording's own (``False`` inside ``torch.no_grad()``).
    """

    keys: list[PortableKey | None]
    num_nodes: int
    constants: dict[int, Any]
    schedule: Schedule
    outputs: Any
    output_plan: GatherPlan | None
    example_ends: list[int]
    indices: list[int]
    targets: Any = None
    skipped: list[SkippedExample] = field(default_factory=list)
    cache_hit: bool = False
    record_seconds: float = 0.0
    schedule_seconds: float = 0.0
    model_tensors: dict[int, str] = field(default_factory=dict)
    key_grad: dict[int, RecordedGrad] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def launches(self) -> int:
        """Calls the schedule makes (an unbatchable step counts once per node)."""
        total = 0
        for step in self.schedule.steps:
            key = self.keys[step.key]
            if key is None or key.kind == CONSTANT_KIND:
                continue  # constants are stacked, not launched
            total += 1 if key.batchable else len(step.nodes)
        return total


class Exporter:
    """Turns policies recorded against ``model`` into ``PortableBatch``es.

    Keeps what does not change between batches: the submodule names and each key's
    description (keys are reused across policies, so most batches describe nothing
    new), and optionally a ``ScheduleCache``.

    Args:
        model: the model the per-example code calls (in a worker, its structure).
        cache: a schedule cache to consult, or None.

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        >>> m = M()
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [m.lin(torch.ones(2)) for _ in range(3)]
        >>> batch = Exporter(m).export(p, hs)
        >>> batch.keys[batch.schedule.steps[-1].key].target
        'lin'
    """

    def __init__(self, model: nn.Module, cache: ScheduleCache | None = None) -> None:
        self.model = model
        self.cache = cache
        self._names = module_names(model)
        # id(tensor) -> (name, tensor) for the model's parameters and buffers: a constant
        # that is one of them is exported by name (the tensor is held so its id stays).
        self._tensor_names: dict[int, tuple[str, torch.Tensor]] = {}
        named = [*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            self._tensor_names.setdefault(id(tensor), (name, tensor))
        # id(key) -> (key, description): the key is held so its id is not reused.
        self._described: dict[int, tuple[BatchKey, PortableKey]] = {}

    def export(
        self,
        policy: BatchingPolicy,
        outputs: Any,
        *,
        example_ends: list[int] | None = None,
        indices: list[int] | None = None,
        recorded_in: RecordedGrad | None = None,
    ) -> PortableBatch:
        """Prune, schedule (or reuse a cached schedule) and describe ``outputs``.

        Args:
            policy: the policy the outputs were recorded under; nothing computed yet.
            outputs: a list (one entry per example) of nestings of handles.
            example_ends: node counts after each example (see ``PortableBatch``).
            indices: dataset indices of the examples.
            recorded_in: the grad mode the recording as a whole ran in (``grad_mode()``
                before it began); calls recorded in another mode keep theirs. None:
                the mode now.

        Returns:
            The portable batch (targets and skipped examples left empty).

        Raises:
            ValueError: if the policy computed before, a constant requires grad, or a
                constant is a view of a model placeholder (``structure.py``).
            LookupError: if a callable has no name the main process could resolve.
        """
        ambient = grad_mode() if recorded_in is None else recorded_in
        # Like compute: scheduling allocates much while the recorded graph is alive.
        with gcpause.fewer_collections():
            return self._export(policy, outputs, example_ends, indices, ambient)

    def _export(
        self,
        policy: BatchingPolicy,
        outputs: Any,
        example_ends: list[int] | None,
        indices: list[int] | None,
        ambient: RecordedGrad,
    ) -> PortableBatch:
        graph = policy.graph
        if graph.stores:
            raise ValueError(
                f"{policy.name} already computed {len(graph.stores)} steps; export needs a "
                "policy that has only recorded (start a new BatchingPolicy per batch)"
            )
        start = time.perf_counter()
        roots: list[int] = []
        portable_outputs = _encode_outputs(outputs, graph, roots)
        if graph.changed:  # values changed in place through a view: see aliasing
            check_changed(graph, roots)
        schedule = None
        signature = None
        if self.cache is not None:
            signature = self.cache.signature(graph, roots, policy.scheduler)
            schedule = self.cache.lookup(signature)
        hit = schedule is not None
        if schedule is None:  # a hit needs no pruning either: the schedule holds the result
            schedule = build_schedule(graph, prune(graph, roots), policy.scheduler)
            if self.cache is not None and signature is not None:
                self.cache.store(signature, schedule)
        keys: list[PortableKey | None] = [None] * len(graph.keys)
        constants: dict[int, Any] = {}
        model_tensors: dict[int, str] = {}
        key_grad: dict[int, RecordedGrad] = {}
        recorded_grad = graph.key_grad
        for step in schedule.steps:
            if keys[step.key] is None:
                keys[step.key] = self._describe(graph, step.key)
                grad = recorded_grad.get(step.key)
                if grad is not None and grad != ambient:
                    key_grad[step.key] = grad
            if isinstance(graph.keys[step.key], ConstantKey):
                for n in step.nodes:
                    value = graph.constants[n]
                    if isinstance(value, torch.Tensor):
                        named = self._tensor_names.get(id(value))
                        if named is not None and named[1] is value:
                            model_tensors[n] = named[0]
                            continue
                    constants[n] = _portable_constant(value, n)
        output_plan = _output_plan(outputs, schedule, graph)
        schedule.planned_loc = None  # this process does not run it: do not keep it cached
        count = len(roots)
        return PortableBatch(
            keys=keys,
            num_nodes=len(graph),
            constants=constants,
            schedule=schedule,
            outputs=portable_outputs,
            output_plan=output_plan,
            example_ends=example_ends if example_ends is not None else [len(graph)] * count,
            indices=indices if indices is not None else list(range(count)),
            cache_hit=hit,
            schedule_seconds=time.perf_counter() - start,
            model_tensors=model_tensors,
            key_grad=key_grad,
        )

    def _describe(self, graph: Graph, kid: int) -> PortableKey:
        key = graph.keys[kid]
        cached = self._described.get(id(key))
        if cached is not None and cached[0] is key:
            return cached[1]
        kind = qualified_name(key)
        if isinstance(key, ConstantKey):
            # ConstantKeys are made per graph: cheap to describe, pointless to cache.
            return PortableKey(kind, "", False, None, key.call, key.spec, True, True)
        fn = key.fn
        # An in-place call recorded on a copy names the in-place callable.
        copied = in_place_of(fn)
        if copied is not None:
            fn = copied
        if isinstance(fn, nn.Module):
            name = self._names.get(id(fn))
            if name is None:
                raise LookupError(
                    f"{key.label} calls a module that is not a submodule of "
                    f"{type(self.model).__name__}, so the main process cannot find it by "
                    "name; make it an attribute of the model (or of one of its submodules)"
                )
            target, is_module, module_type = name, True, qualified_name(fn)
        else:
            target, is_module, module_type = function_name(fn), False, None
        # The first node of a key was recorded with this key object's own signature,
        # so its spec is the output spec that goes with key.call.
        out_spec = graph.node_spec[graph.node_key.index(kid)]
        described = PortableKey(
            kind, target, is_module, module_type, key.call, out_spec,
            key.deterministic, key.batchable, copied is not None,
        )
        # Bounded: a worker's exporter lives for the whole run, and keys made for
        # static arguments varying per batch came one each, held for good.
        self._described = bounded(self._described, id(key), (key, described))
        return described


def export(policy: BatchingPolicy, outputs: Any, model: nn.Module) -> PortableBatch:
    """Describe ``outputs`` recorded under ``policy`` as a ``PortableBatch``.

    Args:
        policy: the recording policy (nothing computed yet).
        outputs: a list, one entry per example, of nestings of handles.
        model: the model whose submodules the code called.

    Returns:
        The portable batch; run it with ``bg.bind(batch, model)``.

    Raises:
        ValueError, LookupError: see ``Exporter.export``; ValueError also for calls
            recorded under ``torch.autocast`` (a portable batch runs without it).

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        >>> m = M()
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [m.lin(torch.ones(2)) for _ in range(3)]
        >>> [t.shape for t in bg.bind(export(p, hs, m), m)]
        [torch.Size([2]), torch.Size([2]), torch.Size([2])]
    """
    if policy.graph.key_autocast:
        raise ValueError(
            "calls recorded under torch.autocast cannot be exported: a portable batch "
            "keeps no autocast state and bind runs it without autocast. Record outside "
            "the autocast region, or compute in this process."
        )
    return Exporter(model).export(policy, outputs)


def _encode_outputs(obj: Any, graph: Graph, roots: list[int]) -> Any:
    if type(obj) is ResultHandle:
        if obj._graph is not graph:
            raise ValueError(
                f"{obj!r} belongs to policy {obj._graph.name!r}, not {graph.name!r}; "
                "export each policy's handles with that policy"
            )
        roots.append(obj.node)
        return OutputRef(obj.node, obj.leaf, obj.spec)
    if isinstance(obj, list):
        return [_encode_outputs(x, graph, roots) for x in obj]
    if isinstance(obj, tuple):
        values = [_encode_outputs(x, graph, roots) for x in obj]
        return rebuild_sequence(type(obj), values)
    if isinstance(obj, dict):
        return rebuild_mapping(obj, [(k, _encode_outputs(v, graph, roots)) for k, v in obj.items()])
    if (names := dataclass_fields(obj)) is not None:
        return rebuild_dataclass(obj, names, lambda v: _encode_outputs(v, graph, roots))
    if isinstance(obj, UNTRAVERSED):
        refuse_hidden_handles(obj)  # else the handles themselves would be exported
    return obj


def grad_mode() -> RecordedGrad:
    """The grad mode now, as recorded calls note it: True, False or ``INFERENCE``
    (inference mode, even with grad enabled inside it: no autograd graph either way)."""
    if torch.is_inference_mode_enabled():
        return INFERENCE
    return torch.is_grad_enabled()


def _portable_constant(value: Any, node: int) -> Any:
    if isinstance(value, torch.Tensor) and is_placeholder(value):
        raise ValueError(
            f"constant node {node} (shape {tuple(value.shape)}) was computed in the worker "
            "from a weightless placeholder of the model's tensors (a view or slice of a "
            "parameter or buffer, such as self.h0[0] or self.position_ids[:n], or a "
            "tensor attribute that is neither), so it holds none of the live model's "
            "values. Pass the parameter or buffer itself to the call (it is read by name "
            "from the live model), or index a handle of it (bg.batched_value(self.h0)[0] "
            "records the indexing), register a plain tensor attribute as a buffer, or "
            "build the worker's model with a factory: GraphCollate(make_model, ...)."
        )
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise ValueError(
            f"constant node {node} is a tensor that requires grad (shape "
            f"{tuple(value.shape)}); its gradient could not reach the main process. Pass "
            "data as plain values or tensors without grad, and keep parameters in modules."
        )
    return value


def _output_plan(outputs: Any, schedule: Schedule, graph: Graph) -> GatherPlan | None:
    """A gather of all outputs into one batched tensor, when they are alike."""
    if not isinstance(outputs, (list, tuple)) or not outputs:
        return None
    first = outputs[0]
    if type(first) is not ResultHandle or type(first.spec) is not TensorSpec:
        return None
    for h in outputs:
        if type(h) is not ResultHandle or h.spec != first.spec:
            return None
    planned = schedule.planned_loc
    if planned is not None and planned[0] == graph.uid:
        # Scheduling this graph just worked out every node's location.
        where: Any = planned[1]
    else:
        wanted = {h.node for h in outputs}
        where = {}
        for step in schedule.steps:
            base = step.store << STORE_SHIFT
            for row, n in enumerate(step.nodes):
                if n in wanted:
                    where[n] = base | row
    codes = [where[h.node] | (h.leaf << LEAF_SHIFT) for h in outputs]
    # Rows per store, as build_schedule counts them (-1: per-example lists).
    keys = graph.keys
    sizes = [len(s.nodes) if keys[s.key].combine == "stack" else -1 for s in schedule.steps]
    return plan_gather([0], codes, sizes)
