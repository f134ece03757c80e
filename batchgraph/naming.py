"""Naming callables so they can cross a process boundary as plain strings.

A recorded call's callable is either a submodule of the model (named by its
``named_modules()`` path, ``"cell"`` or ``"layers.0"``) or an importable function
(named ``"module:qualname"``, ``"torch:tanh"`` or ``"torch:Tensor.sum"``). A name is
only handed out after checking that resolving it gives back the very same object, so
a name that resolves in the worker resolves to the same function in the main process
(same code, same imports).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from torch import nn

__all__ = ["function_name", "module_names", "qualified_name", "resolve_function"]

# Functions are named once; torch functions and operators are few and long-lived.
_NAMES: dict[Any, str] = {}


def resolve_function(name: str) -> Any:
    """The object a ``"module:qualname"`` name stands for.

    Args:
        name: e.g. ``"torch:tanh"`` or ``"torch:Tensor.sum"``.

    Returns:
        The function (or class) found by importing the module and walking the attributes.

    Raises:
        LookupError: when the module cannot be imported or an attribute is missing.

    Example:
        >>> import torch
        >>> resolve_function("torch:tanh") is torch.tanh
        True
    """
    module_name, _, qualname = name.partition(":")
    if not module_name or not qualname:
        raise LookupError(f"{name!r} is not a 'module:qualname' name")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise LookupError(f"cannot import module {module_name!r} for {name!r}: {err}") from err
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise LookupError(
                f"{name!r} does not resolve: {module_name}.{qualname} has no {part!r}"
            ) from err
    return obj


def _candidates(fn: Any) -> list[str]:
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    short = getattr(fn, "__name__", None)
    found = []
    if module and qualname:
        found.append(f"{module}:{qualname}")
    if module and short:
        found.append(f"{module}:{short}")  # torch.add's qualname is _VariableFunctionsClass.add
    owner = getattr(fn, "__objclass__", None)  # tensor methods: TensorBase.sum
    if owner is not None and short:
        found.append(f"torch:Tensor.{short}")
        found.append(f"{owner.__module__}:{owner.__qualname__}.{short}")
    return found


def function_name(fn: Any) -> str:
    """An importable ``"module:qualname"`` name that resolves back to ``fn`` itself.

    Args:
        fn: a function, builtin, operator or tensor method.

    Returns:
        The name (cached per function).

    Raises:
        LookupError: when no importable name gives back ``fn`` (lambdas, closures,
            bound methods): such a callable cannot be named in another process.

    Example:
        >>> import torch
        >>> function_name(torch.Tensor.sum)
        'torch:Tensor.sum'
    """
    try:
        cached = _NAMES.get(fn)
    except TypeError:  # unhashable callables are named every time
        cached = None
    if cached is not None:
        return cached
    for name in _candidates(fn):
        try:
            if resolve_function(name) is fn:
                with contextlib.suppress(TypeError):  # unhashable: not cached
                    _NAMES[fn] = name
                return name
        except LookupError:
            continue
    raise LookupError(
        f"{fn!r} has no importable name (tried {_candidates(fn) or 'none'}); a function "
        "recorded in a worker must be defined at the top level of an importable module "
        "so the main process can find it. Move it to module level, or make it a "
        "submodule of the model."
    )


def qualified_name(obj: Any) -> str:
    """``"module:qualname"`` of a class (or of an object's class).

    Example:
        >>> from torch import nn
        >>> qualified_name(nn.Linear)
        'torch.nn.modules.linear:Linear'
    """
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def module_names(model: nn.Module) -> dict[int, str]:
    """``id(submodule) -> path`` for every submodule (the model itself is ``""``)."""
    return {id(m): name for name, m in model.named_modules()}
