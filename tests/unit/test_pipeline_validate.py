"""The validator: each broken invariant is named, with the actions and the grid."""

from __future__ import annotations

import pytest

from batchgraph.pipeline import (
    Action,
    ActionKind,
    PipelineSchedule,
    ScheduleError,
    format_schedule,
    make_schedule,
    validate_schedule,
)


def sched(
    order: dict[int, str], stages: int | None = None, microbatches: int = 1
) -> PipelineSchedule:
    """A one-chunk schedule from ``{device: "0F0 0B0 ..."}``."""
    parsed = {d: [Action.parse(t) for t in text.split()] for d, text in order.items()}
    devices = len(order)
    return PipelineSchedule("hand", stages or devices, devices, microbatches, 1, parsed)


def test_valid_hand_schedule_passes() -> None:
    validate_schedule(sched({0: "0F0 0B0"}))
    validate_schedule(sched({0: "0F0 0I0 0W0"}))
    validate_schedule(sched({0: "0F0 0F1 0B1 0B0", 1: "1F0 1F1 1B1 1B0"}, microbatches=2))


def test_schedule_error_is_a_value_error() -> None:
    assert issubclass(ScheduleError, ValueError)


@pytest.mark.parametrize(
    ("order", "microbatches", "match"),
    [
        ({0: "0F0 0B0", 1: "1B0"}, 1, r"missing forward: 1F0 never runs"),
        ({0: "0F0 0F0 0B0"}, 1, r"duplicate action: 0F0 appears 2 times"),
        (
            {0: "0F0 0B0 1F0", 1: "1B0"},
            1,
            r"wrong device: 1F0 is on device 0, but stage 1 belongs to device 1",
        ),
        ({0: "0F0"}, 1, r"missing backward: neither 0B0 nor 0I0 \+ 0W0 runs"),
        ({0: "0F0 0B0 0I0 0W0"}, 1, r"both backwards: 0B0 and 0I0 both run"),
        ({0: "0F0 0I0"}, 1, r"split backward incomplete: 0I0 runs but 0W0 never does"),
        ({0: "0F0 0W0"}, 1, r"split backward incomplete: 0W0 runs but 0I0 never does"),
        (
            {0: "0F0 0W0 0I0"},
            1,
            r"order on device 0: 0W0 \(position 1\) must come after 0I0 \(position 2\)",
        ),
        ({0: "0B0 0F0"}, 1, r"order on device 0: 0B0 \(position 0\) must come after 0F0"),
        ({0: "0F0 0B0 0F3 0B3"}, 2, r"microbatch 3 is out of range 0..1"),
        ({0: "0F0 0B0 5F0 5B0"}, 1, r"5F0 on device 0: stage 5 is out of range 0..0"),
    ],
)
def test_broken_invariants(order: dict[int, str], microbatches: int, match: str) -> None:
    schedule = sched(order, microbatches=microbatches)
    with pytest.raises(ScheduleError, match=match) as info:
        validate_schedule(schedule)
    assert "invalid schedule 'hand'" in str(info.value)
    assert format_schedule(schedule) in str(info.value)  # the grid is part of the message


def test_same_device_stage_order_with_one_device_interleaved() -> None:
    # p = 1, v = 2: stages 0 and 1 share device 0, so F order is checked statically.
    bad = PipelineSchedule(
        "hand", 2, 1, 1, 2, {0: [Action.parse(t) for t in ("1F0", "0F0", "1B0", "0B0")]}
    )
    with pytest.raises(ScheduleError, match=r"1F0 \(position 0\) must come after 0F0"):
        validate_schedule(bad)


def test_cross_device_deadlock_names_blocked_heads() -> None:
    # Each list is fine on its own, but device 1 wants microbatch 1 first while device 0
    # will only send it after the backward of microbatch 0, which device 1 has not run.
    schedule = sched({0: "0F0 0B0 0F1 0B1", 1: "1F1 1F0 1B0 1B1"}, microbatches=2)
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate_schedule(schedule)
    text = str(info.value)
    assert "device 0 is stuck at 0B0, waiting for 1B0" in text
    assert "device 1 is stuck at 1F1, waiting for 0F1" in text
    assert "list positions; the schedule cannot run" in text


def test_in_flight_limit() -> None:
    gpipe = make_schedule("gpipe", stages=2, microbatches=4)
    with pytest.raises(
        ScheduleError, match=r"too many in flight: stage 0 holds 4 microbatches .* limit 2"
    ):
        validate_schedule(gpipe, max_in_flight=2)
    validate_schedule(make_schedule("1f1b", stages=2, microbatches=4), max_in_flight=2)
    validate_schedule(gpipe, max_in_flight={1: 4})
    with pytest.raises(ScheduleError, match="stage 1 holds 4"):
        validate_schedule(gpipe, max_in_flight={1: 3})


