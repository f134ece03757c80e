"""What ``compute`` refuses before any step runs.

A batched call reads its module's mode, parameters and buffers when it runs, not when
it was recorded (``batchgraph.key_reads`` notes them per key id). A call whose module
was switched, converted or changed in place in between would compute with what eager
code did not see. These checks run before the first step, so a refused batch computes
nothing and the caller can put things back and compute again. Kept apart from
``batchgraph.executor``, which runs the steps.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from batchgraph.attributes import Attributes, note_own_state
from batchgraph.buffers import Watch, computing
from batchgraph.errors import (
    BufferChangedError,
    DefaultDtypeChangedError,
    HooksChangedError,
    ModuleAttributeChangedError,
    ModuleModeChangedError,
    ParameterChangedError,
)
from batchgraph.graph import Graph
from batchgraph.hooks import hooks_of
from batchgraph.keys import ConstantKey
from batchgraph.scheduling import Schedule, Step

__all__ = [
    "check_buffers", "check_default_dtype", "check_modes", "check_parameters",
    "own_renorms", "watching_attributes", "watching_buffers",
]


def check_default_dtype(graph: Graph, schedule: Schedule) -> None:
    """Refuse to compute calls recorded under another default dtype than the one in
    force now (``torch.set_default_dtype``), or under two: the batched calls would
    compute in the current one, where eager code computed in the recorded one.
    Constants (``bg.batched_value(0.5)``) carry their dtype and pass."""
    recorded = graph.default_dtypes
    if not recorded:  # a graph no policy recorded (batchgraph.binding)
        return
    now = torch.get_default_dtype()
    if recorded == {now}:
        return
    keys = graph.keys
    if all(isinstance(keys[step.key], ConstantKey) for step in schedule.steps):
        return
    names = " and ".join(sorted(str(d).replace("torch.", "") for d in recorded))
    raise DefaultDtypeChangedError(
        f"calls in {graph.name!r} were recorded under the default dtype {names} "
        f"(torch.set_default_dtype), but compute runs under "
        f"{str(now).replace('torch.', '')}: a call's dtype may depend on the default "
        "(int_tensor * 2.5, torch.arange(3.0) in a recorded function), and the batched "
        "calls would compute in the current one. Compute under the default they were "
        "recorded in, and keep one default for a whole `with` block (record calls under "
        "another default in a policy of their own)."
    )


def check_modes(graph: Graph, schedule: Schedule) -> None:
    """Refuse a step whose module (or a submodule; for a function, a module it reads)
    was switched between train() and eval() since its calls were recorded, or whose
    module's hooks were registered or removed since."""
    modes, keys = graph.key_training, graph.keys
    for step in schedule.steps:
        recorded = modes.get(step.key)
        if recorded is None:
            if step.key in graph.key_submodes:  # a function reading modules
                _check_submodules(graph, step)
            continue
        module = keys[step.key].fn
        _check_hooks(graph, step)
        if getattr(module, "training", recorded) == recorded:
            if step.key in graph.key_submodes:
                _check_submodules(graph, step)
            continue
        then, now = ("train", "eval") if recorded else ("eval", "train")
        raise ModuleModeChangedError(
            f"calls of {keys[step.key].label} in {graph.name!r} ({len(step.nodes)} in "
            f"this batch) were recorded in {then} mode, but the module is in {now} "
            f"mode now: switched before they were computed. Eagerly they ran in {then} "
            "mode (dropout and batch statistics differ). Compute them before calling "
            "train()/eval() (read a value, or policy.compute(...)), or switch back to "
            f"{then} mode and compute then."
        )

