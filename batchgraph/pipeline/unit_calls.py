"""How a unit's calls are rewired while a two-stage backward tape records.

See :mod:`batchgraph.pipeline.backward` for the whole scheme. Each unit's ``forward``
is replaced by a :class:`UnitForward`: outside a recording it is the unit's own
forward; while a tape records, a call runs the unit on detached leaves of its inputs
(its *local graph*) and links its inputs to its outputs in the stage's graph with a
:class:`Junction`, whose backward is the unit's input-gradient half.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from batchgraph.attributes import MODULE_OWN
from batchgraph.pipeline import _autograd
from batchgraph.pipeline.thread_state import innermost_hooks
from batchgraph.python_state import SavedAttributes

if TYPE_CHECKING:
    from batchgraph.pipeline.backward import BackwardTape

__all__ = [
    "LEAF_IN_PLACE",
    "PLAIN",
    "RECORDING",
    "WRAPPING",
    "Junction",
    "Recording",
    "UnitCall",
    "UnitForward",
    "cut_leaves",
    "unwrapped",
    "wrap_unit",
]


PLAIN = (Tensor, nn.Parameter)


@dataclass(eq=False)
class UnitCall:
    """One call of a unit: its local graph's ends, and dL/dy once ``I`` has run."""

    unit: nn.Module
    outputs: tuple[Tensor, ...]
    leaves: tuple[Tensor, ...]
    params: tuple[nn.Parameter, ...] = ()  # the unit's parameters (looked up once per unit)
    grads: tuple[Tensor | None, ...] | None = None


