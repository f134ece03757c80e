"""``Executor``: runs a ``Schedule`` on the live modules, autograd intact.

Each step's outputs stay batched (one tensor per output leaf, rows in node order) and
are appended to ``graph.stores``. Inputs are gathered by the step's plans
(``batchgraph.gathering``): the sources concatenated (usually a pool's carried rows
and the outputs made since), then one ``index_select`` that puts the step's rows in
node order followed by the rows later steps still need, carried to the pool's next
gather. A source that is used in order is taken as a view; an input whose rows are
one run of one source is passed as that view, and one whose rows all lie in one
source as one ``index_select`` of them, without the cat (a direct plan). All of these are
differentiable, so gradients flow from any computed value back to the parameters
and constants that produced it.

When a batched call raises, the executor reruns that step's calls one at a time to
find the first failing one, and raises ``BatchedCallError`` naming the key, the
callable, the batch and the failing example.
"""

from __future__ import annotations

import contextlib
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgraph.autocasting import autocast_state, in_autocast_state
from batchgraph.compute_checks import (
    check_default_dtype,
    check_modes,
    check_parameters,
    own_renorms,
    watching_attributes,
    watching_buffers,
)
from batchgraph.eager_grad import eager_requires_grad
from batchgraph.errors import BatchedCallError, ConstantChangedError, NotATensorError
from batchgraph.gathering import CARRY, GatherPlan
from batchgraph.graph import INFERENCE, STORE_SHIFT, Graph, RecordedGrad
from batchgraph.keys import BatchKey, ConstantKey
from batchgraph.recording import not_recording
from batchgraph.result_checks import check_columns, check_stacked
from batchgraph.scheduling import Schedule, Step, leaf_specs
from batchgraph.specs import flatten_output

__all__ = ["Executor"]

ExampleOf = Callable[[int], "int | None"]

_CPU = torch.device("cpu")
_NOTHING_WATCHED = contextlib.nullcontext()