def _check_hooks(graph: Graph, step: Step) -> None:
    noted, module = graph.key_hooks.get(step.key), graph.keys[step.key].fn
    if noted is None or not isinstance(module, torch.nn.Module) or noted == hooks_of(module):
        return
    raise HooksChangedError(
        f"hooks of {graph.keys[step.key].label} in {graph.name!r} (forward, pre-forward "
        "or backward, on it or a submodule) were registered or removed after its calls "
        f"in this batch ({len(step.nodes)}) were recorded and before they were "
        "computed. A batched call runs the hooks there are when it computes, where "
        "eagerly each call ran those of its time. Compute what you recorded before "
        "changing hooks (bg.compute, or read a value), or remove the hooks registered "
        "since and compute then, or record the calls again."
    )


def _check_submodules(graph: Graph, step: Step) -> None:
    switched = graph.switched_submodules(step.key)
    if switched:
        fn = graph.keys[step.key].fn
        whose = "of" if isinstance(fn, torch.nn.Module) else "read by"
        raise ModuleModeChangedError(
            f"{'sub' if whose == 'of' else ''}module(s) {', '.join(switched[:5])} {whose} "
            f"{graph.keys[step.key].label} in "
            f"{graph.name!r} were switched between train() and eval() after its calls "
            f"in this batch ({len(step.nodes)}) were recorded and before they were "
            "computed. Eagerly those calls ran in the old modes (dropout and batch "
            "statistics differ). Compute them before switching (read a value, or "
            "policy.compute(...)), or switch back and compute then."
        )

@contextlib.contextmanager
def watching_attributes(graph: Graph, schedule: Schedule) -> Iterator[None]:
    """Refuse a step whose module (or a submodule; for a function, a module it reads)
    had a plain attribute set (``drop.p``, ``norm.eps``, ``conv.padding``, a
    ``self.temperature``: ``batchgraph.attributes``) since its calls were recorded;
    then run the steps, and take attributes they set for state their modules keep
    themselves (a forward noting something only when it really runs), not settings.
    On another thread than the one recording, attributes set while the steps ran
    refuse them (the recording thread's code may have set them)."""
    done: dict[int, tuple[Any, Attributes | None]] = {}
    checked: set[int] = set()
    for step in schedule.steps:
        kid = step.key
        # Every key id, not once per callable: one recorded after a change (another
        # signature, or noted after a compute) does not vouch for one recorded before.
        if kid not in graph.key_attrs or kid in checked:
            continue
        checked.add(kid)
        fn = graph.keys[kid].fn
        _refuse_changed_attributes(graph, kid, len(step.nodes), "")
        done.setdefault(id(fn), (fn, graph.key_attrs[kid]))
    yield
    if graph.attrs_thread != threading.get_ident():
        # Computed on another thread than the one recording (a lane's step on run_all's
        # or an AsyncBatcher's executor): the user's code there may have set an
        # attribute meanwhile, which is no state of the forward's. Taken for one, it
        # was no longer watched, and calls recorded before the change computed with
        # the new value, silently. Own state is found on the recording thread only
        # (runs on fake tensors, computes there). And the steps may have read the new
        # value: refused (the executor drops what they stored), not handed out.
        for kid in checked:
            _refuse_changed_attributes(graph, kid, 0, _MEANWHILE)
        return
    for fn, before in done.values():
        note_own_state(graph.watched_modules(fn), before, graph.attributes_now(fn))


_MEANWHILE = (
    " The change came while they computed on another thread than the one recording "
    "(a lane of bg.run_all with overlap='thread' or 'parallel', or an AsyncBatcher's), "
    "so they may have read the new values: set such attributes between runs, or with "
    "overlap='inline'."
)


def _refuse_changed_attributes(graph: Graph, kid: int, count: int, why: str) -> None:
    changed = graph.changed_attributes(kid)
    if not changed:
        return
    fn = graph.keys[kid].fn
    whose = "of" if isinstance(fn, torch.nn.Module) else "of modules read by"
    calls = f" ({count})" if count else ""
    raise ModuleAttributeChangedError(
        f"attribute(s) {'; '.join(changed[:5])} {whose} {graph.keys[kid].label} "
        f"in {graph.name!r} were set after its calls in this batch{calls} were "
        "recorded and before they were computed. A batched call reads them when it "
        "runs, so those calls would use the new values where eager calls used the old "
        "ones (a value set between two calls recorded with no compute in between counts "
        "for both). Compute what you recorded before setting them (bg.compute, or read a "
        f"value), or set them back and compute then, or record the calls again after the "
        f"change.{why}"
    )


