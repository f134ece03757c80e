"""Stage forwards that keep a tensor computed from their inputs, and read it back.

A stage forward runs once per microbatch. What it keeps in its modules' Python
attributes from its inputs is then a microbatch's where one device keeps the whole
batch's, and a forward reading it back computes other values, silently:

* ``if self.ref is None: self.ref = x.mean(0)`` centres every later call on microbatch
  0's mean where one device centres on the batch's: other outputs, loss and gradients;
* a stage reading what another stage's forward kept (``self.encoder.cache``) reads
  whichever microbatch that stage ran last, which on threads depends on their timing;
* a buffer updated in place from the inputs and read (a running mean to centre on)
  holds the microbatches before, where one device reads it as it was.

:func:`check_inputs_kept` runs the stages twice in sequence on meta tensors (nothing is
computed; the modules' attributes are put back afterwards), marking the tensors
computed from each run's inputs (a dispatch mode), and notes which attributes the
forwards bind to, or put into containers of, marked tensors, and which buffers they
update in place from marked ones (one set of meta buffers for both runs; an update
alone, as BatchNorm's in training, is no read). It refuses a read of
such a tensor by another stage, or by the second run (a later microbatch). A tensor
made without reading the inputs' values (a rotary table per length, ``ones_like(x)``)
is not marked: it is the same whatever the batch. A tensor kept and never read
back (``self.last = out.detach()``, for inspection) holds the last microbatch's after
a step: documented, not refused. A batch size kept (``if self.n is None: self.n =
x.shape[0]``) is no marked value: the stages then run on an input one row longer after
the first, and again on the state as it was, and the two runs' output operations must
be alike but in their tensors' shapes (a mask kept of the first size and read as
``mask[:1]`` is the same); a forward taking one size only skips these runs.

A stage that cannot run on meta tensors (it reads a value in Python: ``.item()``,
``.tolist()``; it makes a shape from values: ``x[x > 0]``, ``torch.nonzero``) ended the
check silently, so such a stage keeping a mean of microbatch 0 trained otherwise than
one device. The stages then run on real tensors (``no_grad``), three times: on a
microbatch, on a later one after it, and on the later one again on the state as it was
before (:mod:`batchgraph.pipeline.real_runs` undoes the state tensors' in-place writes
and sets the random generators back for each run; the attributes are put back here).
Tensors are marked as on meta, and the operations computing the second and third runs'
outputs must be alike: they differ where the second read what the first left (a first-call
flag, a count, a float of microbatch 0 from ``.item()``). The runs cost three forwards of a
microbatch once per input signature; a stage failing there fails again at the step, named.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from batchgraph.module_state import output_ops
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.real_runs import Generators, WriteGuard, unmarked_writes
from batchgraph.pipeline.swapped_state import swapped_state
from batchgraph.pipeline.thread_state import saved_tensors_hooks_enabled
from batchgraph.python_state import DEPTH, SavedAttributes, tensors_in

__all__ = ["check_inputs_kept"]

_aten = torch.ops.aten
# Ops whose outputs read only their input's shape, dtype and device, not its values.
_LAYOUT_ONLY = frozenset({
    _aten.empty_like.default, _aten.zeros_like.default, _aten.ones_like.default,
    _aten.full_like.default, _aten.new_empty.default, _aten.new_zeros.default,
    _aten.new_ones.default, _aten.new_full.default,
})
# Ops that overwrite their first argument whole without reading it: what a run reads
# after one is that run's own.
_OVERWRITES = frozenset({_aten.copy_.default, _aten.fill_.Scalar, _aten.fill_.Tensor,
                         _aten.zero_.default})
# Module state that functional_call swaps and restores itself.
_SWAPPED = frozenset({"_parameters", "_buffers", "_modules"})


class _Marking(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Marks every tensor an op computes from a marked one (the run's inputs); notes the
    first read of a kept tensor (``kept``: its id -> (stage, name, run))."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.marked: Any = WeakIdKeyDictionary()  # untyped in torch: Any for mypy
        self.kept: dict[int, tuple[int, str, int]] = {}
        # The kept tensors themselves, alive to the end: a forward replacing one
        # (self.last = out) frees it, and the next tensor made could take its id.
        self.alive: list[Tensor] = []
        self.stage = self.run = 0
        self.read: tuple[int, str, int] | None = None  # (stage, name, run) read wrongly
        # each (run, stage)'s operations computing its output (module_state.output_ops)
        self.ops: dict[tuple[int, int], list[tuple[Any, ...]]] = {}
        self.guard: WriteGuard | None = None  # on real tensors: undoes writes to state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        written = [t for i, a in enumerate(func._schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write
                   for t in tree_leaves(args[i] if i < len(args) else kwargs.get(a.name))
                   if isinstance(t, Tensor)]
        if self.guard is not None:
            # (BatchNorm's running statistics: written, but not marked so in its schema)
            if guarded := written + unmarked_writes(func, args, kwargs):
                self.guard.before_write(guarded)
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        for t in tensors:
            keeper = self.kept.get(id(t))
            # Updated in place only (a total; BatchNorm's running statistics in
            # training) is no read of it.
            if keeper is not None and self.read is None and (
                    keeper[0] != self.stage or keeper[2] != self.run) and not any(
                    t is w for w in written):
                self.read = keeper
        if func in _OVERWRITES and id(args[0]) in self.kept:
            self.kept[id(args[0])] = (self.stage, self.kept[id(args[0])][1], self.run)
        if func not in _LAYOUT_ONLY and any(t in self.marked for t in tensors):
            for t in [*tree_leaves(out), *written]:
                if isinstance(t, Tensor):
                    self.marked[t] = True
        return out


def check_inputs_kept(modules: Sequence[nn.Module], sample: Sequence[Tensor],
                      first: int = 0, later: Sequence[Tensor] | None = None,
                      devices: Sequence[torch.device] | None = None,
                      real: bool = True) -> bool:
    """Refuse stage forwards that read back what a forward kept from its inputs (see
    the module's docstring), for a pipeline of several microbatches.

    Args:
        modules: the stage modules, in order.
        sample: one microbatch of inputs for the first stage.
        first: the index of the first stage (a rank's own stage, on torch.distributed).
        later: a later microbatch's inputs (the runs on real tensors: ``sample`` again
            if not given).
        devices: each stage's device (the runs on real tensors move its inputs there;
            ``sample``'s if not given).
        real: whether to run the stages on real tensors where they cannot run on meta
            (a caller that ran them so for one input signature may skip it for others:
            three forwards each).

    Returns:
        Whether the stages ran on real tensors.

    Raises:
        PipelineConfigError: naming the stage that read it, the attribute and what to
            write instead.

    Example:
        >>> class Centred(nn.Linear):
        ...     ref = None
        ...     def forward(self, x):
        ...         if self.ref is None:
        ...             self.ref = x.mean(0).detach()
        ...         return super().forward(x - self.ref)
        >>> check_inputs_kept([nn.Linear(3, 3), Centred(3, 2)], [torch.zeros(4, 3)])
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineConfigError: stage 1 (Centred) reads Centred.ref, ...
        >>> Centred(3, 2).ref is None  # nothing is left in the modules
        True
    """
    # Plain tensor attributes on meta first; where a forward cannot run so (it reads
    # one's values: float(self.scale)), as they are.
    for plain_on_meta in (True, False):
        mode, ran, swapped = _check(modules, [sample, sample], plain_on_meta, None, False)
        _refuse(modules, mode, first, (1, 2) if ran else None)
        if ran:
            # A microbatch of another size after the first, and again on the state as
            # it was: a size kept (self.n = x.shape[0]) is microbatch 0's where one
            # device's is the batch's. A forward taking no other size is not refused.
            longer = _resized(sample)
            mode, ran, _ = _check(modules, [sample, longer, longer], plain_on_meta, None,
                                  False)
            _refuse(modules, mode, first, (2, 3) if ran else None, shapes=False)
            return False
        if not swapped:
            break
    if not real:
        return False
    # A forward that cannot run on meta (.item(), x[x > 0]) runs on real tensors: a
    # microbatch, a later one (one row longer, as above; as it is where it cannot run
    # so) after it, and that later one again on the state as it was (undone:
    # real_runs), whose operations the second's must be.
    later = sample if later is None else later
    for shapes in (False, True):
        other = list(later) if shapes else [torch.cat([t, t[:1]]) if t.dim() else t
                                            for t in later]
        mode, ran, _ = _check(modules, [sample, other, other], False, devices, True)
        _refuse(modules, mode, first, (2, 3) if ran else None, shapes)
        if ran:
            break
    return True


def _resized(sample: Sequence[Tensor]) -> list[Tensor]:
    """Meta inputs as ``sample``, one row longer along the batch dimension (dim 0)."""
    return [torch.empty((t.shape[0] + 1, *t.shape[1:]) if t.dim() else (), dtype=t.dtype,
                        device="meta") for t in sample]


def _refuse(modules: Sequence[nn.Module], mode: _Marking, first: int,
            compared: tuple[int, int] | None, shapes: bool = True) -> None:
    """Raise where a run read what it should not, or the ``compared`` runs' operations
    computing a stage's output differ (but in their tensors' shapes, unless ``shapes``:
    a mask kept of the first size, read as mask[:1], is no other value)."""
    if mode.read is not None:
        raise _read_error(modules, mode, first)
    for k in range(len(modules)):
        if compared is not None and _shown(mode.ops[compared[0], k], shapes) != _shown(
                mode.ops[compared[1], k], shapes):
            raise _state_error(modules, k, first)


def _shown(value: Any, shapes: bool) -> Any:
    """``value`` (output_ops' operations), its tensors' shapes left out unless ``shapes``."""
    if shapes:
        return value
    if isinstance(value, (tuple, list)):
        if len(value) == 2 and isinstance(value[1], torch.dtype):  # a tensor: (shape, dtype)
            return value[1]
        return tuple(_shown(v, shapes) for v in value)
    return value


def _check(modules: Sequence[nn.Module], runs: Sequence[Sequence[Tensor]],
           plain_on_meta: bool, devices: Sequence[torch.device] | None, real: bool
           ) -> tuple[_Marking, bool, bool]:
    """The runs (on meta, or on real tensors moved to ``devices``: see real_runs; a
    third on the state as it was before the first): their mode, whether all ran, and
    whether any plain tensor attribute was put on meta."""
    saved = [[SavedAttributes(m, _SWAPPED) for m in root.modules()] for root in modules]

    def fresh() -> list[dict[str, Tensor]]:
        # One set of parameters and buffers per stage for the runs: a buffer the first
        # run updates from its inputs in place is what the second run reads (real: the
        # modules' own, the writes undone).
        return [swapped_state(m, meta=not real) for m in modules]

    states = fresh()
    mode = _Marking()
    generators: Generators | None = None
    ran = swapped = False
    try:
        # Runs on meta draw from Python's and NumPy's generators too (see Generators).
        generators = Generators(devices or [t.device for t in runs[0]] if real else (),
                                modules)
        if real:
            mode.guard = WriteGuard(modules)
        elif plain_on_meta:
            swapped = any([_plain_tensors_on_meta(stage) for stage in saved])
        ran = True
        for run, sample in enumerate(runs, 1):
            if run == 3:  # on the state as it was
                _put_back(saved, mode)
                # (the old ones held: a new one could take a kept one's id)
                mode.alive += [t for state in states for t in state.values()]
                states = fresh()
                if swapped:
                    any([_plain_tensors_on_meta(stage) for stage in saved])
            if generators is not None:
                generators.reset()
            ran = ran and _run_marked(modules, sample, saved, states, mode, run, devices,
                                      real)
    finally:
        _put_back(saved, mode)
        if generators is not None:
            generators.reset()
    return mode, ran, swapped


def _put_back(saved: list[list[SavedAttributes]], mode: _Marking) -> None:
    for stage in saved:
        for attrs in stage:
            attrs.put_back(attrs.changed(_SWAPPED))
    if mode.guard is not None:
        mode.guard.undo()


def _plain_tensors_on_meta(saved: list[SavedAttributes]) -> bool:
    """Bind the modules' plain tensor attributes (not 0-d: those mix with meta ones) to
    meta copies, put back with the rest: a real one updated in place from the meta
    inputs (``self.mean.mul_(0.5).add_(x.mean(0))``) failed, and ended the check.
    Whether there was one."""
    found = False
    for attrs in saved:
        now = vars(attrs.module)
        for name, value in attrs.before.items():
            if type(value) is Tensor and value.dim() > 0 and value.device.type != "meta":
                now[name] = torch.empty_like(value, device="meta")
                found = True
    return found


def _run_marked(modules: Sequence[nn.Module], sample: Sequence[Tensor],
                saved: list[list[SavedAttributes]], states: list[dict[str, Tensor]],
                mode: _Marking, run: int, devices: Sequence[torch.device] | None,
                real: bool) -> bool:
    """Run ``run`` of the stages in sequence; False where one could not run (on meta)
    or read what it should not."""
    mode.run = run
    values: tuple[Any, ...] = tuple(t.detach() if real else torch.empty_like(t, device="meta")
                                    for t in sample)
    for t in values:
        mode.marked[t] = True
    for k, module in enumerate(modules):
        mode.stage = k
        state = states[k]
        if devices is not None:  # a copy to the stage's device is the value it was
            moved = tuple(v.to(devices[k]) for v in values)
            for v, to in zip(values, moved):
                if to is not v and v in mode.marked:
                    mode.marked[to] = True
            values = moved
        try:
            with torch.no_grad(), saved_tensors_hooks_enabled(), mode:
                result, mode.ops[run, k] = output_ops(
                    functools.partial(functional_call, module, state, values,
                                      tie_weights=False),
                    list(module.modules()))
        except Exception:
            return False  # the real run reports it, with the stage named
        if mode.read is not None:
            return False
        for name, t in state.items():
            if t in mode.marked and id(t) not in mode.kept:  # changed in place from inputs
                owner = module.get_submodule(name.rpartition(".")[0])
                mode.kept[id(t)] = (k, f"{type(owner).__name__}.{name.rpartition('.')[2]}",
                                    mode.run)
        for attrs in saved[k]:
            now = vars(attrs.module)
            for name in attrs.changed(_SWAPPED):
                for t in tensors_in(now.get(name), DEPTH):
                    if t in mode.marked:
                        mode.kept[id(t)] = (k, f"{type(attrs.module).__name__}.{name}", mode.run)
                        mode.alive.append(t)
        items = result if isinstance(result, (tuple, list)) else (result,)
        if not all(isinstance(v, Tensor) for v in items):
            return False
        values = tuple(items)
    return True


def _state_error(modules: Sequence[nn.Module], k: int, first: int) -> PipelineConfigError:
    return PipelineConfigError(
        f"stage {first + k} ({type(modules[k]).__name__}) computes its output otherwise at "
        "its second call than at its first, from state its forward changed (a first-call "
        "flag, self.n += 1 read by the output, a batch size kept: self.n = x.shape[0]): a "
        "pipeline runs each stage once per "
        "microbatch, so microbatch 1 on reads what microbatch 0 left where one device's "
        "single call reads it as it was, and computes other outputs and gradients. Set "
        "it outside the forward (before the step), or use microbatches=1, which runs as "
        "one device"
    )


def _read_error(modules: Sequence[nn.Module], mode: _Marking,
                first: int) -> PipelineConfigError:
    assert mode.read is not None
    keeper, name, run = mode.read
    reader = mode.stage
    whose = "its" if keeper == reader else f"stage {first + keeper}'s"
    where = (f"stage {first + reader} ({type(modules[reader]).__name__}) reads {name}, which "
             f"{whose} forward computed from its inputs and kept")
    if keeper == reader and run != mode.run:
        why = (" for its next call: a pipeline runs each stage once per microbatch, so "
               "microbatch 1 on reads microbatch 0's value where one device reads the whole "
               "batch's, and computes other outputs and gradients")
    else:
        why = (": the stages run the microbatches in turn, so it reads whichever microbatch "
               f"stage {first + keeper} ran last (on threads: as they happen to run) where "
               "one device reads the whole batch's")
    return PipelineConfigError(
        f"{where}{why}. Compute it from the whole batch before the step and pass it in "
        "(or set it once, outside the forward), hand it to the next stage as an output, "
        "or use microbatches=1, which runs as one device"
    )
