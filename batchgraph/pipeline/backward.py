"""Two-stage backprop: the input-gradient half (``I``) now, the weight-gradient half (``W``) later.

Seed 003's idea: during the backward pass a layer needs only ``dL/dz`` (the gradient at
its output) to pass ``dL/d(input)`` down the chain; its parameter gradients can wait. A
pipeline stage that sends ``dL/d(input)`` upstream first lets the previous stage start
sooner, and the deferred ``W`` fills the pipeline bubbles (ZB-H1).

How it is done here, without recomputing the chain
--------------------------------------------------
A *unit* is a module that owns trainable parameters directly (``Linear``, ``Conv2d``,
``BatchNorm``, ``LayerNorm``, ``Embedding``, ...); modules without direct parameters are
looked into, and parameterless layers (``ReLU``, ``Dropout``) run as usual. While a tape
records (``with split.record() as tape``), each unit call is rewired::

    chain:   x ──────────────────────► Junction ──► y ──► (rest of the stage)
                                          │ (backward of the junction)
    local:   x_det (leaf) ──► unit(x_det; params) ──► y_local

* the unit runs once, on a detached copy ``x_det`` of its input, so its autograd graph
  (the *local graph*) starts at ``x_det`` and the parameters and is *not* linked to the
  rest of the stage (a unit that changes its input in place, ``x.mul_(gamma)``, which
  torch refuses on a leaf, gets an alias of ``x_det`` from its first such call on, that
  call run again; one with buffers is refused, as the first run may have updated them);
* a ``Junction`` node links ``x`` to ``y`` in the stage's graph (the *chain*). Its
  backward stores ``dL/dy`` on the tape and asks the local graph for ``dL/dx_det`` only.
  Autograd then skips the weight-gradient kernels of the unit, because only the edges
  that lead to the requested inputs are executed;
* ``I`` (:meth:`BackwardTape.backward_input`) runs the chain backward once, which fires
  every junction: it costs the input-gradient half of a normal backward;
* ``W`` (:meth:`BackwardTape.backward_weight`) asks every local graph, in one autograd
  call, for the parameter gradients from the stored ``dL/dy``. Each local graph covers one
  layer, so this costs the weight-gradient half and nothing is recomputed.

Gradients are exact (the same kernels as a normal backward, fed the same values) and are
*accumulated* into ``.grad`` like ``Tensor.backward`` does. A parameter used by several
units (shared weights) gets the sum of its uses, once each. A parameter used *outside*
any unit's forward (``x @ self.other.weight`` inside a parameterless container) is found
by ``I`` (it asks the chain for every stage parameter too; unit parameters are not
reachable from the chain, so they come back empty); its gradient is held and added in
``W``, so ``.grad`` is only ever written in ``W``.

Costs
-----
* Memory: until ``W`` runs, the tape holds ``dL/dy`` at every unit output, on top of what
  the local graphs hold (the same saved tensors a normal backward keeps). For a linear
  layer ``dL/dy`` is batch x out_features; for a convolution it is batch x channels x
  H x W, often much larger than the weight gradient (seed 003's warning), so a stage full
  of convolutions holds noticeably more memory between ``I`` and ``W``.
* A unit with internal structure (a module owning parameters *and* children, e.g.
  ``MultiheadAttention``) is one local graph: ``W`` re-traverses that unit's internals
  to reach its deeper parameters. Gradients stay exact; only that unit costs more.
  Stages built from standard layers pay nothing extra.
* The junctions make ``I`` call autograd re-entrantly once per unit (tens of
  microseconds each), which is noise next to the layers' kernels.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> x = torch.randn(5, 3, requires_grad=True)
    >>> with TwoStageBackward(net) as split:
    ...     with split.record() as tape:
    ...         y = net(x)
    ...     (dx,) = tape.backward_input([y], [torch.ones_like(y)], [x])   # I
    ...     tape.backward_weight()                                        # W
    >>> net[0].weight.grad.shape
    torch.Size([4, 3])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from batchgraph.pipeline import _autograd
from batchgraph.pipeline.errors import PipelineConfigError
from batchgraph.pipeline.unit_calls import (
    RECORDING,
    WRAPPING,
    UnitCall,
    UnitForward,
    unwrapped,
    wrap_unit,
)

__all__ = ["BackwardTape", "TwoStageBackward", "find_units"]

# Models pickled while prepared (torch.save(model) mid-training) name this function
# here, from before the wrapper moved to unit_calls: they load as plain modules.
_unwrapped = unwrapped

def find_units(module: nn.Module) -> list[nn.Module]:
    """The modules whose calls get their own local graph: owners of trainable parameters.

    A module owning a trainable parameter directly is a unit as a whole (its children are
    part of it); otherwise its children are searched. Each module appears once.

    Args:
        module: the stage module.

    Returns:
        The units, in registration order.

    Example:
        >>> from torch import nn
        >>> [type(u).__name__ for u in find_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))]
        ['Linear']
    """
    units: list[nn.Module] = []
    seen: set[int] = set()

    def visit(mod: nn.Module) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        if any(p.requires_grad for p in mod.parameters(recurse=False)):
            units.append(mod)
            return
        for child in mod.children():
            visit(child)

    visit(module)
    return units


class BackwardTape:
    """What one recorded forward needs for its ``I`` and ``W``; made by ``TwoStageBackward.record``.

    Call :meth:`backward_input` once, then :meth:`backward_weight` once.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        # Every junction takes the anchor as an input, so every junction is on a path
        # autograd must walk for ``I`` even when the stage input needs no gradient (stage 0).
        self._anchor = torch.zeros((), requires_grad=True)
        self._params = list(params)
        self._calls: list[UnitCall] = []
        self._loose: list[tuple[nn.Parameter, Tensor]] = []
        self._input_done = False
        self._weight_done = False

    @property
    def calls(self) -> int:
        """How many unit calls were recorded."""
        return len(self._calls)

    def _add(self, call: UnitCall) -> None:
        self._calls.append(call)

    def backward_input(
        self,
        outputs: Sequence[Tensor],
        grad_outputs: Sequence[Tensor | None],
        inputs: Sequence[Tensor] = (),
    ) -> tuple[Tensor | None, ...]:
        """``I``: the gradients for ``inputs``; store what ``W`` needs. Frees the chain's graph.

        Args:
            outputs: the stage outputs recorded under this tape.
            grad_outputs: dL/d(output) for each output (``None`` where the loss ignores it).
            inputs: the stage inputs whose gradients are wanted.

        Returns:
            dL/d(input) for each of ``inputs`` (``None`` where it does not require grad or
            the outputs do not depend on it).

        Raises:
            RuntimeError: if called twice on one tape, or ``outputs``/``grad_outputs`` differ
                in length.
        """
        if self._input_done:
            raise RuntimeError(
                "backward_input was already called on this tape; record a new forward"
            )
        if len(outputs) != len(grad_outputs):
            raise RuntimeError(
                f"backward_input got {len(outputs)} outputs but {len(grad_outputs)} grad_outputs"
            )
        self._input_done = True
        result: list[Tensor | None] = [None] * len(inputs)
        used = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        if not used:
            return tuple(result)
        wanted = [i for i, x in enumerate(inputs) if x.requires_grad]
        targets: list[Tensor] = [self._anchor, *(inputs[i] for i in wanted), *self._params]
        grads = _autograd.grad([o for o, _ in used], [g for _, g in used], targets)
        for i, g in zip(wanted, grads[1 : 1 + len(wanted)]):
            result[i] = g
        for p, g in zip(self._params, grads[1 + len(wanted) :]):
            if g is not None:
                self._loose.append((p, g))
        return tuple(result)

    def backward_weight(self) -> None:
        """``W``: compute every parameter gradient and accumulate it into ``.grad``.

        Raises:
            RuntimeError: if ``backward_input`` has not run yet, or ``W`` already ran.
        """
        if not self._input_done:
            raise RuntimeError("backward_weight needs backward_input (I) to run first")
        if self._weight_done:
            raise RuntimeError("backward_weight was already called on this tape")
        self._weight_done = True
        roots: list[Tensor] = []
        root_grads: list[Tensor] = []
        params: dict[int, nn.Parameter] = {}
        for call in self._calls:
            if call.grads is None:
                continue  # this call's output never reached the loss: no gradient
            for y, g in zip(call.outputs, call.grads):
                if g is not None:
                    roots.append(y)
                    root_grads.append(g)
            for p in call.params:
                if p.requires_grad:
                    params.setdefault(id(p), p)
        if roots and params:
            # One engine call over all local graphs: each is one layer, so nothing repeats,
            # and a parameter shared by several units gets the sum of its uses exactly once.
            # The engine accumulates into .grad itself (like Tensor.backward): the first
            # gradient of a step is adopted without a copy when nothing else holds it,
            # later ones are added in place, under each parameter's own lock.
            _autograd.backward(roots, root_grads, list(params.values()))
        if self._loose:
            # Gradients that I found outside any unit: accumulated the same way, by the
            # engine, each parameter being a root of its own (the engine copies a
            # gradient that I's result still references instead of adopting it).
            _autograd.backward([p for p, _ in self._loose], [g for _, g in self._loose])
        self._calls.clear()
        self._loose.clear()


