"""Functional entry points: ``batched_func``, ``batched_value`` and ``compute``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchgraph.handle import ResultHandle
from batchgraph.policy import _collect, policy_of
from batchgraph.recording import _ACTIVE
from batchgraph.sites import ModuleStub, function_site, module_site

__all__ = ["batched_func", "batched_value", "compute"]


def batched_func(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Defer ``fn``: inside a policy calls record; outside they run ``fn`` directly.

    ``fn`` may be any function or ``nn.Module`` with per-example semantics; functions
    without a fast rule batch through ``torch.func.vmap``.

    Raises:
        TypeError: ``fn`` is not callable.

    Example:
        >>> import batchgraph as bg, torch
        >>> add = bg.batched_func(torch.add)
        >>> add(torch.ones(2), torch.ones(2))          # eager outside a policy
        tensor([2., 2.])
        >>> with bg.BatchingPolicy():
        ...     h = add(torch.ones(2), torch.ones(2))  # recorded
        >>> bg.compute(h)
        tensor([2., 2.])
    """
    if not callable(fn):
        # Else it failed only at the first call ("'int' object is not callable"),
        # far from the mistake.
        raise TypeError(
            f"batched_func takes the function or nn.Module to defer, got "
            f"{type(fn).__name__} {fn!r}: pass the callable itself, "
            "bg.batched_func(my_function), or @bg.batched_func above its def"
        )
    # The call site itself is the wrapper: one Python call level per recorded call.
    if type(fn) is ModuleStub:  # a submodule read while recording: already its site
        return fn
    return module_site(fn) if isinstance(fn, torch.nn.Module) else function_site(fn)


_SCALARS = (int, float, bool)
_new_handle = object.__new__


def batched_value(value: Any, device: torch.device | str | None = None) -> Any:
    """A handle for a per-example constant (outside a policy: the tensor itself).

    Python scalars (``bool``, ``int``, ``float``) are kept as they are while recording
    and become one tensor per batch, which is much cheaper than a ``torch.tensor``
    per example; ``bg.batched_value(tree.token)`` is the fast way to feed token ids.
    A tensor's handle stands for that tensor itself, as the eager call returns it:
    computing the handle gives it back, and calls recorded on the handle after the
    tensor was changed in place read it as it is then.

    Args:
        value: a tensor, a Python scalar, or anything ``torch.as_tensor`` accepts; a
            handle is returned as it is (``device`` given: moved there), as eagerly
            ``torch.as_tensor`` returns the tensor it is given.
        device: where the constant lives. For Python scalars this costs nothing per
            example: the batch's scalars become one tensor on ``device`` (one copy to
            the GPU per batch instead of one per example).

    Example:
        >>> import batchgraph as bg, torch
        >>> bg.batched_value(3)
        tensor(3)
    """
    policy = _ACTIVE.get()
    if policy is not None and device is None and type(value) in _SCALARS:
        graph = policy.graph  # the per-token fast path
        node = graph.add_scalar(value)
        # Built field by field, as CallSite.__call__ does: a third cheaper than __init__.
        h = _new_handle(ResultHandle)
        h._graph = graph
        h._gen = graph.generation
        h.node = node
        h.leaf = 0
        h.spec = graph.node_spec[node]
        h._out = None
        return h
    if type(value) is ResultHandle:
        # Eagerly this is torch.as_tensor(t): t itself (moved to ``device``), so code
        # that wraps whatever token it holds (a predicted one, a handle, while
        # recording) runs as eagerly; torch.as_tensor of a handle would fail.
        return value if device is None else value.to(device)
    where = torch.device(device) if device is not None else None
    if policy is None:
        return torch.as_tensor(value, device=where)
    graph = policy.graph
    if type(value) in _SCALARS:
        node = graph.add_constant(value, where)
        return ResultHandle(graph, node, 0, graph.node_spec[node])
    tensor = torch.as_tensor(value, device=where)
    node = graph.add_constant(tensor)
    h = ResultHandle(graph, node, 0, graph.node_spec[node])
    if not tensor.is_inference():  # (inference tensors keep no version to compare)
        # Eagerly this *is* the tensor: computing the handle gives it back, and a call
        # recorded on the handle after the tensor changed in place reads it as it is
        # then, as for a value handed out (ResultHandle.handed).
        h._out = (tensor, tensor._version)
    return h


def compute(obj: Any) -> Any:
    """Compute all handles in ``obj`` and return the same nesting with tensors.

    The policy is the one the handles belong to (they must all share it). Plain
    tensors and other leaves are returned unchanged.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     pair = {"a": bg.batched_value(torch.ones(2)) * 3}
        >>> bg.compute(pair)
        {'a': tensor([3., 3.])}
    """
    handles: list[ResultHandle] = []
    _collect(obj, handles)
    if not handles:
        return obj
    return policy_of(handles[0]._graph).compute(obj)