@contextlib.contextmanager
def own_renorms(graph: Graph, schedule: Schedule) -> Iterator[None]:
    """Run the steps; then take the in-place renormalization their ``nn.Embedding(
    max_norm=...)`` lookups made of the weight for the lookups' own: calls of the
    same embedding still pending (recorded before, to be computed later) are not
    refused for it (``ParameterChangedError``).

    Eagerly each lookup renormalizes the rows it reads before reading them, and a
    renormalized row stays as it is: which lookup renormalized a row first does not
    change what any of them reads. Calls of other callables reading the weight (a
    tied output projection) read the rows as they were at their time, so theirs
    stay refused, and so are theirs in the same compute (``_refuse_tied_readers``)."""
    embeddings = {id(fn): fn for step in schedule.steps
                  if isinstance(fn := graph.keys[step.key].fn, torch.nn.Embedding)
                  and fn.max_norm is not None}
    if embeddings:
        _refuse_tied_readers(graph, schedule, embeddings)
    before = {i: fn.weight._version for i, fn in embeddings.items()}
    yield
    for kid, noted in list(graph.key_versions.items()):
        i = id(graph.keys[kid].fn)
        if i in before and noted[0] == before[i] and graph.key_params[kid][0] is embeddings[i].weight:
            graph.key_versions[kid] = (embeddings[i].weight._version, *noted[1:])


def _refuse_tied_readers(graph: Graph, schedule: Schedule,
                         embeddings: dict[int, torch.nn.Embedding]) -> None:
    """Refuse a compute holding both ``nn.Embedding(max_norm=...)`` lookups that will
    renormalize rows of the weight in place and calls of other callables reading that
    weight (a tied output projection) where the schedule runs them out of the order
    they were recorded in: eagerly each such call read the rows as the lookups
    recorded before it left them, batched it reads them as the lookups run before its
    step left them (silently otherwise)."""
    steps = schedule.steps
    for embedding in embeddings.values():
        weight = embedding.weight
        lookups = [(at, min(step.nodes), max(step.nodes)) for at, step in enumerate(steps)
                   if graph.keys[step.key].fn is embedding]
        for at, step in enumerate(steps):
            if graph.keys[step.key].fn is embedding or not any(
                    p is weight for p in graph.key_params.get(step.key, ())):
                continue
            first, last = min(step.nodes), max(step.nodes)
            # In order: every lookup run before its step recorded before its calls,
            # every lookup run after it recorded after them.
            if all(high < first if where < at else low > last
                   for where, low, high in lookups):
                continue
            with torch.no_grad():
                norms = weight.norm(p=embedding.norm_type, dim=-1)
            if bool((norms > embedding.max_norm).any()):  # else the renorm changes nothing
                raise ParameterChangedError(
                    f"calls of {graph.keys[step.key].label} in {graph.name!r} read the "
                    f"weight of {embedding} and are computed together with its lookups, "
                    "which renormalize rows of that weight in place (max_norm) as they "
                    "run: eagerly each call read the rows as the lookups recorded before "
                    "it left them, batched it would read them as the lookups the "
                    "schedule runs before it left them. Compute the lookups first "
                    "(bg.compute on them, or read a value) and record the calls reading "
                    "the weight after that, or renormalize the weight beforehand "
                    "(torch.embedding_renorm_ under torch.no_grad()) so that no row "
                    "exceeds max_norm."
                )


