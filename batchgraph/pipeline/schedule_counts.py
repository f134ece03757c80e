"""The counts a pipeline takes from a :class:`PipelineSchedule` given as data.

A schedule object fixes the pipeline's devices, microbatches and chunks; counts passed
next to it may only repeat them. Both runtimes (``Pipeline`` on threads and
``DistributedPipeline`` on ranks) read them here, so a count that contradicts the
schedule is refused with the same words everywhere, instead of being ignored.
"""

from __future__ import annotations

from batchgraph.pipeline.actions import PipelineSchedule
from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["schedule_counts"]


def schedule_counts(
    schedule: str | PipelineSchedule,
    stages: int | None,
    microbatches: int | None,
    chunks: int | None,
) -> tuple[int | None, int, int]:
    """``(stages, microbatches, chunks)``: as given, else 1 (``stages``: inferred later),
    else a :class:`PipelineSchedule`'s own, which a value given must equal.

    Raises:
        PipelineConfigError: a count given differs from the schedule's; names both.

    Example:
        >>> from batchgraph.pipeline.schedules import make_schedule
        >>> schedule_counts(make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=3),
        ...                 None, None, None)
        (2, 4, 3)
        >>> schedule_counts("1f1b", None, None, None)
        (None, 1, 1)
    """
    if not isinstance(schedule, PipelineSchedule):
        return stages, 1 if microbatches is None else microbatches, 1 if chunks is None else chunks
    own = {
        "stages": schedule.devices,
        "microbatches": schedule.microbatches,
        "chunks": schedule.chunks,
    }
    given = {"stages": stages, "microbatches": microbatches, "chunks": chunks}
    for name, value in given.items():
        if value is not None and value != own[name]:
            word = "devices" if name == "stages" else name
            raise PipelineConfigError(
                f"{name}={value!r} was passed with schedule {schedule.name!r}, which has "
                f"{word}={own[name]}: leave {name}= out (the schedule gives it), or build "
                f"the schedule for {name}={value!r}"
            )
    return own["stages"], own["microbatches"], own["chunks"]
