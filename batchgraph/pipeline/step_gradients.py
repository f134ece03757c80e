"""A step's own gradients, kept apart from those accumulated by earlier steps.

A pipeline step runs many backwards (one per microbatch), so when it fails part-way some
microbatches have already added their gradients to ``.grad``. On one device the same
failure (a user error in the forward, a bad batch) happens before ``loss.backward()``
adds anything, and a caller who catches it and goes on accumulating keeps exactly the
earlier steps' gradients. So a step takes the earlier gradients out first, and puts them
back as they were if it fails, or adds this step's to them if it succeeds::

    saved = stash_gradients(params)        # .grad = None: the step's backwards start fresh
    try:
        run_step()                         # (the distributed backend sums these over ranks)
    except BaseException:
        discard_step_gradients(params, saved)   # .grad as before the step
        raise
    restore_gradients(params, saved)       # .grad = earlier + this step's
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

__all__ = ["discard_step_gradients", "restore_gradients", "stash_gradients"]


def stash_gradients(params: Sequence[nn.Parameter]) -> list[Tensor | None]:
    """Take the gradients out of ``params`` (set to ``None``) so a step's own are apart.

    Without this, gradients accumulated by earlier steps would be summed over the replicas
    again on every step, and a failed step would leave part of its gradients behind.

    Example:
        >>> import torch
        >>> p = nn.Parameter(torch.ones(2))
        >>> p.grad = torch.full((2,), 3.0)
        >>> saved = stash_gradients([p])
        >>> p.grad is None, saved[0].tolist()
        (True, [3.0, 3.0])
    """
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    return saved


def restore_gradients(params: Sequence[nn.Parameter], saved: Sequence[Tensor | None]) -> None:
    """Add the gradients :func:`stash_gradients` took out to this step's.

    Into the earlier gradient tensor, as a backward accumulates into an existing
    ``.grad``: it stays the same object (a reference the caller kept sees the sum).

    Example:
        >>> import torch
        >>> p = nn.Parameter(torch.ones(2))
        >>> earlier = p.grad = torch.full((2,), 3.0)
        >>> saved = stash_gradients([p])
        >>> p.grad = torch.ones(2)            # this step's
        >>> restore_gradients([p], saved)
        >>> p.grad is earlier, p.grad.tolist()
        (True, [4.0, 4.0])
    """
    for p, old in zip(params, saved):
        new = p.grad
        if old is None:
            continue
        if new is None:
            p.grad = old
        elif old.layout == new.layout and not old.is_sparse:
            p.grad = old.add_(new)
        else:  # sparse with dense: no in-place sum (autograd also adds out of place)
            p.grad = old + new


def discard_step_gradients(params: Sequence[nn.Parameter], saved: Sequence[Tensor | None]) -> None:
    """Put back the gradients from before a failed step, dropping what it had added.

    Example:
        >>> import torch
        >>> p = nn.Parameter(torch.ones(2))
        >>> p.grad = torch.full((2,), 3.0)
        >>> saved = stash_gradients([p])
        >>> p.grad = torch.ones(2)            # part of a step that then failed
        >>> discard_step_gradients([p], saved)
        >>> p.grad.tolist()
        [3.0, 3.0]
    """
    for p, old in zip(params, saved):
        p.grad = old
