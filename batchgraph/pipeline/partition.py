"""Splitting a model into pipeline stages.

* :func:`balanced_partition` — the exact min-max split of a cost list into ``p``
  contiguous non-empty parts (dynamic programming, O(p·n²)).
* :func:`layer_costs` — per-layer costs: profiled forward+backward time
  (``"profile"``, needs a sample input), parameter count (``"params"``) or ``"uniform"``.
* :func:`partition_sequential` — an ``nn.Sequential`` (or list of layers) into ``p``
  :class:`SequentialStage` stages holding the *same* layer objects (no copies). Each
  layer gets the previous layer's output as one value, as in ``nn.Sequential``: a tuple
  crossing into a stage reaches its first layer as that tuple (torchgpipe's convention).
* :func:`partition_graph` — any ``torch.fx``-traceable module into ``p`` ``GraphModule``
  parts cut along a topological order of its graph (networkx). Part ``k`` takes the
  values that cross cut ``k-1`` and returns those that cross cut ``k`` (a tensor when one
  value crosses, else a tuple), so running the parts in sequence equals the module.
  Parameters are fetched where they are used (never sent across a cut), and so are
  sizes and shapes (``b, t = idx.size()`` used by a last ``view(b, t, -1)``): a later
  part reads them again off the tensors they came from, which cross instead; an item
  taken out of a layer's tuple (an LSTM's ``out, (h, c)``) is taken in the layer's part,
  so the items cross, not the tuple. Any other non-tensor that crosses a cut (a Python
  value computed from a tensor's values) is reported by the stage at run time.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
import torch
from torch import Tensor, fx, nn

from batchgraph.pipeline import _autograd
from batchgraph.pipeline.errors import PipelineConfigError, StageMismatchError
from batchgraph.pipeline.microbatch import Batch

__all__ = [
    "COST_METHODS",
    "SequentialStage",
    "TooFewLayersError",
    "balanced_partition",
    "layer_costs",
    "partition_graph",
    "partition_sequential",
]


class TooFewLayersError(PipelineConfigError):
    """More parts were asked for than there are layers (or operations) to split.

    ``layers`` and ``parts`` keep the numbers, so a caller that knows how the parts were
    counted (``Pipeline``: stages x chunks) can say it in its own terms.
    """

    def __init__(self, message: str, *, layers: int, parts: int) -> None:
        super().__init__(message)
        self.layers = layers
        self.parts = parts


class SequentialStage(nn.Sequential):
    """A run of an ``nn.Sequential``'s layers, called as a pipeline stage.

    A stage is called with the tensors that cross into it as separate arguments
    (``stage(*tensors)``), but in the unsplit ``nn.Sequential`` a layer returning a tuple
    hands the next layer that tuple as one argument. So the inputs reach the first layer
    as one value: the tensor, or the tuple of them (a tuple batch is taken as
    ``model((x, mask))`` takes it on one device).

    Example:
        >>> class Pair(nn.Module):
        ...     def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        ...         return pair[0] * pair[1]
        >>> SequentialStage(Pair())(torch.ones(2), torch.full((2,), 3.0))
        tensor([3., 3.])
    """

    # The model's last stage: its output goes to the loss, which gets a one-element
    # tuple as one (see partition_sequential).
    last = False

    def forward(self, *inputs: Any) -> Any:
        value = inputs[0] if len(inputs) == 1 else inputs
        for layer in self:
            value = layer(value)
        if not self.last and isinstance(value, tuple | list) and len(value) == 1:
            # What crosses a cut is a tuple of tensors, where (h,) and h are the same: the
            # next layer (or the loss) would get h where one device gives it (h,).
            raise StageMismatchError(
                f"the last layer of this stage ({type(self[-1]).__name__}) returned a tuple "
                "of one tensor, which the pipeline hands on as that tensor, not as the "
                "tuple the next layer gets on one device; return the tensor itself (and "
                "take a tensor in the next layer), or cut the model elsewhere"
            )
        return value


#: The ``cost=`` values :func:`layer_costs` accepts.
COST_METHODS = ("profile", "params", "uniform")


def balanced_partition(costs: Sequence[float], parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` into ``parts`` contiguous non-empty ranges minimising the largest sum.

    Exact: dynamic programming over (parts used, prefix length). Among optimal splits the
    one with the earliest cuts is returned (deterministic).

    Args:
        costs: non-negative cost per item.
        parts: number of ranges, ``1 <= parts <= len(costs)``.

    Returns:
        ``[(start, stop), ...]`` half-open ranges covering ``0..len(costs)`` in order.

    Raises:
        PipelineConfigError: if ``parts`` is out of range or a cost is negative.

    Example:
        >>> balanced_partition([1, 1, 1, 4, 1], 2)
        [(0, 3), (3, 5)]
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise TooFewLayersError(
            f"cannot split {n} layers into {parts} stages: need 1 <= stages <= {n} "
            "(every stage needs at least one layer)",
            layers=n,
            parts=parts,
        )
    if not all(math.isfinite(c) and c >= 0 for c in costs):  # `nan < 0` is False
        raise PipelineConfigError(f"costs must be finite and >= 0, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest max-part cost splitting the first i items into k parts.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i] = value
                    cut[k][i] = j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return list(itertools.pairwise(bounds))


def _param_cost(module: nn.Module) -> float:
    # +1 so parameterless layers (activations) still count and spread over the stages.
    return float(sum(p.numel() for p in module.parameters()) + 1)


def _profile_error(
    index: int, layer: nn.Module, inputs: Sequence[Tensor], exc: Exception
) -> PipelineConfigError:
    """A layer that cannot run on what the sample became: name it, and what to give."""
    shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs)
    came = "sample=" if index == 0 else f"what layers 0..{index - 1} made of sample="
    text = str(exc).splitlines()[0] if str(exc) else ""
    return PipelineConfigError(
        f"cost='profile' could not time layer {index} ({type(layer).__name__}) on {came} "
        f"({shapes}): {type(exc).__name__}: {text}; give sample= one microbatch of the "
        "model's inputs, what model(sample) takes"
    )


def _profile(layers: Sequence[nn.Module], sample: Batch, repeat: int) -> list[float]:
    """Median forward+backward seconds per layer, leaving ``.grad``, buffers and ``sample``
    untouched."""
    params = list({id(p): p for layer in layers for p in layer.parameters()}.values())
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    values: tuple[Tensor, ...] = tuple(sample) if isinstance(sample, (tuple, list)) else (sample,)
    costs: list[float] = []
    try:
        for index, layer in enumerate(layers):
            times: list[float] = []
            out: tuple[Tensor, ...] = ()
            for _ in range(repeat):
                # Copies, so an in-place layer changes neither the sample nor the next
                # run's input, given as aliases of leaves that an in-place op may change
                # (ReLU(inplace=True)), as a stage's inputs are.
                leaves = [v.detach().clone().requires_grad_(v.is_floating_point()) for v in values]
                xs = tuple(_autograd.alias(v) if v.requires_grad else v for v in leaves)
                start = time.perf_counter()
                try:
                    result = layer(xs[0] if len(xs) == 1 else xs)  # as nn.Sequential does
                except Exception as exc:
                    raise _profile_error(index, layer, xs, exc) from exc
                out = tuple(result) if isinstance(result, (tuple, list)) else (result,)
                diff = [o for o in out if isinstance(o, Tensor) and o.requires_grad]
                if diff:
                    torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
                times.append(time.perf_counter() - start)
            costs.append(statistics.median(times))
            values = tuple(o.detach() for o in out)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for buffer, copy in saved_buffers:
                buffer.copy_(copy)
    return costs


def layer_costs(
    layers: Sequence[nn.Module],
    cost: str = "params",
    sample: Batch | None = None,
    *,
    repeat: int = 3,
) -> list[float]:
    """The cost of each layer, for :func:`balanced_partition`.

    Args:
        layers: the layers, in order (each takes the previous one's output).
        cost: ``"profile"`` (median measured forward+backward seconds over ``repeat``
            runs on ``sample``; gradients and buffers are restored afterwards),
            ``"params"`` (parameter count + 1) or ``"uniform"`` (1 each).
        sample: an input batch for the first layer; required for ``"profile"``.
        repeat: runs per layer when profiling.

    Returns:
        One cost per layer.

    Raises:
        PipelineConfigError: for an unknown ``cost`` or ``"profile"`` without ``sample``.

    Example:
        >>> from torch import nn
        >>> layer_costs([nn.Linear(2, 3), nn.ReLU()], "params")
        [10.0, 1.0]
    """
    if cost == "uniform":
        return [1.0] * len(layers)
    if cost == "params":
        return [_param_cost(layer) for layer in layers]
    if cost == "profile":
        if sample is None:
            raise PipelineConfigError(
                "cost='profile' times each layer on a sample input: pass sample= (one "
                "microbatch is enough)"
            )
        return _profile(layers, sample, repeat)
    raise PipelineConfigError(f"unknown cost {cost!r}; choose one of {', '.join(COST_METHODS)}")


def partition_sequential(
    layers: nn.Sequential | Sequence[nn.Module],
    stages: int,
    *,
    cost: str = "params",
    sample: Batch | None = None,
) -> list[SequentialStage]:
    """Split a sequence of layers into ``stages`` balanced :class:`SequentialStage` stages.

    The stages hold the original layer objects, so training them trains the original
    model; tuples between layers pass as in ``nn.Sequential`` (see :class:`SequentialStage`).

    Args:
        layers: an ``nn.Sequential`` or a list of modules applied in order.
        stages: the number of stages.
        cost: see :func:`layer_costs`.
        sample: a sample input batch, for ``cost="profile"``.

    Returns:
        ``stages`` sequential modules, in order.

    Raises:
        PipelineConfigError: for fewer layers than stages or a bad ``cost``.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
        >>> [len(s) for s in partition_sequential(net, 2)]
        [2, 2]
    """
    items = list(layers)
    bounds = balanced_partition(layer_costs(items, cost, sample), stages)
    stages_made = [SequentialStage(*items[a:b]) for a, b in bounds]
    stages_made[-1].last = True
    return stages_made


def _node_cost(gm: fx.GraphModule, node: fx.Node, cost: str) -> float:
    if cost == "uniform":
        return 1.0
    if node.op == "call_module":
        return _param_cost(gm.get_submodule(str(node.target)))
    return 1.0


# What reads a tensor's metadata, not its values: a Python number or torch.Size, which
# cannot cross a cut (a stage sends tensors), so a later part reads it again.
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "nelement", "stride", "get_device"})
_SHAPE_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})
# Arithmetic on those (B * T, x.shape[-1] // 2, len(x.shape)) is metadata too.
_ON_SHAPES = frozenset(
    {operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
     operator.truediv, operator.mod, operator.neg, operator.pow, len, int}
)  # fmt: skip


def _shape_nodes(order: Sequence[fx.Node]) -> set[fx.Node]:
    """The nodes whose values are read off tensors' metadata (see ``_SHAPE_METHODS``)."""
    shape: set[fx.Node] = set()
    for n in order:
        if n.op == "call_method" and n.target in _SHAPE_METHODS:
            shape.add(n)
        elif n.op == "call_function" and n.target is getattr:
            if len(n.args) == 2 and n.args[1] in _SHAPE_ATTRIBUTES:
                shape.add(n)
        elif n.op == "call_function" and n.target in _ON_SHAPES:
            inputs = n.all_input_nodes
            if inputs and all(i in shape for i in inputs):
                shape.add(n)
    return shape


def _shape_sources(node: fx.Node, shape: set[fx.Node]) -> set[fx.Node]:
    """The tensors a metadata node is read from (its nearest inputs that are not metadata)."""
    sources: set[fx.Node] = set()
    stack = [node]
    while stack:
        for i in stack.pop().all_input_nodes:
            if i in shape:
                stack.append(i)
            else:
                sources.add(i)
    return sources


def partition_graph(
    module: nn.Module,
    stages: int,
    *,
    cost: str = "uniform",
    tracer: Callable[[nn.Module], fx.GraphModule] = fx.symbolic_trace,
) -> list[fx.GraphModule]:
    """Split an fx-traceable module into ``stages`` parts along a topological order.

    Args:
        module: the module; it is traced with ``tracer`` (``torch.fx.symbolic_trace``).
        stages: the number of parts.
        cost: ``"uniform"`` (each operation counts 1) or ``"params"`` (a submodule call
            counts its parameters + 1).
        tracer: how to get the graph.

    Returns:
        The parts; part ``k`` takes what crosses cut ``k-1`` (part 0: the module's
        inputs) and returns what crosses cut ``k`` (the last: the module's output). They
        share the original parameters.

    Raises:
        PipelineConfigError: for more stages than operations or an unknown ``cost``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> a, b = partition_graph(net, 2)
        >>> x = torch.randn(2, 3)
        >>> torch.allclose(b(a(x)), net(x))
        True
    """
    if cost not in ("uniform", "params"):
        raise PipelineConfigError(
            f"partition_graph supports cost 'uniform' or 'params', got {cost!r}"
        )
    gm = tracer(module)
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    graph.add_edges_from((src, n) for n in nodes for src in n.all_input_nodes)
    order: list[fx.Node] = list(
        nx.lexicographical_topological_sort(graph, key=lambda n: position[n])
    )
    compute = [n for n in order if n.op in ("call_module", "call_function", "call_method")]
    bounds = balanced_partition([_node_cost(gm, n, cost) for n in compute], stages)
    part_of: dict[fx.Node, int] = {}
    for k, (a, b) in enumerate(bounds):
        for n in compute[a:b]:
            part_of[n] = k
    for n in order:
        if n.op == "placeholder":
            part_of[n] = 0
        elif n.op == "call_function" and n.target is operator.getitem:
            # With what it takes apart: an item of a layer's tuple (an LSTM's output and
            # state) crosses a cut, never the tuple (a tensor index is taken as early).
            part_of[n] = max(part_of.get(i, 0) for i in n.all_input_nodes)
    shape = _shape_nodes(order)
    output = next(n for n in order if n.op == "output")

    def crossing(k: int) -> list[fx.Node]:
        """Values made in parts <= k and used after part k (parameters excluded); for a
        size or shape, the tensors it is read from (the later part reads it again)."""
        wanted: set[fx.Node] = set()
        for n in order:
            if n.op in ("get_attr", "output") or part_of[n] > k:
                continue
            users = list(n.users)
            if any(u is output or part_of.get(u, -1) > k for u in users):
                wanted.update(_shape_sources(n, shape) if n in shape else (n,))
        return [n for n in order if n in wanted and n.op != "get_attr"]

    parts: list[fx.GraphModule] = []
    for k in range(stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if k == 0:
            for n in order:
                if n.op == "placeholder":
                    env[n] = g.node_copy(n)
        else:
            for n in crossing(k - 1):
                env[n] = g.placeholder(n.name)

        def lookup(n: fx.Node, g: fx.Graph = g, env: dict[fx.Node, fx.Node] = env) -> fx.Node:
            if n not in env and n.op == "get_attr":
                env[n] = g.node_copy(n)  # parameters are fetched where they are used
            elif n not in env and n in shape:  # read again from the tensors that crossed
                env[n] = g.node_copy(n, lookup)
            return env[n]

        for n in compute:
            if part_of[n] == k:
                env[n] = g.node_copy(n, lookup)
        if k == stages - 1:
            g.node_copy(output, lookup)
        else:
            out = [env[n] for n in crossing(k)]
            g.output(out[0] if len(out) == 1 else tuple(out))
        g.lint()
        parts.append(fx.GraphModule(gm, g, class_name=f"Stage{k}"))
    return parts