class TwoStageBackward:
    """Prepares a module for two-stage backprop; forwards recorded under :meth:`record` split.

    Construction wraps the ``forward`` of each unit (see :func:`find_units`; an instance
    attribute, the class is untouched). The wrapper acts only in a thread that is
    recording a tape, so the module behaves as usual everywhere else, and a unit's own
    hooks still run around it. ``close()`` (or leaving the ``with`` block) restores the
    units. Which modules are units is decided here, from ``requires_grad``: after freezing,
    unfreezing or replacing parameters, :meth:`stale` is true and a new one must be built
    (a :class:`~batchgraph.pipeline.stage.Stage` does that at a step's first forward).

    A wrapper rather than a forward pre-hook and hook: a module with hooks takes
    ``nn.Module``'s slow call path, and the pair passes its state through a stack of
    frames; the wrapper does the same in one Python call per unit, about half the
    recording cost per layer.

    Args:
        module: the stage module.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> lin = nn.Linear(3, 2)
        >>> split = TwoStageBackward(lin)
        >>> with split.record() as tape:
        ...     y = lin(torch.randn(4, 3))
        >>> _ = tape.backward_input([y], [torch.ones_like(y)])
        >>> tape.backward_weight()
        >>> split.close()
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.units = find_units(module)
        self._all_params: tuple[nn.Parameter, ...] = tuple(module.parameters())
        self._trainable = tuple([p.requires_grad for p in self._all_params])
        self._params: list[nn.Parameter] = [p for p in self._all_params if p.requires_grad]
        self._wrapped: list[tuple[nn.Module, UnitForward]] = []
        self.checked = False  # see check()
        with WRAPPING:
            for unit in self.units:
                self._wrapped.append((unit, wrap_unit(unit)))

    def __enter__(self) -> TwoStageBackward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stale(self) -> bool:
        """Whether a parameter was frozen, unfrozen, added or replaced since this was built.

        The units and the parameters ``I`` and ``W`` ask for depend on ``requires_grad``
        and on the parameter objects: with a changed trainable set, a frozen parameter
        would be asked for (an error) and an unfrozen layer outside every unit would get no
        gradient; a parameter replaced by another (``layer.weight = nn.Parameter(...)``)
        would get none either. Costs a walk over the parameters, so it can be checked
        every step.
        """
        params = tuple(self.module.parameters())
        if len(params) != len(self._all_params):
            return True
        return any(
            p is not q or p.requires_grad != trainable
            for p, q, trainable in zip(params, self._all_params, self._trainable)
        )

    def close(self) -> None:
        """Restore the units' ``forward``; the module is left as it was.

        A unit that another open ``TwoStageBackward`` also prepared (one module in two
        stages) keeps its wrapper until the last of them closes, in any order.
        """
        with WRAPPING:
            for unit, wrapper in self._wrapped:
                wrapper.users -= 1
                if wrapper.users == 0 and unit.__dict__.get("forward") is wrapper:
                    # The unit's forward before wrapping: the class's, or an instance's own.
                    if wrapper.previous is None:
                        del unit.__dict__["forward"]
                    else:
                        unit.__dict__["forward"] = wrapper.previous
        self._wrapped.clear()

    def check(self, outputs: Sequence[Tensor], tape: BackwardTape) -> None:
        """Refuse what the split backward cannot run, once, after the first recorded forward.

        A reentrant ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` runs its
        own ``backward`` inside the graph, which fails when autograd is asked for some
        inputs' gradients only, as ``I`` and ``W`` are; it would fail at the first ``I``
        with torch's own error. The recorded graphs (the chain and each unit's local one)
        are walked once for its node.

        Raises:
            PipelineConfigError: if a reentrant checkpoint was recorded.
        """
        if self.checked:
            return
        self.checked = True
        roots = [*outputs, *(y for call in tape._calls for y in call.outputs)]
        if _has_node(roots, "CheckpointFunctionBackward"):
            raise PipelineConfigError(
                f"the stage module ({type(self.module).__name__}) runs "
                "torch.utils.checkpoint.checkpoint with "
                "use_reentrant=True, which the split backward of 'zb-h1' cannot run (it asks "
                "autograd for input gradients only); pass use_reentrant=False (it works "
                "with 'zb-h1'), or use a schedule without the split backward ('1f1b')"
            )

    @contextmanager
    def record(self) -> Iterator[BackwardTape]:
        """Record the forward passes run in this block (in this thread) on a new tape.

        Yields:
            The tape; call its ``backward_input`` and then ``backward_weight``.
        """
        local = RECORDING
        tape = BackwardTape(self._params)
        previous, depth = local.tape, local.depth
        local.tape, local.depth = tape, 0
        try:
            yield tape
        finally:
            local.tape, local.depth = previous, depth


def _has_node(roots: Sequence[Tensor], name: str) -> bool:
    """Whether an autograd node of type ``name`` is in the graph of ``roots``."""
    seen: set[int] = set()
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == name:
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


