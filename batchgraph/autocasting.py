"""Autocast as part of a recorded call, like its grad mode.

Under ``torch.autocast`` a call computes in a lower precision: its output dtype (the
recorded spec) and its values depend on the autocast state in force when the per-example
code made it. A recorded call keeps that state: recording notes it (a separate
signature cache and key per state, so calls made in different states never batch or
share specs), and the executor runs each step in its recorded state, whatever is in
force when ``compute`` runs.

A state is a tuple of ``(device type, dtype)`` for each device type autocast is on for
(empty tuples do not occur: ``None`` means autocast is off everywhere).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = [
    "AutocastState",
    "autocast_enabled",
    "autocast_state",
    "in_autocast_state",
    "without_autocast_cache",
]

AutocastState = tuple[tuple[str, torch.dtype], ...]

# The device types autocast knows here (cpu, cuda, xpu, mps, ...).
_DEVICES: tuple[str, ...] = tuple(torch._C._autocast_supported_devices())

# One C call (~140 ns): checked once per recorded call.
autocast_enabled = torch._C._is_any_autocast_enabled


def autocast_state() -> AutocastState | None:
    """The calling thread's autocast state, or None when autocast is off.

    Example:
        >>> autocast_state() is None
        True
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_state()
        (('cpu', torch.bfloat16),)
    """
    if not autocast_enabled():
        return None
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _DEVICES
        if torch.is_autocast_enabled(device)
    )


@contextlib.contextmanager
def in_autocast_state(state: AutocastState | None) -> Iterator[None]:
    """Run the block in exactly ``state`` (None: autocast off), whatever is in force.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), in_autocast_state(None):
        ...     torch.ones(2, 2) @ torch.ones(2, 2)
        tensor([[2., 2.],
                [2., 2.]])
    """
    wanted = dict(state or ())
    with contextlib.ExitStack() as stack:
        for device in _DEVICES:
            dtype = wanted.get(device)
            if dtype is not None:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def without_autocast_cache() -> Iterator[None]:
    """Run the block with autocast's weight cache off (for runs on fake tensors).

    Inside an autocast region, autocast keeps the low-precision copy it makes of a
    parameter and hands it to later calls of the region. Made during a run on fake
    tensors, that copy is a fake tensor: every real call after it (batched ones, and
    the user's own eager code) would compute with it and return fake tensors.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), without_autocast_cache():
        ...     torch.is_autocast_cache_enabled()
        False
    """
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)
