"""Whether a callable is torch's own: C functions and methods, torch's Python functions,
and modules whose ``forward`` is torch's.

For such callables torch's conventions hold: a name with a trailing underscore
(``add_``, ``torch.relu_``) or ``inplace=True`` (``F.relu(x, inplace=True)``,
``nn.ReLU(inplace=True)``) changes the input in place and returns it, and the result is
computed from the arguments alone. A user's function or module may mean anything by
such a name or an ``inplace`` attribute (timm-style blocks keep ``self.inplace`` for an
activation of an intermediate value), so what it does is found by running it instead.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["torchs_own"]

# C functions and methods, which compute only from their arguments.
_BUILTIN_TYPES = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
)


def torchs_own(fn: Any) -> bool:
    """Whether ``fn`` is a C function or method, a function of torch's own Python
    (``torch.nn.functional``, ``Tensor.split``), or a module whose ``forward`` is.

    Example:
        >>> torchs_own(torch.Tensor.relu_), torchs_own(torch.nn.functional.relu)
        (True, True)
        >>> torchs_own(torch.nn.ReLU(inplace=True))
        True
        >>> def relu_(x):
        ...     return x.clamp(min=0)
        >>> torchs_own(relu_)
        False
    """
    if isinstance(fn, torch.nn.Module):
        fn = getattr(type(fn), "forward", None)
    if isinstance(fn, _BUILTIN_TYPES):
        return True
    if not isinstance(fn, types.FunctionType):
        return False
    module = fn.__module__ or ""
    return module == "torch" or module.startswith("torch.")
