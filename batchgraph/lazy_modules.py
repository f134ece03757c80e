"""Lazy modules (``nn.LazyLinear``) called while recording: initialized as eagerly.

A lazy module takes its parameters' shapes from its first call. Recorded, that call
runs only when the batch computes, and shape inference runs on fake tensors, where it
could only make meta parameters: so the module is initialized when the call is first
recorded, from the call's per-example input specs.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from batchgraph.keys import callable_name
from batchgraph.specs import CallSignature

__all__ = ["materialize_lazy"]


def materialize_lazy(module: torch.nn.Module, call: CallSignature) -> None:
    """Initialize a lazy module (``nn.LazyLinear``) called with uninitialized
    parameters, as its first eager call would: shaped by this call's inputs and
    initialized now (drawing random numbers here, where eagerly the call is). The
    caller runs it outside recording (``not_recording``): the module's own calls run.

    A lazy submodule inside the called module is initialized by the module's own
    forward, which cannot run before the batch does: that is refused, saying how to
    initialize it first.

    Example:
        >>> import batchgraph as bg
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.LazyLinear(3)
        >>> m = M()
        >>> with bg.BatchingPolicy():
        ...     h = m.lin(torch.randn(5))    # recorded: initialized here, as eagerly
        >>> m.lin.weight.shape
        torch.Size([3, 5])
    """
    from torch.nn.modules.lazy import LazyModuleMixin

    lazy_self: Any = module  # LazyModuleMixin's methods are typed for its protocol
    if isinstance(module, LazyModuleMixin) and lazy_self.has_uninitialized_params():
        zeros = [torch.zeros(s.shape, dtype=s.dtype, device=s.device)
                 for s in call.input_specs if s is not None]

        def infer(*args: Any, **kwargs: Any) -> None:
            lazy_self._infer_parameters(module, args, kwargs)

        call.apply(infer, zeros)
    lazy = [name or type(module).__name__ for name, m in module.named_modules()
            if isinstance(m, LazyModuleMixin) and cast(Any, m).has_uninitialized_params()]
    if lazy:
        raise ValueError(
            f"{callable_name(module)} holds lazy modules whose parameters are not "
            f"initialized yet ({', '.join(lazy[:5])}): they take their shapes from their "
            "first call, which here runs only when the batch computes. Run one example "
            "eagerly first (outside the BatchingPolicy), or call the lazy module itself "
            "from the per-example code."
        )
