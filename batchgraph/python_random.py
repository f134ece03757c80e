"""Draws from Python's ``random`` and NumPy's global generator in a recorded callable.

A batched call runs the callable's Python once for the whole batch (vmap, a stacking
rule), so a number it draws there (``if self.training and random.random() < p: return
x``, a LayerDrop inside a module; ``x + float(np.random.randn())``) would be one draw
for every example, and identical calls would be merged into one, where eagerly each
call draws its own. torch's own random ops are seen by their dispatch tags
(``rules.RandomDraws``); these generators are not torch's, so the runs on fake tensors
note whether their states moved (``inference.on_fake_tensors``), and a call
signature whose run moved one runs one call at a time and is never merged.

The states are compared, not put back: another thread may draw meanwhile (an
``AsyncBatcher`` example sampling on the event loop while a step computes), and
putting a state back would hand its numbers out twice. So a fake run does consume the
draws it makes, as eager code's first call of the signature would.
"""

from __future__ import annotations

import random
import sys
import threading
from typing import Any

__all__ = ["drawn_count", "note_if_drawn", "rng_states"]

_LOCAL = threading.local()


def rng_states() -> tuple[Any, ...]:
    """The states of Python's ``random`` and, where NumPy is imported, of its global
    generator (the position in its key is enough to see a draw).

    Example:
        >>> before = rng_states()
        >>> _ = random.random()
        >>> rng_states() != before
        True
    """
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return (random.getstate(),)
    state = numpy.random.get_state()
    return (random.getstate(), state[2], state[3], state[4], state[1].tobytes())


def note_if_drawn(before: tuple[Any, ...]) -> None:
    """Count a draw on this thread where the states moved since ``before``."""
    if rng_states() != before:
        _LOCAL.drawn = drawn_count() + 1


def drawn_count() -> int:
    """How many runs on fake tensors on this thread drew from Python's or NumPy's
    generator: a resolve that moved it found a callable drawing its own numbers.

    Example:
        >>> before = drawn_count()
        >>> note_if_drawn(rng_states())
        >>> drawn_count() == before
        True
    """
    count: int = getattr(_LOCAL, "drawn", 0)
    return count