def check_parameters(graph: Graph, schedule: Schedule) -> None:
    """Refuse a step whose parameters (a function's captured tensors) were converted
    or changed in place since its calls were recorded."""
    for step in schedule.steps:
        if step.key in graph.key_versions and graph.parameters_converted(step.key):
            raise ParameterChangedError(
                f"{graph.keys[step.key].label} in {graph.name!r} was converted to "
                "another dtype or device (model.to(...), .double(), .half(), .cuda(); "
                "for a function, a tensor it reads) after its calls in this batch "
                f"({len(step.nodes)}) were recorded and before they were computed: "
                "eagerly they ran with the old parameters. Compute what you recorded "
                "before converting the model (bg.compute, or read a value), or record "
                "the calls again."
            )
        unfrozen = graph.unfrozen(step.key) if step.key in graph.key_versions else None
        if unfrozen:
            raise ParameterChangedError(
                f"{', '.join(repr(n) for n in unfrozen[:5])} of {graph.keys[step.key].label}"
                f" in {graph.name!r} did not require grad when its calls in this batch "
                f"({len(step.nodes)}) were recorded, and does now (requires_grad_(True) "
                "before they were computed). Eagerly those calls gave it no gradient "
                "(their values were computed without it); batched, they would. "
                "Compute what you recorded before unfreezing (bg.compute, or read a "
                "value), or record the calls again after unfreezing."
            )
        if step.key in graph.key_versions and graph.parameters_changed(step.key):
            key = graph.keys[step.key]
            what = (
                "the parameters of" if isinstance(key.fn, torch.nn.Module)
                else "tensors read by"  # closed over, global or bound: batchgraph.captured
            )
            raise ParameterChangedError(
                f"{what} {key.label} in {graph.name!r} changed in place or were "
                "replaced (optimizer.step(), an in-place update, "
                "load_state_dict(assign=True), `lin.weight = nn.Parameter(...)`, `p.data = t`) after "
                "its calls in this "
                f"batch ({len(step.nodes)}) were recorded and before they were "
                "computed. A batched call reads the parameters when it runs, so "
                "those calls would use the new values where eager calls used the old "
                "ones. Compute what you recorded before changing parameters "
                "(loss.backward() and optimizer.step() after bg.compute), or record "
                "the calls again."
            )

def check_buffers(graph: Graph, schedule: Schedule) -> list[Watch]:
    """Refuse a step whose module's buffers were changed in place from outside
    batchgraph since its calls were recorded; return the watches of every buffer the
    steps read."""
    noted = graph.key_buffers
    watched: dict[int, Watch] = {}
    done: set[int] = set()
    for step in schedule.steps:
        kid = step.key
        if kid not in noted or kid in done:
            continue
        done.add(kid)
        changed = graph.changed_buffers(kid)
        if changed:
            key = graph.keys[kid]
            whose = "" if isinstance(key.fn, torch.nn.Module) else " (of modules it reads)"
            shown = ", ".join(repr(name) for name in changed[:5])
            raise BufferChangedError(
                f"buffer(s) {shown}{whose} of {key.label} in {graph.name!r} changed in "
                f"place after its calls in this batch ({len(step.nodes)}) were recorded "
                "and before they were computed (new statistics loaded, an EMA update, "
                "an eager call of the module, load_state_dict; or replaced: `bn.running_mean = "
                "t`). A batched call reads the "
                "buffers when it runs, so those calls would use the new values where "
                "eager calls used the old ones. Compute what you recorded before "
                "changing the buffers (bg.compute, or read a value), or record the "
                "calls again after the change. (Changes the batched calls make "
                "themselves, such as a BatchNorm's running statistics in training "
                "mode, are not refused.)"
            )
        for w in graph.watched_buffers(kid):
            watched[id(w)] = w
    return list(watched.values())


@contextlib.contextmanager
def watching_buffers(graph: Graph, schedule: Schedule) -> Iterator[None]:
    """``check_buffers``, then the steps' run as batchgraph's own (``computing``):
    buffers they change in place, or replace (a module's forward assigning
    ``self.count = self.count + 1``), are not taken for outside changes after it."""
    with computing(check_buffers(graph, schedule)):
        yield
    for kid in {step.key for step in schedule.steps if step.key in graph.key_buffers}:
        graph.adopt_replaced_buffers(kid)
