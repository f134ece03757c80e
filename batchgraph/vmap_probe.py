"""Whether ``torch.func.vmap`` runs a ``VmapKey`` call as its eager run does.

Checked once per call signature, on fake tensors, when the call is recorded
(``CallSite._bg_resolve``): a call that vmap refuses, that loses an example's shape, that
computes in other dtypes (``batchgraph.dtype_trace``) or that does what vmap runs
without error but wrongly (``_WrongUnderVmap``) runs one example at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from batchgraph.dtype_trace import vmap_traced
from batchgraph.keys import BatchKey, VmapKey
from batchgraph.module_state import state_kept
from batchgraph.specs import OutSpec, TensorSpec, flatten_output, spec_leaves
from batchgraph.tie_reductions import EVEN_REDUCTIONS

__all__ = ["probe_vmap"]


def probe_vmap(key: BatchKey, spec: OutSpec = None) -> bool:
    """Whether ``key`` can run a batch of two on fake tensors (checked once per key)
    and, where the call's own output ``spec`` is given, keeps each example's shapes.

    Only ``VmapKey`` needs the probe: the other built-in rules are known to batch.
    Some ops run under vmap but lose a dimension (``x.argmax(keepdim=True)`` gives
    each example ``(1,)`` where eagerly it is ``(1, 1)``): such a call would fail at
    ``compute`` with a shape error the user cannot fix, so it runs one at a time.
    So does a call that vmap computes in other dtypes than its eager run, which
    would give other values without an error (``batchgraph.dtype_trace``).
    """
    if not isinstance(key, VmapKey):
        return True
    with state_kept(key.fn) as kept:
        batches = _probe(key, spec)
    # A forward keeping a tensor it makes (self.last_out = out, a mask made from its
    # input) kept the batch's, a tensor escaped from vmap; where it reads it back in
    # a later call, each example read its own where eagerly they read the first's.
    return batches and not kept.batched


def _probe(key: VmapKey, spec: OutSpec) -> bool:
    from batchgraph.inference import on_fake_tensors  # it imports this module

    try:
        with on_fake_tensors():
            inputs = [
                torch.empty((2, *s.shape), dtype=s.dtype, device=s.device)
                for s in key.call.input_specs
                if s is not None
            ]
            with _WrongUnderVmap(), _WrongShapesUnderVmap():  # type: ignore[no-untyped-call]
                if inputs and spec is not None:
                    # One vmapped run, traced: the shapes come from it too (a function's
                    # side effects, a module's hooks, run once here as before). What
                    # the example's run keeps is undone before it: the batched run
                    # starts from the state a compute starts from (a cache not filled).
                    out, same = vmap_traced(key.per_example, [x[0] for x in inputs], inputs,
                                            lambda: state_kept(key.fn))
                else:
                    out, same = key.run_vmapped(key.fn, inputs, 2), True
            if spec is None:
                return True
            leaves: list[torch.Tensor] = []
            flatten_output(out, leaves)
            wanted = spec_leaves(spec)
            # Shapes here; dtypes below, call by call (under autocast vmap may give a
            # finer dtype, which the executor converts: see check_stacked).
            if len(leaves) != len(wanted) or not all(
                not isinstance(w, TensorSpec) or leaf.shape[1:] == w.shape
                for leaf, w in zip(leaves, wanted)
            ):
                return False
            return same
    except Exception:
        return False


class _WrongUnderVmap(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Fails the probe of a call whose ops vmap runs without error but with results
    other than eager ones (run one at a time, the call is eager):

    * ``y.set_(t)`` points a tensor at other memory: under vmap, torch runs it on each
      example's slice of the batch, a view, and the batch keeps its values (``y``
      read afterwards held its old values). (``set_`` is not dispatched to torch
      function modes: this sees aten's.)
    * an embedding lookup with ``scale_grad_by_freq`` (``nn.Embedding`` in a function
      of the user's): vmap looks up all the examples' indices at once, and each row's
      gradient was divided by its count over the batch, not in its own example.
    * an op inside ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its
      forward runs under vmap, but the backward recomputes it outside vmap, on the
      batch's vmap-internal tensors, and failed there ("Either your tensor may have
      escaped from inside a function being vmapped"), far from the call.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "prim":
            # A query of a fake's metadata (its device), which torch makes where an
            # error cannot propagate (saving a fake parameter for backward): raised
            # there, the process aborted. The call's next operation fails the probe.
            return func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten.set_:
            raise RuntimeError("Tensor.set_ under vmap changes a slice of the batch only")
        if func.overloadpacket is torch.ops.aten.embedding and (
            (len(args) > 3 and args[3]) or kwargs.get("scale_grad_by_freq")
        ):
            raise RuntimeError("an embedding under vmap counts rows over the batch")
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is not None and getattr(hooks[0], "__module__", None) == _CHECKPOINT:
            raise RuntimeError("a checkpoint under vmap recomputes outside it in backward")
        return func(*args, **kwargs)


class _WrongShapesUnderVmap(TorchFunctionMode):
    """Fails the probe of a call making an op that vmap runs without error but wrongly
    for the example's shape, which only the example's own (logical) tensors tell (a
    function mode sees them; the dispatch mode above sees the batch's):

    * ``torch.roll(x, 1)`` of a 0-d ``x`` with no dims (a roll over all the elements)
      leaves it as it is eagerly; vmap's batching rule rolled the batch, so each
      example got another example's value, silently.
    * ``x.max()`` (``min``, ``median``, ``nanmedian``) of a floating ``x``, no dim:
      eagerly its gradient is shared by the elements tied for the result; under vmap
      one of them got it all, silently (a call of its own on a handle batches with
      eager's gradient: ``tie_reductions``).
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (func in EVEN_REDUCTIONS and len(args) == 1 and not kwargs
                and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()):
            raise RuntimeError("vmap gives a whole-tensor max's gradient to one of its ties")
        if func in _ROLLS and args and isinstance(args[0], torch.Tensor) and args[0].dim() == 0:
            dims = args[2] if len(args) > 2 else kwargs.get("dims")
            if dims is None or (isinstance(dims, (tuple, list)) and not dims):
                raise RuntimeError("vmap rolls the batch where a 0-d example is rolled")
        return func(*args, **kwargs)


_ROLLS = frozenset({torch.roll, torch.Tensor.roll})


# Where torch.utils.checkpoint's saved-tensor hooks are defined: the non-reentrant
# checkpoint packs saved tensors with them (the reentrant one fails the probe itself).
_CHECKPOINT = "torch.utils.checkpoint"
