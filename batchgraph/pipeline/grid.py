"""The step x device grid printer for schedules.

Rows are time steps of a unit-cost run of the timing engine (every action takes one
step, transfers are free), columns are devices, blank cells are bubbles::

    step  dev0  dev1
       0  0F0
       1  0F1   1F0
       2        1B0
       3  0B0   1F1
       4  0F2   1B1
       ...

A schedule that deadlocks (or is malformed) has no unit-cost timing; it is printed with
one row per list position instead, and a header line says so, so the validator can
still show what it rejected.
"""

from __future__ import annotations

from batchgraph.pipeline.actions import Action, PipelineSchedule
from batchgraph.pipeline.timing import run_engine

__all__ = ["format_schedule"]


def _unit_rows(schedule: PipelineSchedule) -> list[dict[int, Action]] | None:
    """Rows of the unit-cost run, or None when the schedule cannot run to the end."""
    result = run_engine(schedule, lambda _a: 1.0, lambda _a, _b: 0.0)
    if result.blocked:
        return None
    rows: list[dict[int, Action]] = [{} for _ in range(int(result.makespan))]
    for device, actions in schedule.order.items():
        for action in actions:
            start = int(result.times[action][0])
            if device in rows[start]:
                # Only a duplicated action can land twice on one cell; fall back.
                return None
            rows[start][device] = action
    return rows


def format_schedule(schedule: PipelineSchedule) -> str:
    """Draw ``schedule`` as a grid: a column per device, a row per unit time step.

    Args:
        schedule: the schedule to draw (it may be invalid: a schedule that cannot run is
            drawn by list position, and the header says so).

    Returns:
        The grid as text, one line per row, with a header line naming the schedule.

    Example:
        >>> from batchgraph.pipeline import make_schedule
        >>> print(format_schedule(make_schedule("gpipe", stages=2, microbatches=1)))
        gpipe: 2 devices, 2 stages, 1 microbatches (rows: unit-cost time steps)
        step  dev0  dev1
           0  0F0
           1        1F0
           2        1B0
           3  0B0
    """
    devices = sorted(set(range(schedule.devices)) | set(schedule.order))
    rows = _unit_rows(schedule)
    what = "unit-cost time steps"
    if rows is None:
        what = "list positions; the schedule cannot run, so these are not times"
        length = max((len(a) for a in schedule.order.values()), default=0)
        rows = [
            {d: acts[i] for d, acts in schedule.order.items() if i < len(acts)}
            for i in range(length)
        ]
    cells = [str(a) for row in rows for a in row.values()]
    width = max([len(f"dev{d}") for d in devices] + [len(c) for c in cells])
    step_w = max(4, len(str(len(rows))))
    lines = [
        f"{schedule.name}: {schedule.devices} devices, {schedule.stages} stages, "
        f"{schedule.microbatches} microbatches (rows: {what})",
        "step".rjust(step_w) + "".join("  " + f"dev{d}".ljust(width) for d in devices),
    ]
    for i, row in enumerate(rows):
        line = str(i).rjust(step_w) + "".join(
            "  " + (str(row[d]) if d in row else "").ljust(width) for d in devices
        )
        lines.append(line.rstrip())
    return "\n".join(lines)