class Junction(torch.autograd.Function):
    """Links a unit's input to its output in the chain; its backward is the unit's ``I``."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, call: UnitCall, *inputs: Tensor) -> tuple[Tensor, ...]:
        del anchor, inputs  # only there so autograd links this node to them
        ctx.call = call
        # dL/dy may be None for outputs that do not reach the loss; keep None, not zeros.
        ctx.set_materialize_grads(False)
        return tuple(y.detach() for y in call.outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> tuple[Tensor | None, ...]:
        call: UnitCall = ctx.call
        call.grads = tuple(grad_outputs)
        result: list[Tensor | None] = [None] * len(call.leaves)
        wanted = [i for i, leaf in enumerate(call.leaves) if ctx.needs_input_grad[2 + i]]
        used = [(y, g) for y, g in zip(call.outputs, grad_outputs) if g is not None]
        if wanted and used:
            # retain_graph: W walks this local graph again, for the parameters.
            grads = _autograd.grad(
                [y for y, _ in used],
                [g for _, g in used],
                [call.leaves[i] for i in wanted],
                retain_graph=True,
            )
            for i, g in zip(wanted, grads):
                result[i] = g
        return (None, None, *result)


class Recording(threading.local):
    """Per thread: the tape being recorded (if any) and how deep in unit calls we are."""

    tape: BackwardTape | None = None
    depth = 0


# One for all: the wrappers on the user's modules hold no per-thread state (that cannot
# be copied or pickled), and a module in two stages needs only one wrapper, whichever
# stage's thread records.
RECORDING = Recording()
# Stage threads build their TwoStageBackward concurrently, possibly on a shared module.
WRAPPING = threading.Lock()
# What torch says when a unit changes its leaf input in place.
LEAF_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


def wrap_unit(unit: nn.Module) -> UnitForward:
    """Prepare ``unit`` (or count one more user of the wrapper it already has)."""
    current = unit.__dict__.get("forward")
    if isinstance(current, UnitForward) and current.unit is unit:
        current.users += 1
        current.params = tuple(unit.parameters())  # they may have been replaced since
        return current
    wrapper = UnitForward(unit, unit.forward, tuple(unit.parameters()))
    unit.forward = wrapper  # type: ignore[method-assign]
    return wrapper


def unwrapped(forward: Any) -> Any:
    """What a copied or unpickled wrapper becomes: the forward it wrapped."""
    return forward


class UnitForward:
    """A unit's ``forward`` while it is prepared for two-stage backprop.

    Outside a recording (or with grad disabled) it is the unit's own forward. While a tape
    records, a call runs the unit on detached leaves (its local graph) and links its
    inputs to its outputs in the chain with a :class:`Junction`. Units called inside
    another unit's call are part of that unit's local graph and run as usual.

    A copy (``copy.deepcopy(model)``, ``torch.save(model)``, e.g. an EMA model or a
    checkpoint taken mid-training) gets the forward this wraps, bound to the copy: copies
    are plain modules, not prepared for any tape.
    """

    __slots__ = ("forward", "inplace", "params", "previous", "unit", "users")

    def __init__(self, unit: nn.Module, forward: Any, params: tuple[nn.Parameter, ...]) -> None:
        self.unit, self.forward, self.params = unit, forward, params
        self.previous = unit.__dict__.get("forward")  # an instance's own forward, if any
        self.users = 1  # TwoStageBackward objects that prepared the unit (see close)
        self.inplace = False  # seen changing its input in place: gets aliases of leaves

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return unwrapped, (self.forward,)

    def _run_local(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], alias: bool
    ) -> tuple[Any, tuple[Tensor, ...], tuple[Tensor, ...]]:
        """The unit on detached leaves of its inputs (aliases of them with ``alias``):
        (output, the inputs cut, their leaves)."""
        if not kwargs and all(type(a) in PLAIN for a in args):
            # The common call, tensors only: no pytree walk.
            new_args, originals, leaves = cut_leaves(args, alias)
            new_kwargs = kwargs
        else:
            flat, spec = tree_flatten((args, kwargs))
            new_flat, originals, leaves = cut_leaves(flat, alias)
            new_args, new_kwargs = tree_unflatten(new_flat, spec)
        RECORDING.depth = 1
        try:
            return self.forward(*new_args, **new_kwargs), originals, leaves
        finally:
            RECORDING.depth = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        local = RECORDING
        tape = local.tape
        if tape is None or local.depth or not torch.is_grad_enabled() or _in_checkpoint():
            return self.forward(*args, **kwargs)
        # What the unit's Python keeps (self.calls += 1, self.seen.append(...)), put back
        # if the call is run again below: else it would count that call twice.
        saved = None if self.inplace else _saved(self.unit)
        try:
            output, originals, leaves = self._run_local(args, kwargs, self.inplace)
        except RuntimeError as exc:
            if saved is None or LEAF_IN_PLACE not in str(exc):
                raise
            # The unit changes its input in place (timm's LayerScale(inplace=True):
            # x.mul_(gamma)), which torch refuses on a leaf before changing anything. It
            # gets aliases of its leaves from now on, as a stage's first op does (see
            # _autograd.alias); a unit with buffers may have updated them already (running
            # statistics), so it is not run twice.
            if any(True for _ in self.unit.buffers()):
                raise RuntimeError(
                    f"{type(self.unit).__name__} changes its input in place, which the "
                    "two-stage backward ('zb-h1') allows only in a layer without buffers: "
                    "make the in-place op out of place (e.g. LayerScale(inplace=False)), "
                    "or use a schedule without the split backward ('1f1b')"
                ) from exc
            _put_back(saved, exc)
            self.inplace = True
            output, originals, leaves = self._run_local(args, kwargs, True)
        if type(output) in PLAIN:
            # One tensor out: no pytree walk.
            if not output.requires_grad:
                return output
            call = UnitCall(self.unit, (output,), leaves, self.params)
            tape._add(call)
            (linked_one,) = Junction.apply(tape._anchor, call, *originals)  # type: ignore[no-untyped-call]
            return linked_one
        flat, spec = tree_flatten(output)
        positions = [i for i, v in enumerate(flat) if isinstance(v, Tensor) and v.requires_grad]
        if not positions:
            return output
        call = UnitCall(self.unit, tuple(flat[i] for i in positions), leaves, self.params)
        tape._add(call)
        linked: tuple[Tensor, ...] = Junction.apply(  # type: ignore[no-untyped-call]
            tape._anchor, call, *originals
        )
        for i, y in zip(positions, linked):
            flat[i] = y
        return tree_unflatten(flat, spec)


def _in_checkpoint() -> bool:
    """Whether the call is inside a non-reentrant ``torch.utils.checkpoint`` region.

    Such a region's saved tensors are packed by its hook and recomputed at the first
    unpack of each autograd pass: a local graph's there would be recomputed by the
    junction's pass in ``I`` and again by ``W``, the region's Python run twice more than
    on one device (``self.calls`` 4 per microbatch, not 2) and its compute thrice. Its
    units run as usual instead: the region is part of the chain, recomputed once, in
    ``I``, whose parameter gradients wait for ``W`` (see ``backward``).
    """
    hooks = innermost_hooks()
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
        "_checkpoint_hook.")


def _saved(unit: nn.Module) -> list[SavedAttributes]:
    return [SavedAttributes(m, MODULE_OWN, versions=True) for m in unit.modules()]


def _put_back(saved: list[SavedAttributes], exc: RuntimeError) -> None:
    """Undo what a unit's first, refused run left in its modules' Python attributes, so
    that its run again keeps it once; a plain tensor attribute changed in place cannot
    be undone, and is refused."""
    for attrs in saved:
        changed = attrs.changed_in_place()
        if changed:
            names = ", ".join(f"{type(attrs.module).__name__}.{n}" for n in changed)
            raise RuntimeError(
                f"{names} changed in place by a forward that then changes its input in "
                "place: the two-stage backward ('zb-h1') runs such a call again (torch "
                "refuses the input change on its detached leaf), which would change "
                f"{names} twice. Make the input change out of place (x = x * gamma "
                "instead of x.mul_(gamma)), or rebind the total (self.total = self.total "
                "+ ...), or use a schedule without the split backward ('1f1b')"
            ) from exc
        attrs.put_back(attrs.changed(MODULE_OWN))


def cut_leaves(
    values: Sequence[Any], alias: bool = False
) -> tuple[list[Any], tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Each tensor that requires grad replaced by a detached leaf (an alias of one that an
    in-place op may change, with ``alias``): (values, originals, leaves)."""
    out: list[Any] = []
    originals: list[Tensor] = []
    leaves: list[Tensor] = []
    for value in values:
        if isinstance(value, Tensor) and value.requires_grad:
            leaf = value.detach().requires_grad_(True)
            originals.append(value)
            leaves.append(leaf)
            out.append(_autograd.alias(leaf) if alias else leaf)
        else:
            out.append(value)
    return out, tuple(originals), tuple(leaves)