class Executor:
    """Executes schedules against a graph's keys (and thus the live modules).

    Example:
        >>> import batchgraph as bg, torch
        >>> from batchgraph.passes import prune
        >>> from batchgraph.scheduling import build_schedule
        >>> with bg.BatchingPolicy() as p:
        ...     h = bg.batched_func(torch.tanh)(torch.zeros(2))
        >>> Executor(p.graph).run(build_schedule(p.graph, prune(p.graph, [h.node])))
        >>> h.value
        tensor([0., 0.])
    """

    def __init__(self, graph: Graph, example_of: ExampleOf | None = None) -> None:
        self.graph = graph
        self._example_of = example_of
        # Index tensors built from plans, per device; plans are plain lists.
        # The list is kept beside its tensor so its id cannot be reused while cached.
        self._index_cache: dict[tuple[int, torch.device], tuple[list[int], torch.Tensor]] = {}
        # Rows each pool carries to its next gather (see batchgraph.gathering).
        self._carry: dict[int, torch.Tensor] = {}
        # The current schedule's index lists: where each starts in one flat tensor
        # (kept per device); the list is held so its id cannot be reused meanwhile.
        self._spans: dict[int, tuple[list[int], int]] = {}
        self._flat_on: dict[torch.device, torch.Tensor] = {}

    def run(self, schedule: Schedule, *, locate: bool = True) -> None:
        """Run every step; on success record where each node's value lives.

        Args:
            schedule: the steps, built for this graph (or a graph of its structure).
            locate: record each node's location (``graph.node_loc``). A caller that
                reads results straight from the stores (a ``Binder`` stacking a
                batch's outputs by its output plan) skips that pass over every node.

        Raises:
            BatchedCallError: when a call raises (names key, callable and examples).
            NotATensorError: when a call returns something other than tensors.
        """
        graph = self.graph
        if schedule.base_store != len(graph.stores):
            raise ValueError(
                f"schedule starts at store {schedule.base_store} but the graph has "
                f"{len(graph.stores)}; schedules must run in the order they were built"
            )
        check_default_dtype(graph, schedule)
        if graph.key_training or graph.key_submodes:
            check_modes(graph, schedule)
        if graph.key_versions:
            check_parameters(graph, schedule)
        # Buffers, attributes and embedding weights (max_norm) the steps may change
        # themselves are the computation's own (compute_checks), after the checks
        # that nothing else changed them since their calls were recorded.
        watching = watching_buffers(graph, schedule) if graph.key_buffers else _NOTHING_WATCHED
        attributes = watching_attributes(graph, schedule) if graph.key_attrs else _NOTHING_WATCHED
        renorms = own_renorms(graph, schedule) if graph.key_versions else _NOTHING_WATCHED
        added = 0
        guard, wanted, constants_outside = self._modes(schedule)
        # Likewise each call runs in the autocast state it was recorded in (mostly
        # none, and none is in force: nothing to do).
        casts = graph.key_autocast
        ambient_cast = autocast_state()
        keys = graph.keys
        try:
            with guard, not_recording(), watching, attributes, renorms:  # a batched call computes, even inside `with`
                # Index tensors too are made here: in inference mode they would be
                # inference tensors, which a gather with grad cannot save.
                self._index_all(schedule)
                for step, grad in zip(schedule.steps, wanted):
                    if isinstance(keys[step.key], ConstantKey):
                        if constants_outside:
                            with torch.inference_mode(False):
                                graph.stores.append(self._run_step(step, grad))
                        else:
                            graph.stores.append(self._run_step(step, grad))
                    elif (casts.get(step.key) if casts else None) == ambient_cast:
                        graph.stores.append(self._run_step(step, grad))
                    else:
                        with in_autocast_state(casts.get(step.key)):
                            graph.stores.append(self._run_step(step, grad))
                    added += 1
        except BaseException:
            del graph.stores[len(graph.stores) - added :]
            raise
        finally:
            self._carry.clear()
        planned, schedule.planned_loc = schedule.planned_loc, None
        if not locate:
            return
        if planned is not None and planned[0] == graph.uid and len(planned[1]) == len(graph.node_loc):
            # build_schedule already worked out every location (on a copy).
            graph.node_loc = node_loc = planned[1]
        else:
            node_loc = graph.node_loc
            setloc = node_loc.__setitem__
            for step in schedule.steps:
                base = step.store << STORE_SHIFT
                # node_loc[n] = base | row for each node, looped in C.
                deque(map(setloc, step.nodes, range(base, base + len(step.nodes))), maxlen=0)
        try:
            graph.first_uncomputed = node_loc.index(-1, graph.first_uncomputed)
        except ValueError:  # everything is computed
            graph.first_uncomputed = len(node_loc)
        graph.new_stamp()

    def _run_step(self, step: Step, grad: RecordedGrad | None = None) -> list[Any]:
        graph = self.graph
        key = graph.keys[step.key]
        size = len(step.nodes)
        if isinstance(key, ConstantKey):
            constants = graph.constants
            values = [constants[n] for n in step.nodes]
            if graph.constant_versions:
                self._check_unchanged(step.nodes)
                self._detach_switched_on(step.nodes, values)
            return [key.run(key.fn, [values], size)]
        if step.refs:
            inputs: list[Any] = [self._fetch(refs) for refs in step.refs]
        else:
            inputs = [None] * key.call.num_inputs
            for plan in step.gathers:
                if plan.direct is not None:
                    for p, view in zip(plan.positions, self._direct(plan, size)):
                        inputs[p] = view
                    continue
                gathered = self._gather(plan)
                if len(plan.positions) == 1:
                    inputs[plan.positions[0]] = gathered
                else:
                    # One split, not a slice each: in backward, one node gathers the
                    # chunks' gradients (a slice's backward zero-fills the whole input).
                    for p, chunk in zip(plan.positions, torch.split(gathered, size)):
                        inputs[p] = chunk
        if key.call.num_inputs:
            self._detach_borrowed_grad(step, inputs)
        try:
            if grad is None or grad is torch.is_grad_enabled():
                out = key.run(key.fn, inputs, size)
            elif grad is INFERENCE:
                # Outside a compute made wholly in inference mode (see _modes), a call
                # made in it runs without grad, out of it: inference tensors here
                # could not be saved by later calls with grad, where eager values
                # (views of normal tensors) could.
                with torch.set_grad_enabled(False):
                    out = key.run(key.fn, inputs, size)
            else:  # recorded in the other grad mode
                with torch.set_grad_enabled(bool(grad)):
                    out = key.run(key.fn, inputs, size)
        except Exception as err:
            raise self._diagnose(key, step, inputs, err) from err
        if key.combine == "list":
            return self._columns(key, step, out, grad)
        leaves: list[torch.Tensor] = []
        try:
            flatten_output(out, leaves)
        except TypeError as err:
            raise NotATensorError(f"{key.label} returned {type(out).__name__}: {err}") from err
        if grad is False or grad is INFERENCE:
            leaves = _without_inert_views(leaves)
        first = step.nodes[0]
        # (A graph bound from a PortableBatch carries no specs: its keys check alone.)
        specs = leaf_specs(key, graph.node_spec[first]) if first < len(graph.node_spec) else leaves
        check_stacked(key, leaves, specs, size, autocast=step.key in graph.key_autocast)
        return leaves

    def _detach_borrowed_grad(self, step: Step, inputs: list[Any]) -> None:
        """Detach each input that requires grad only by the company it was gathered in.

        Inputs are gathered many rows at once (a pool's one ``index_select``; constants
        of one spec stacked together), so rows whose values require no grad eagerly (a
        target, a mask) require grad when gathered with rows that do. Some calls refuse
        that ("The function 'soft_margin_loss' is not differentiable with respect to
        argument 'target'"), for code that runs eagerly. Detached, nothing is lost:
        no gradient reaches a leaf through such rows eagerly either. One check per
        input that requires grad, settled by its first value that does (memoised).
        """
        graph, node_inputs, nodes = self.graph, self.graph.node_inputs, step.nodes
        if len(node_inputs) < len(graph.node_loc):  # bound from a PortableBatch: none kept
            return
        for p, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                if not x.requires_grad:
                    continue
            elif not (isinstance(x, list)
                      and any(isinstance(t, torch.Tensor) and t.requires_grad for t in x)):
                continue
            if any(eager_requires_grad(graph, node_inputs[n][p][0]) for n in nodes):
                continue
            inputs[p] = (x.detach() if isinstance(x, torch.Tensor)
                         else [t.detach() if isinstance(t, torch.Tensor) else t for t in x])

    def _modes(
        self, schedule: Schedule
    ) -> tuple[contextlib.AbstractContextManager[Any], list[RecordedGrad | None], bool]:
        """Around the run: a guard, each step's grad mode (None: as it is), and
        whether constants are stacked outside inference mode.

        Each call runs in the grad mode it was recorded in (graph.key_grad). The
        gathers between them run with grad on wherever one call was recorded with
        it, even when computing under no_grad: a gather also carries rows for later
        steps, and gathering values that need no grad records nothing anyway.
        """
        graph = self.graph
        key_grad = graph.key_grad
        wanted: list[RecordedGrad | None] = [key_grad.get(step.key) for step in schedule.steps]
        if graph.grad_constants:
            self._constants_want_grad(schedule, wanted)
        if not torch.is_inference_mode_enabled():
            if True in wanted and not torch.is_grad_enabled():
                return torch.enable_grad(), wanted, False
            return contextlib.nullcontext(), wanted, False
        # Calls with no recorded mode (a batch bound from workers) run in inference
        # mode, as computed; constants (tensors of their own, or numbers) keep none.
        keys = graph.keys
        calls = [grad for step, grad in zip(schedule.steps, wanted)
                 if not isinstance(keys[step.key], ConstantKey)]
        if all(grad is None or grad is INFERENCE for grad in calls) and True not in wanted:
            # Every call was made in inference mode (serving): all run in it as they
            # are but the constants, which a later call recorded with grad may save.
            return contextlib.nullcontext(), [None] * len(wanted), True
        # Inference mode would make every value an inference tensor: no history, and
        # unusable in later calls recorded outside it that save their inputs for
        # backward. So steps run outside it (which turns grad on; calls recorded
        # without grad, or in inference mode, turn it off).
        wanted = [INFERENCE if grad is None and not isinstance(keys[step.key], ConstantKey)
                  else grad for step, grad in zip(schedule.steps, wanted)]
        return torch.inference_mode(False), wanted, False

    def _constants_want_grad(
        self, schedule: Schedule, wanted: list[RecordedGrad | None]
    ) -> None:
        # A step stacking a constant that requires grad runs with grad on (the
        # stack then keeps the way back to it), whatever the mode at compute.
        grad_constants, keys = self.graph.grad_constants, self.graph.keys
        for i, step in enumerate(schedule.steps):
            if isinstance(keys[step.key], ConstantKey) and not grad_constants.isdisjoint(
                step.nodes
            ):
                wanted[i] = True

    def _detach_switched_on(self, nodes: list[int], values: list[Any]) -> None:
        """Detach, in ``values``, the tensors of constants ``nodes`` that did not
        require grad when recorded and do now (a parameter unfrozen,
        ``x.requires_grad_()`` since): eagerly the calls made with them gave them no
        gradient, and a stack run with grad for another constant of the step would."""
        grad_constants = self.graph.grad_constants
        for i, (n, value) in enumerate(zip(nodes, values)):
            if isinstance(value, torch.Tensor) and value.requires_grad and n not in grad_constants:
                values[i] = value.detach()

    def _check_unchanged(self, nodes: list[int]) -> None:
        graph = self.graph
        versions, constants = graph.constant_versions, graph.constants
        for n in nodes:
            version = versions.get(n)
            if version is not None and constants[n]._version != version:
                value = constants[n]
                raise ConstantChangedError(
                    f"a {tuple(value.shape)} {value.dtype} tensor recorded as a per-example "
                    f"input of {graph.name!r} (node {n}) was changed in place before it was "
                    "computed. batchgraph reads it when the batch runs, so it would see the "
                    "new values where eager code saw the old ones. Pass a tensor that stays "
                    "as it is until compute: a new one per example, or `t.clone()` of a "
                    "reused buffer."
                )

    def _columns(
        self, key: BatchKey, step: Step, out: Any, grad: RecordedGrad | None
    ) -> list[Any]:
        size = len(step.nodes)
        if not isinstance(out, list) or len(out) != size:
            raise BatchedCallError(
                f"{key.label} must return a list of {size} per-example results, got "
                f"{type(out).__name__}"
            )
        flat: list[list[torch.Tensor]] = []
        for value in out:
            leaves: list[torch.Tensor] = []
            try:
                flatten_output(value, leaves)
            except TypeError as err:
                raise NotATensorError(f"{key.label} returned {err}") from err
            flat.append(
                _without_inert_views(leaves) if grad is False or grad is INFERENCE else leaves
            )
        graph = self.graph
        check_columns(
            key, step.nodes, flat, graph.node_spec, autocast=step.key in graph.key_autocast,
            example_of=self._example,
        )
        # The last column keeps each whole result: handles whose structure was unknown
        # before running refer to it as leaf -1.
        return [*(list(column) for column in zip(*flat)), list(out)]

    def _index_all(self, schedule: Schedule) -> None:
        # Every index list of the schedule becomes a slice of one tensor (one copy
        # to a GPU per run instead of one per gather). The lists fill one int64
        # array (array.fromlist is a C loop, ~5x faster than torch.tensor(list)),
        # and the tensor is a view of its memory.
        self._spans = {}
        self._flat_on = {}
        flat = array("q")
        spans = self._spans
        for step in schedule.steps:
            for plan in step.gathers:
                direct = plan.direct or ()
                for rows in (plan.perm, *(r for _, _, r in plan.parts), *(r for _, r in direct)):
                    if type(rows) is list:
                        spans[id(rows)] = (rows, len(flat))
                        flat.fromlist(rows)
        if flat:
            self._flat_on[_CPU] = _long_tensor(flat)

    def _index(self, rows: list[int], device: torch.device) -> torch.Tensor:
        span = self._spans.get(id(rows))
        if span is not None and span[0] is rows:
            flat = self._flat_on.get(device)
            if flat is None:
                flat = self._flat_on[device] = self._flat_on[_CPU].to(device)
            return flat[span[1] : span[1] + len(rows)]
        # A list outside the current schedule (binding's output gather): cached alone.
        cache_key = (id(rows), device)
        cached = self._index_cache.get(cache_key)
        if cached is None:
            cached = (rows, _long_tensor(array("q", rows)).to(device))
            self._index_cache[cache_key] = cached
        return cached[1]

    def _pieces(self, plan: GatherPlan) -> list[torch.Tensor]:
        """Each part of ``plan``: a view where its rows are a run, else their copy."""
        stores = self.graph.stores
        pieces = []
        for sid, leaf, rows in plan.parts:
            if sid == CARRY:
                pieces.append(self._carry.pop(leaf))
                continue
            source = stores[sid][leaf]
            if type(source) is list:
                pieces.append(torch.stack([source[r] for r in rows]))
            elif type(rows) is range:
                pieces.append(source if len(rows) == len(source) else source[rows.start : rows.stop])
            else:
                pieces.append(source.index_select(0, self._index(rows, source.device)))
        return pieces

    def _direct(self, plan: GatherPlan, size: int) -> list[torch.Tensor]:
        """Each position's rows of a direct plan: a view of its part, or their copy."""
        assert plan.direct is not None
        pieces = self._pieces(plan)
        out = []
        for part, rows in plan.direct:
            piece = pieces[part]
            if isinstance(rows, list):
                out.append(piece.index_select(0, self._index(rows, piece.device)))
            elif rows == 0 and len(piece) == size:
                out.append(piece)
            else:
                out.append(piece[rows : rows + size])
        return out

    def _gather(self, plan: GatherPlan) -> torch.Tensor:
        pieces = self._pieces(plan)
        gathered = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if plan.perm is not None:
            gathered = gathered.index_select(0, self._index(plan.perm, gathered.device))
        if plan.keep:
            # The rows later steps still gather ride along to the pool's next gather.
            assert plan.perm is not None  # survivors are always placed by the perm
            cut = len(plan.perm) - plan.keep
            self._carry[plan.pool] = gathered[cut:]
            gathered = gathered[:cut]
        return gathered

    def _fetch(self, refs: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        stores = self.graph.stores
        return [stores[sid][leaf][row] for sid, leaf, row in refs]

    def _diagnose(
        self, key: BatchKey, step: Step, inputs: Sequence[Any], err: Exception
    ) -> BatchedCallError:
        size = len(step.nodes)
        examples = sorted({e for e in map(self._example, step.nodes) if e is not None})
        failing = ""
        for i, n in enumerate(step.nodes):
            # A batch of one, in the form the rule takes a batch: a list of one value
            # per input (combine="list") or a stacked row.
            one = [x[i : i + 1] for x in inputs]
            try:
                key.run(key.fn, one, 1)
            except Exception as single:
                example = self._example(n)
                where = f"example {example}" if example is not None else f"node {n}"
                # The error of the call as eager code makes it, where it fails so:
                # a batch of one (through vmap, say) names dimensions of the batch
                # ("out of bounds for dimension 1" for the example's dimension 0).
                alone = _eager_error(key, inputs, i)
                failing = (f" Run alone, the call of {where} (row {i}) fails too: "
                           f"{alone}") if alone is not None else (
                    f" Made as eager code makes it, the call of {where} (row {i}) runs: "
                    f"the rule fails where eager code does not (a batch of one: "
                    f"{type(single).__name__}: {single}). Register bg.UnbatchedKey for "
                    "the callable to run its calls one at a time (and report our rules).")
                break
        shown = ", ".join(map(str, examples[:10])) + (" ..." if len(examples) > 10 else "")
        said = str(err).rstrip(". ")  # its own full stop would end the sentence twice
        return BatchedCallError(
            f"{key.label} raised in a batched call of {size} calls "
            f"(examples {shown or 'unknown'}): {type(err).__name__}: {said}.{failing}"
        )

    def _example(self, node: int) -> int | None:
        return self._example_of(node) if self._example_of is not None else None


def _eager_error(key: BatchKey, inputs: Sequence[Any], i: int) -> str | None:
    """The error (``"Type: message"``) of row ``i``'s call made as eager code makes it
    (its per-example inputs, no batch dimension), or None where that call runs. Not
    the exception: it held the batch-of-one error (``__context__``), whose traceback
    held the diagnosing frame, which held it, a cycle keeping the graph alive."""
    try:
        key.call.apply(key.fn, [x[i] for x in inputs])
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _long_tensor(rows: array[int]) -> torch.Tensor:
    """An int64 CPU tensor over ``rows`` (an ``array("q")``), sharing its memory."""
    if not rows:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(rows, dtype=torch.long)


def _without_inert_views(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """``leaves`` of a call run under no_grad (or in inference mode), with inert views
    detached.

    Under no_grad, a view op (squeeze, an index) of an input that needs grad gives a
    view that requires grad but has no history: no gradient flows through it. A
    batched input may need grad only because its gather also carries rows for later
    calls, where the eager call's own input (computed under no_grad, say) does not,
    and its value does not require grad (``.numpy()`` works on it). So such views go
    out detached. An op that returns its input itself (dropout in eval mode,
    ``.to()`` to its own dtype) keeps the input's history, as it does eagerly.
    """
    return [t.detach() if t.requires_grad and t.grad_fn is None and t._is_view() else t
            for t in leaves]
