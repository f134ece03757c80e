"""The tensors a recorded function reads besides its arguments.

A batched call reads them when it computes, not when it was recorded, so an in-place
change in between (``optimizer.step()``) would reach calls that eagerly ran before it.
Modules' parameters are watched for that (``Graph.key_versions``); this finds the
same for plain functions: tensors and modules' parameters the function closes over,
names as globals, holds as a bound method's object or as ``functools.partial``
arguments, and the same for the functions it names in turn (a few levels deep).

The buffers of the modules found so are listed apart (``captured_buffers``): they are
watched as buffers are (batchgraph.buffers), since a computation may change them itself.

It is a look at the function's code and cells, not a trace: a tensor reached through
an attribute of a plain object (``self.cache.w``) or computed anew is not found.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["captured_buffers", "captured_parts", "captured_tensors"]

# How far to follow functions named by functions, and how many items of a list,
# tuple or dict in a cell to look at: enough for helpers and weight lists, and a
# bound on the time spent on a callable (once per key, not per call).
_MAX_DEPTH = 4
_MAX_ITEMS = 64


def captured_tensors(fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    """Tensors ``fn`` reads that are not its arguments, as far as its code shows.

    Example:
        >>> import torch
        >>> w = torch.ones(2)
        >>> [t is w for t in captured_tensors(lambda x: x * w)]
        [True]
        >>> captured_tensors(torch.tanh)
        ()
    """
    found: dict[int, torch.Tensor] = {}
    _visit(fn, found, set(), 0)
    return tuple(found.values())


def captured_parts(
    fn: Callable[..., Any],
) -> tuple[tuple[torch.Tensor, ...], list[tuple[str, torch.Tensor]],
           list[tuple[str, torch.nn.Module]]]:
    """``captured_tensors(fn)``, ``captured_buffers(fn)`` and the modules ``fn`` reads
    with all their submodules, each named ``Class`` or ``Class.path`` (their
    train/eval modes are part of what its calls compute with), from one look."""
    found: dict[int, torch.Tensor] = {}
    buffers: dict[int, tuple[str, torch.Tensor]] = {}
    modules: dict[int, tuple[str, torch.nn.Module]] = {}
    _visit(fn, found, set(), 0, buffers, modules)
    return (tuple(found.values()), [named for key, named in buffers.items() if key not in found],
            list(modules.values()))


def captured_buffers(fn: Callable[..., Any]) -> list[tuple[str, torch.Tensor]]:
    """The buffers of the modules ``fn`` reads, found as ``captured_tensors`` finds
    their parameters, each named ``Class.name`` (``BatchNorm1d.running_mean``); a
    tensor also found as a captured tensor itself is left to ``captured_tensors``.

    Example:
        >>> import torch
        >>> norm = torch.nn.BatchNorm1d(2)
        >>> [name for name, _ in captured_buffers(lambda x: norm(x))]
        ['BatchNorm1d.running_mean', 'BatchNorm1d.running_var', 'BatchNorm1d.num_batches_tracked']
    """
    return captured_parts(fn)[1]


Modules = dict[int, tuple[str, torch.nn.Module]]


def _visit(
    obj: Any, found: dict[int, torch.Tensor], seen: set[int], depth: int,
    buffers: dict[int, tuple[str, torch.Tensor]] | None = None, modules: Modules | None = None,
) -> None:
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        # Inference tensors keep no version counter: they cannot be watched.
        if not obj.is_inference():
            found.setdefault(id(obj), obj)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            found.setdefault(id(p), p)
        if buffers is not None:
            owner = type(obj).__name__
            for name, b in obj.named_buffers():
                buffers.setdefault(id(b), (f"{owner}.{name}", b))
        if modules is not None:
            owner = type(obj).__name__
            for name, m in obj.named_modules():
                modules.setdefault(id(m), (f"{owner}.{name}" if name else owner, m))
    elif isinstance(obj, functools.partial):
        _visit_all((obj.func, *obj.args, *obj.keywords.values()), found, seen, depth + 1, buffers,
                   modules)
    elif isinstance(obj, types.MethodType):
        _visit_all((obj.__self__, obj.__func__), found, seen, depth + 1, buffers, modules)
    elif isinstance(obj, types.FunctionType):
        cells = []
        for cell in obj.__closure__ or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # a cell not filled yet
                continue
        names = obj.__globals__
        named = [names[n] for n in _names(obj.__code__) if n in names]
        defaults = (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values())
        _visit_all((*cells, *named, *defaults), found, seen, depth + 1, buffers, modules)
    elif isinstance(obj, (list, tuple)):
        _visit_all(obj[:_MAX_ITEMS], found, seen, depth + 1, buffers, modules)
    elif isinstance(obj, dict):
        _visit_all(list(obj.values())[:_MAX_ITEMS], found, seen, depth + 1, buffers, modules)


def _visit_all(
    objs: Iterable[Any], found: dict[int, torch.Tensor], seen: set[int], depth: int,
    buffers: dict[int, tuple[str, torch.Tensor]] | None = None, modules: Modules | None = None,
) -> None:
    for obj in objs:
        _visit(obj, found, seen, depth, buffers, modules)


def _names(code: types.CodeType) -> list[str]:
    # Global names the code and the functions defined in it (lambdas, comprehensions
    # before 3.12) use.
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_names(const))
    return names
