"""Pipeline-parallel training: schedules as data, a validator, a simulator and runtimes."""

from __future__ import annotations

# Schedules as data: IR, generators, grid printer, validator, simulator, timelines.
from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule
from batchgraph.pipeline.grid import format_schedule
from batchgraph.pipeline.schedules import (
    SCHEDULE_NAMES,
    gpipe_schedule,
    interleaved_1f1b_schedule,
    make_schedule,
    one_f_one_b_schedule,
    sync_schedule,
    zb_h1_schedule,
)
from batchgraph.pipeline.simulate import ActionCosts, SimulationResult, simulate
from batchgraph.pipeline.trace import (
    TimelineEvent,
    draw_timeline,
    to_chrome_trace,
    write_chrome_trace,
)
from batchgraph.pipeline.validate import ScheduleError, validate_schedule

__all__: list[str] = [
    # schedules as data
    "SCHEDULE_NAMES",
    "Action",
    "ActionCosts",
    "ActionKind",
    "PipelineSchedule",
    "ScheduleError",
    "SimulationResult",
    "TimelineEvent",
    "draw_timeline",
    "format_schedule",
    "gpipe_schedule",
    "interleaved_1f1b_schedule",
    "make_schedule",
    "one_f_one_b_schedule",
    "simulate",
    "sync_schedule",
    "to_chrome_trace",
    "validate_schedule",
    "write_chrome_trace",
    "zb_h1_schedule",
]
