"""Comparing schedules as plans: steps, gathers and stores (not the stats of a run)."""

from __future__ import annotations

import batchgraph as bg


def same_schedule(a: bg.Schedule, b: bg.Schedule) -> bool:
    """Whether two schedules run the same steps with the same gathers."""
    return (a.steps, a.base_store, a.scheduler) == (b.steps, b.base_store, b.scheduler)
