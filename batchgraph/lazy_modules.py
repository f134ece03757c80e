"""Lazy modules (``nn.LazyLinear``) called while recording: initialized as eagerly.

A lazy module takes its parameters' shapes from its first call. Recorded, that call
runs only when the batch computes, and shape inference runs on fake tensors, where it
could only make meta parameters: so the module is initialized when the call is first
recorded, from the call's per-example input specs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from batchgraph.captured import captured_parts
from batchgraph.errors import ShapeMismatchError
from batchgraph.keys import callable_name
from batchgraph.specs import CallSignature

__all__ = ["guard_lazy_reads", "materialize_lazy"]


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
    lazy = _uninitialized([(name or type(module).__name__, m) for name, m in module.named_modules()])
    if lazy:
        raise _refusal(f"{callable_name(module)} holds", [name for name, _ in lazy])


@contextlib.contextmanager
def guard_lazy_reads(fn: Callable[..., Any]) -> Iterator[None]:
    """Around a function's (not a module's) run on fake tensors: refuse it where it
    calls a lazy module it reads (closed over, global, a bound method's module: as
    ``batchgraph.captured`` finds them) whose parameters are not initialized yet.

    That first call initialized the module on fake tensors, with meta parameters,
    for good (an ``nn.Linear`` no eager call could run), and recording failed with a
    device error naming neither the module nor what to do. A lazy module the run
    does not call is left alone.

    Example:
        >>> lazy = torch.nn.LazyLinear(3)
        >>> with guard_lazy_reads(lambda x: lazy(x)):
        ...     pass    # what does not call it passes
        >>> with guard_lazy_reads(lambda x: lazy(x)):
        ...     lazy(torch.ones(2))
        Traceback (most recent call last):
        ...
        ValueError: ...<lambda> calls lazy modules whose parameters are not initialized yet (LazyLinear): ...
    """
    lazy = [] if isinstance(fn, torch.nn.Module) else _uninitialized(captured_parts(fn)[2])
    if not lazy:
        yield
        return

    refused: list[ValueError] = []

    def refuse(module: torch.nn.Module, *_: Any) -> None:
        refused.append(_refusal(f"{callable_name(fn)} calls", [n for n, m in lazy if m is module]))
        raise refused[-1]

    # Prepended: the module's own pre-hook (which initializes it) must not run first.
    handles = [m.register_forward_pre_hook(refuse, prepend=True) for _, m in lazy]
    try:
        yield
    except ShapeMismatchError as err:  # infer_spec's, for any failure of the fake run
        if refused and err.__cause__ is refused[0]:
            raise refused[0] from None
        raise
    finally:
        for handle in handles:
            handle.remove()


def _uninitialized(modules: list[tuple[str, torch.nn.Module]]) -> list[tuple[str, torch.nn.Module]]:
    from torch.nn.modules.lazy import LazyModuleMixin

    return [(name, m) for name, m in modules
            if isinstance(m, LazyModuleMixin) and cast(Any, m).has_uninitialized_params()]


def _refusal(who: str, lazy: list[str]) -> ValueError:
    return ValueError(
        f"{who} lazy modules whose parameters are not initialized yet "
        f"({', '.join(lazy[:5])}): they take their shapes from their first call, which "
        "here runs only when the batch computes. Run one example eagerly first (outside "
        "the BatchingPolicy), or call the lazy module itself from the per-example code."
    )
