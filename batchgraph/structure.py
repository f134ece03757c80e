"""A model's structure without its weights, for recording in worker processes.

Workers record and schedule; they never compute with the weights. What recording
needs from the model is its *structure*: which submodules exist, their classes and
configuration, and every parameter's shape and dtype (recording infers each call's
output shape by running it on fake tensors). So the model is pickled once with every
tensor replaced by a placeholder of the same shape and dtype that owns one element
(``torch.zeros(()).expand(shape)``): the pickle is a few kilobytes whatever the model's
size, nothing of the weights is copied, and the main process's model is untouched.

Why not the alternatives:

* the ``meta`` device would change every recorded spec's device (and mix meta and CPU
  tensors in the per-example code), so the worker's keys would differ from the main
  process's and the schedules would not be identical;
* pickling the whole model copies all weights to every worker for nothing;
* a user factory (``GraphCollate(factory, ...)`` with a function that builds the
  model) is supported too, for models that do not pickle, at the cost of building
  (and initializing) a throwaway model once per worker.

Placeholders are not writable, and floating ones read as NaN (others as zeros):
per-example code must not branch on parameter values (it cannot do that under batching
anyway). A parameter or buffer the per-example code passes to a call *itself*
(``self.cell(x, self.h0)``, ``h * self.scale``) is exported by name and read from the
live model when the batch is bound (``portable.py``); a value computed from one in the
worker (``self.h0[0]``, ``self.h0 * 2``) cannot be: a view of a placeholder is refused
at export, and a new tensor computed from one reads NaN, so the mistake shows instead of
computing with zeros. NaN also keeps placeholders from being merged by value with each
other or with a real constant that happens to be zero (constants of up to 16 elements
merge by value). Placeholders live on the CPU, so recording in workers needs a CPU model
(its specs say ``cpu``).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import nn

from batchgraph.functional import batched_func
from batchgraph.placeholders import PLACEHOLDER_ATTR, is_placeholder
from batchgraph.recording import CallSite

__all__ = ["is_placeholder", "load_structure", "model_structure"]


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, parameter: bool) -> torch.Tensor:
    # One element, strides 0: reads like a constant tensor of `shape`, costs 8 bytes.
    # detach(): the expanded tensor itself is not a view then, so a view taken of it
    # in per-example code has the placeholder as its `_base` (see is_placeholder).
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    tensor = torch.full((), fill, dtype=dtype).expand(shape).detach()
    if parameter:
        tensor = nn.Parameter(tensor, requires_grad=False)
    setattr(tensor, PLACEHOLDER_ATTR, True)
    return tensor


class _StructurePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _placeholder, (tuple(obj.shape), obj.dtype, isinstance(obj, nn.Parameter))
        if isinstance(obj, CallSite):
            # A batched_func result kept as a model attribute is a call site whose
            # signature cache holds keys and closures; wrapping the same callable again
            # in the worker gives an equivalent, empty one.
            return batched_func, (obj._bg_fn,)
        return NotImplemented


def model_structure(model: nn.Module) -> bytes:
    """Pickle ``model`` with every tensor replaced by a weightless placeholder.

    Args:
        model: the model (any ``nn.Module`` that pickles).

    Returns:
        Bytes for ``load_structure``: the model's classes, configuration and tensor
        shapes, without tensor data.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: if the model does not pickle
            (lambdas or local classes in it); pass a factory to ``GraphCollate`` instead.

    Example:
        >>> lin = torch.nn.Linear(1000, 1000)
        >>> len(model_structure(lin)) < 2000
        True
        >>> load_structure(model_structure(lin)).weight.shape
        torch.Size([1000, 1000])
    """
    buffer = io.BytesIO()
    _StructurePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(model)
    return buffer.getvalue()


def load_structure(data: bytes) -> nn.Module:
    """The model a ``model_structure`` pickle describes (placeholders for tensors).

    Raises:
        TypeError: if the bytes do not hold an ``nn.Module``.

    Example:
        >>> s = load_structure(model_structure(torch.nn.Linear(2, 3)))
        >>> s.weight.stride(), s.weight.requires_grad
        ((0, 0), False)
    """
    model = pickle.loads(data)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a pickled nn.Module, got {type(model).__name__}")
    return model
