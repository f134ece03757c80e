"""``BatchedModule``: a container whose module attributes record when a policy is active.

A ``BatchedModule`` holds ordinary ``nn.Module``s that work on batches (cells, linear
layers) and per-example methods that call them. While a ``BatchingPolicy`` records,
reading such an attribute gives a *stub* that records the call instead of running it;
otherwise the attribute is the module itself, so the very same code runs eagerly.
Nested ``BatchedModule``s are returned as they are (their own attributes stub
themselves), ``nn.ModuleList``/``nn.ModuleDict`` give containers of stubs, and
``nn.ParameterList``/``nn.ParameterDict`` are returned as they are (their parameters
are read, as ``self.h0`` is).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

from batchgraph.pinning import pin_stub
from batchgraph.recording import _ACTIVE
from batchgraph.sites import ModuleStub, module_site

__all__ = ["BatchedModule", "ModuleStub"]


class _ContainerStub:
    """``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential`` whose items are stubbed."""

    # Named so that no container's own attribute is taken for it (see ModuleStub).
    __slots__ = ("_bg_container",)

    def __init__(self, container: Any) -> None:
        # Any: ModuleList, ModuleDict and Sequential share indexing but no base type.
        object.__setattr__(self, "_bg_container", container)

    def __getitem__(self, index: Any) -> Any:
        return _stub(self._bg_container[index])

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self._bg_container, nn.ModuleDict):
            return iter(self._bg_container)
        return (_stub(m) for m in self._bg_container)

    def __len__(self) -> int:
        return len(self._bg_container)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _stub_module(self._bg_container)(*args, **kwargs)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # type: ignore[override]
        # isinstance(self.layers, nn.ModuleList) answers as eagerly (see ModuleStub).
        return type(self._bg_container)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._bg_container, name)
        if name in ("keys", "values", "items") and isinstance(self._bg_container, nn.ModuleDict):
            return _dict_view(self._bg_container, name)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Per-example code setting a container's attribute (a Sequential subclass's
        # own setting) sets it on the container, as eagerly.
        setattr(self._bg_container, name, value)


def _dict_view(container: nn.ModuleDict, name: str) -> Any:
    def view() -> Any:
        if name == "keys":
            return container.keys()
        if name == "values":
            return [_stub(m) for m in container.values()]
        return [(k, _stub(m)) for k, m in container.items()]

    return view


def _stub_module(module: nn.Module) -> ModuleStub:
    # Stubs hold no policy state, so one per module serves every policy.
    return module_site(module)


def _stub(value: Any) -> Any:
    if isinstance(value, _AS_THEY_ARE) or not isinstance(value, nn.Module):
        return value
    if isinstance(value, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return _ContainerStub(value)
    return _stub_module(value)


_MISSING = object()
_STUB_TYPES = (ModuleStub, _ContainerStub)


def _unpin(owner: nn.Module, name: str) -> None:
    d = owner.__dict__
    if type(d.get(name)) in _STUB_TYPES:
        del d[name]


class _SubmoduleAttribute:
    """A class attribute that reads submodule ``name`` of a ``BatchedModule``.

    A non-data descriptor: a value in the instance ``__dict__`` still wins, and an
    instance whose ``name`` is not a submodule falls back to ``nn.Module``'s lookup
    (parameters, buffers, or the usual ``AttributeError``).

    While recording, the stub is also *pinned* in the instance ``__dict__`` (which
    wins over this descriptor), so the next reads of ``self.cell`` are plain lookups
    (7x cheaper: per-example code reads them once per call). Every recording context
    unpins when it ends (``pinning.unpin_stubs``); until then, code of another
    thread reading the attribute gets the stub too, which runs the module eagerly
    when no policy records there.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, owner: nn.Module | None, cls: type | None = None) -> Any:
        if owner is None:  # the class itself has no such attribute
            raise AttributeError(self.name)
        d = owner.__dict__
        name = self.name
        module = d["_modules"].get(name)
        if module is None:
            return nn.Module.__getattr__(owner, name)
        if _ACTIVE.get() is None:
            return module
        # Recording: the module's stub (module stubs are cached per module), pinned so
        # that this descriptor runs once per attribute per recording context.
        stub = _stub(module)
        if stub is not module:  # nested BatchedModules are returned as they are
            pin_stub(owner, name, stub)
        return stub


class BatchedModule(nn.Module):
    """An ``nn.Module`` whose per-example code is recorded under a ``BatchingPolicy``.

    Write methods for one example (no batch dimension); call them eagerly for the
    unbatched reference, or inside a policy to record and batch them.

    Example:
        >>> import batchgraph as bg, torch
        >>> class Scorer(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(4, 1)
        ...     def score(self, x):
        ...         return self.lin(x)
        >>> model = Scorer()
        >>> xs = [torch.randn(4) for _ in range(3)]
        >>> with bg.BatchingPolicy():
        ...     hs = [model.score(x) for x in xs]
        >>> [t.shape for t in bg.compute(hs)]
        [torch.Size([1]), torch.Size([1]), torch.Size([1])]
    """

    def __getattr__(self, name: str) -> Any:
        # Reached when normal lookup fails, as for any nn.Module submodule. The first
        # time a submodule is read this way, its name gets a _SubmoduleAttribute on the
        # class, so later reads (every `self.cell` of per-example code) skip the failed
        # lookup and nn.Module.__getattr__: about half the cost of a read.
        if name in self.__dict__["_modules"]:
            cls = type(self)
            attribute = _SubmoduleAttribute(name)
            if getattr(cls, name, _MISSING) is _MISSING:
                setattr(cls, name, attribute)
            return attribute.__get__(self, cls)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        _unpin(self, name)  # the new value wins over a stub pinned while recording
        # `self.last = layer` in per-example code: layer is a stub while recording, and
        # eagerly the module itself is registered (a stub registered as a submodule
        # would outlive the recording).
        if type(value) is ModuleStub:
            value = value.__wrapped__
        elif type(value) is _ContainerStub:
            value = value._bg_container
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        _unpin(self, name)
        super().__delattr__(name)

    def __getstate__(self) -> dict[str, Any]:
        # Stubs pinned while recording belong to this process: never pickle or
        # deep-copy them.
        return {k: v for k, v in self.__dict__.items() if type(v) not in _STUB_TYPES}


# Returned as they are while recording: nested BatchedModules stub their own
# attributes, and parameter containers hold tensors, not calls to record (a stub of
# one is neither indexable nor iterable: ``self.weights[0]`` raised TypeError).
_AS_THEY_ARE = (BatchedModule, nn.ParameterList, nn.ParameterDict)
