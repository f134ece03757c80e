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

# The device types autocast knows (cpu, cuda, xpu, mps, ...), and those of them this
# machine has: reading one device's state costs ~0.5 us, and a call recorded under
# autocast reads them all.
_ALL_DEVICES: tuple[str, ...] = tuple(torch._C._autocast_supported_devices())


def _present(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "mps":
        return bool(torch.backends.mps.is_available())
    is_available = getattr(getattr(torch, device, None), "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else False
    except Exception:  # a backend that cannot tell: not here
        return False


_DEVICES: tuple[str, ...] = tuple(d for d in _ALL_DEVICES if _present(d))

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
    state = _state_of(_DEVICES)
    # On for a device type this machine seemed not to have: look at them all.
    return state if state else _state_of(_ALL_DEVICES)


_enabled_for = torch.is_autocast_enabled
_dtype_for = torch.get_autocast_dtype


def _state_of(devices: tuple[str, ...]) -> AutocastState:
    state = []
    for device in devices:
        if _enabled_for(device):
            state.append((device, _dtype_for(device)))
    return tuple(state)


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
        for device in _ALL_DEVICES:
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
