"""Where calls record: the call site of each module and function, and recording a
call made on handles (operators, tensor methods, ``__torch_function__``).

Sites are cached (a module's, a lambda's, as long as it lives: ``batchgraph.held``), so
the signatures a site has resolved serve every later policy (see ``batchgraph.recording``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import MethodType
from typing import TYPE_CHECKING, Any

import torch

from batchgraph.handle import ResultHandle
from batchgraph.held import held_on
from batchgraph.lifetimes import lives_forever
from batchgraph.pinning import unpin_stubs
from batchgraph.recording import _ACTIVE, CallSite
from batchgraph.signatures import foreign_handle
from batchgraph.strided import AS_STRIDED, offset_from_start

if TYPE_CHECKING:
    from batchgraph.graph import Graph

__all__ = ["ModuleStub", "function_site", "method_site", "module_site", "record_function"]


class ModuleStub(CallSite):
    """The call site of a module, standing in for it while a policy records.

    Calls record; every other attribute is read from and set on the module
    (``stub.hidden_size``, ``stub.weight``, the module's own ``stub.fn`` or
    ``stub.name``, a wrapper's ``stub.module``: the site's own fields are all named
    ``_bg_*``). The module itself is ``stub.__wrapped__`` (``inspect.unwrap``).

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        >>> m = M()
        >>> with bg.BatchingPolicy():
        ...     isinstance(m.lin, ModuleStub), m.lin.out_features, m.lin.__wrapped__ is m._modules["lin"]
        (True, 2, True)
    """

    __slots__ = ()

    @property
    def fn(self) -> Any:
        # The module's own `fn` (`self.act.fn(x)`, as eagerly), not the site's callable.
        return self.__getattr__("fn")

    def __getattr__(self, name: str) -> Any:
        if name in _SWAPPED_STATE and _ACTIVE.get() is not None:
            # torch.func.functional_call(self.cell, params, (h,)) in per-example code
            # swaps the module's tensors in these dicts for the call it makes, but the
            # stub records that call, which runs when the batch computes, with the
            # module's own parameters: the given ones were silently ignored.
            raise TypeError(
                f"{self._bg_name} is a recording stub here (a BatchedModule's submodule read "
                f"while a policy records), and its {name} were read to swap its tensors "
                "(torch.func.functional_call, torch.nn.utils.stateless): the call it "
                "records runs when the batch computes, with the module's own tensors. "
                "Record the functional call itself: make it the body of a method under "
                "@bg.batched_func (a recorded function sees the module itself), or pass "
                "the module: bg.batched_func(torch.func.functional_call)(model.cell_module"
                ", params, (h,)) with the module read outside the policy."
            )
        return getattr(self._bg_fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Per-example code setting a submodule's setting (`self.layer.temperature = t`,
        # `self.drop.p = 0.2`) sets it on the module, as eagerly; it failed with
        # "'ModuleStub' object has no attribute". Only the site's own slots, all named
        # _bg_* so that no module's setting is taken for one, are the stub's
        # (batchgraph writes them where a cached signature misses, not per call).
        if name in _SITE_SLOTS:
            object.__setattr__(self, name, value)
        else:
            setattr(self._bg_fn, name, value)

    # Per-example code may ask what a submodule is (`if isinstance(layer, nn.Dropout):
    # continue`): the stub passes for its module's class, so the recorded code takes
    # the branch the eager code takes (it recorded the dropout the eager code skipped).
    # type() still tells a stub from a module.
    @property  # type: ignore[misc]
    def __class__(self) -> type:  # type: ignore[override]
        return type(self._bg_fn)


_SITE_SLOTS: frozenset[str] = frozenset(vars(CallSite)["__slots__"]) - {"__weakref__"}
# The dicts of a module's tensors that torch's functional calls swap entries of.
_SWAPPED_STATE = frozenset({"_parameters", "_buffers"})

# Sites of functions that live as long as the program (torch functions, operators,
# functions defined at module level), by the function.
_FUNCTION_SITES: dict[Any, CallSite] = {}
# The attribute holding the site of a module, lambda, local function, partial or
# callable object on the object itself (batchgraph.held), so that it goes when the
# object does: a module's parameters, or what a closure or partial captured, are not
# kept alive by their site.
_SITE = "_batchgraph_site"
_METHOD_SITES = "_batchgraph_method_sites"
def module_site(module: torch.nn.Module) -> ModuleStub:
    """The (cached) call site of a module; its signature cache lives as long as the
    module does, and serves every policy."""
    return held_on(module, _SITE, ModuleStub, module)


def function_site(fn: Callable[..., Any]) -> CallSite:
    """The (cached) CallSite of a function, operator or tensor method.

    Example:
        >>> import functools
        >>> function_site(torch.tanh) is function_site(torch.tanh)
        True
        >>> half = functools.partial(torch.mul, 0.5)  # held on itself, not globally
        >>> function_site(half) is function_site(half) and torch.tanh in _FUNCTION_SITES
        True
    """
    try:
        site = _FUNCTION_SITES.get(fn)
    except TypeError:
        return CallSite(fn)
    if site is not None:
        return site
    if lives_forever(fn):
        site = _FUNCTION_SITES[fn] = CallSite(fn)
        return site
    if type(fn) is MethodType:
        # batched_func(obj.helper): a bound method keeps its object alive (a module
        # and its parameters, say), so its site goes on the object, by the function.
        return method_site(fn.__func__, fn.__self__)
    # A lambda, local function, functools.partial or callable object, made anew per
    # batch maybe: its site (and the tensors it holds) must go with it. Kept in the
    # global table, each one made per batch stayed alive for good, with its tensors.
    if _has_dict(fn):
        return held_on(fn, _SITE, CallSite, fn)
    return CallSite(fn)  # nowhere to keep it: its caches last as long as the site


def _has_dict(obj: Any) -> bool:
    return isinstance(getattr(obj, "__dict__", None), dict)


def method_site(func: Callable[..., Any], owner: Any) -> CallSite:
    """The (cached) CallSite of ``func`` bound to ``owner``, kept on ``owner``: a
    bound method keeps its object alive, so its site must go when the object does.

    Example:
        >>> class Scaler:
        ...     def scale(self, x):
        ...         return x * 2
        >>> s = Scaler()
        >>> method_site(Scaler.scale, s) is method_site(Scaler.scale, s)
        True
    """
    if not _has_dict(owner):  # nowhere to keep it: a site per read
        return CallSite(MethodType(func, owner))
    sites: dict[Any, CallSite] = held_on(owner, _METHOD_SITES, dict)
    site = sites.get(func)
    if site is None:
        site = sites[func] = CallSite(MethodType(func, owner))
    return site


def record_function(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record ``fn(*args, **kwargs)`` where some argument is a handle.

    Used by handle operators, tensor methods and ``__torch_function__``. The policy is
    the handles' own; it must still be recording.
    """
    if fn in AS_STRIDED and (call := offset_from_start(args, kwargs)) is not None:
        fn, args, kwargs = call
    first = args[0] if args else None
    graph = first._graph if type(first) is ResultHandle else _graph_of(args, kwargs)
    active = _ACTIVE.get()
    if active is not None and active.graph is graph and graph.open:
        # The usual case (operators and methods take the handle first): the handles'
        # own policy records here.
        return function_site(fn)(*args, **kwargs)
    policy = graph.policy
    if not graph.open:
        handle = next(h for h in _handles(args, kwargs))
        foreign_handle(handle, graph)  # raises PolicyClosedError
    site = function_site(fn)
    if active is policy:
        return site(*args, **kwargs)
    if active is not None:
        foreign_handle(next(h for h in _handles(args, kwargs)), active.graph)
    # The handles' policy records in another context (another thread, or after a
    # coroutine switched contexts): record there for the length of this one call.
    token = _ACTIVE.set(policy)
    try:
        return site(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)
        unpin_stubs()


def _handles(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[ResultHandle]:
    for a in (*args, *kwargs.values()):
        if type(a) is ResultHandle:
            yield a
        elif type(a) in (list, tuple):
            yield from _handles(tuple(a), {})


def _graph_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Graph:
    for h in _handles(args, kwargs):
        return h._graph
    raise AssertionError("record_function called without a handle")