def test_inconsistent_shape() -> None:
    bad = PipelineSchedule("hand", 3, 2, 1, 1, {})
    with pytest.raises(ScheduleError, match=r"stages=3 must equal devices\*chunks=2\*1"):
        validate_schedule(bad)
    with pytest.raises(ScheduleError, match=r"device 2 is out of range 0\.\.1"):
        validate_schedule(sched({0: "0F0 0B0", 2: "1F0 1B0"}, stages=2))


def test_make_schedule_rejects_bad_arguments() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown schedule 'pipedream'; choose one of gpipe, 1f1b, interleaved-1f1b, zb-h1, sync",
    ):
        make_schedule("pipedream", stages=2, microbatches=2)
    with pytest.raises(
        ValueError, match=r"gpipe runs one stage per device, so chunks must be 1 \(got chunks=2\)"
    ):
        make_schedule("gpipe", stages=2, microbatches=2, chunks=2)
    with pytest.raises(ValueError, match=r"1f1b: stages must be an int >= 1, got 0"):
        make_schedule("1f1b", stages=0, microbatches=2)
    with pytest.raises(ValueError, match=r"zb-h1: microbatches must be an int >= 1, got -1"):
        make_schedule("zb-h1", stages=2, microbatches=-1)
    with pytest.raises(ValueError, match=r"interleaved-1f1b: chunks must be an int >= 1, got 0"):
        make_schedule("interleaved-1f1b", stages=2, microbatches=2, chunks=0)
    assert make_schedule("ZB_H1", stages=1, microbatches=1).name == "zb-h1"


def test_grid_printout() -> None:
    text = format_schedule(make_schedule("gpipe", stages=2, microbatches=1))
    assert text.splitlines() == [
        "gpipe: 2 devices, 2 stages, 1 microbatches (rows: unit-cost time steps)",
        "step  dev0  dev1",
        "   0  0F0",
        "   1        1F0",
        "   2        1B0",
        "   3  0B0",
    ]


def _typed(order: dict[object, object], **counts: object) -> PipelineSchedule:
    shape: dict[str, object] = {"stages": 2, "devices": 2, "microbatches": 1, "chunks": 1}
    shape.update(counts)
    return PipelineSchedule("hand", order=order, **shape)  # type: ignore[arg-type]


_GOOD = {
    0: [Action.parse("0F0"), Action.parse("0B0")],
    1: [Action.parse("1F0"), Action.parse("1B0")],
}


@pytest.mark.parametrize(
    ("order", "counts", "match"),
    [
        (
            {0: ["0F0", "0B0"], 1: _GOOD[1]},
            {},
            r"order\[0\]\[0\] is '0F0' \(str\), not an Action .*; write Action.parse\('0F0'\)",
        ),
        ({"0": _GOOD[0], 1: _GOOD[1]}, {}, r"order's key '0' is a str; the keys are device"),
        ({0: _GOOD[0], 1: "1F0 1B0"}, {}, r"order\[1\] is a str; give a list of the device's"),
        (
            {0: [Action(0, "F", 0), _GOOD[0][1]], 1: _GOOD[1]},  # type: ignore[arg-type]
            {},
            r"order\[0\]\[0\] is Action\(stage=0, kind='F', microbatch=0\), not an Action of an int "
            r"stage, an ActionKind",
        ),
        (
            {0: [Action(0.0, ActionKind.FORWARD, 0)], 1: _GOOD[1]},  # type: ignore[arg-type]
            {},
            r"order\[0\]\[0\] is Action\(stage=0.0, kind=<ActionKind.FORWARD: 'F'>",
        ),
        ({}, {"stages": 0, "devices": 0}, r"stages must be an int >= 1, got 0"),
        (_GOOD, {"microbatches": 1.0}, r"microbatches must be an int >= 1, got 1.0"),
    ],
)
def test_malformed_schedules_are_named(
    order: dict[object, object], counts: dict[str, object], match: str
) -> None:
    # They failed inside the checks (AttributeError: 'str' object has no attribute
    # 'stage'; TypeError comparing a str key with 0) or passed (no stages, no actions).
    with pytest.raises(ScheduleError, match=match) as info:
        validate_schedule(_typed(order, **counts))
    assert str(info.value).startswith("invalid schedule 'hand': ")
    validate_schedule(_typed(_GOOD))  # the same shape, well typed, is valid
