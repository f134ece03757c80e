"""Exceptions raised by batchgraph.

Each subclasses the builtin a caller would naturally catch (``ValueError`` for bad
input, ``RuntimeError`` for failures while running), so existing ``except`` clauses
keep working, and each message names the call, the values and what to do.
"""

from __future__ import annotations

__all__ = [
    "BatchedCallError",
    "BatchgraphError",
    "BufferChangedError",
    "ConstantChangedError",
    "DefaultDtypeChangedError",
    "HooksChangedError",
    "ModuleAttributeChangedError",
    "ModuleModeChangedError",
    "NotATensorError",
    "NotComputedError",
    "ParameterChangedError",
    "PolicyClosedError",
    "PolicyMismatchError",
    "ShapeMismatchError",
]


class BatchgraphError(Exception):
    """Base class of every error batchgraph raises on purpose."""


class PolicyMismatchError(BatchgraphError, ValueError):
    """Handles recorded under two different ``BatchingPolicy`` objects were combined."""


class PolicyClosedError(BatchgraphError, RuntimeError):
    """A handle was used to record a new call after its policy's ``with`` block ended."""


class NotComputedError(BatchgraphError, RuntimeError, TypeError):
    """A handle's value was read before ``compute`` ran it (``h.value``, ``float(h)``,
    ``if h > 0:``, ``h.item()``).

    Also a ``TypeError``: that is what Python's protocols (``bool``, ``int``,
    ``operator.index``) and torch's argument parsing take for "not this kind of value",
    and what such reads of a handle raised before they raised this.
    """


class ShapeMismatchError(BatchgraphError, ValueError):
    """A recorded call's per-example inputs do not fit the callable."""


class NotATensorError(BatchgraphError, TypeError):
    """A call returned something other than a tensor (or a tuple of tensors)."""


class BatchedCallError(BatchgraphError, RuntimeError):
    """A batched call raised; the message names the key, the callable and the examples."""


class ConstantChangedError(BatchgraphError, RuntimeError):
    """A tensor recorded as a per-example input was changed in place before it was
    computed: the batched run would read its new values where the eager run read the
    old ones."""


class DefaultDtypeChangedError(BatchgraphError, RuntimeError):
    """``torch.set_default_dtype`` was called between recording calls and computing
    them (or inside the recording block): a call's dtype may depend on the default
    (``int_tensor * 2.5``, ``torch.arange(3.0)`` in a recorded function), and the
    batched run would compute in the new one where the eager run used the old."""


class ModuleModeChangedError(BatchgraphError, RuntimeError):
    """A module was switched between ``train()`` and ``eval()`` after calls of it were
    recorded and before they were computed: the batched run would use the new mode
    (dropout, batch statistics) where the eager run used the old one."""


class ModuleAttributeChangedError(BatchgraphError, RuntimeError):
    """A plain attribute of a module (``drop.p``, ``norm.eps``, ``conv.padding``, a
    ``self.temperature`` read in ``forward``; see ``batchgraph.attributes``) was set
    after calls of it were recorded and before they were computed: the batched run
    would use the new value where the eager run used the old one."""


class HooksChangedError(BatchgraphError, RuntimeError):
    """A module's hooks (forward, pre-forward, backward; its submodules' too) were
    registered or removed after calls of it were recorded and before they were
    computed: the batched run would run the hooks of now where the eager run ran
    those of its time."""


class ParameterChangedError(BatchgraphError, RuntimeError):
    """A module's parameters, or tensors a recorded function reads besides its
    arguments (closed over, global, bound), changed in place (``optimizer.step()``)
    after calls of it were recorded and before they were computed: the batched run
    would read the new values where the eager run read the old ones."""


class BufferChangedError(ParameterChangedError):
    """A module's buffer (``running_mean``, a counter) was changed in place by code
    other than the batched computation (new statistics loaded, an EMA update, an eager
    call of the module) after calls of it were recorded and before they were computed:
    the batched run would read the new values where the eager run read the old ones.
    Changes the computation makes itself (a ``BatchNorm`` in training mode updating
    its running statistics) are not reported. A ``ParameterChangedError``, so an
    ``except`` for parameter changes catches it too."""
