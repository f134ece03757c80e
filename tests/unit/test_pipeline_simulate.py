"""The simulator: costs (scalar, per stage, transfer), results, and its conventions."""

from __future__ import annotations

import pytest

from batchgraph.pipeline import (
    Action,
    ActionCosts,
    PipelineSchedule,
    ScheduleError,
    TimelineEvent,
    make_schedule,
    simulate,
)


def times(result_times: dict[Action, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    return {str(a): t for a, t in result_times.items()}


def test_default_costs_gpipe_two_stages() -> None:
    r = simulate(make_schedule("gpipe", stages=2, microbatches=1))
    assert times(r.times) == {"0F0": (0, 1), "1F0": (1, 2), "1B0": (2, 4), "0B0": (4, 6)}
    assert r.makespan == 6
    assert r.busy == {0: 3, 1: 3}
    assert r.idle == {0: 3, 1: 3}
    assert r.bubble_time == 6
    assert r.bubble_fraction == pytest.approx(0.5)
    assert r.stage_busy == {0: 3, 1: 3}


def test_transfer_cost_only_across_devices() -> None:
    r = simulate(make_schedule("gpipe", stages=2, microbatches=1), ActionCosts(transfer=0.5))
    assert times(r.times) == {"0F0": (0, 1), "1F0": (1.5, 2.5), "1B0": (2.5, 4.5), "0B0": (5, 7)}
    # One device, two chunks: the dependencies stay on the device, no transfer paid.
    one = simulate(
        make_schedule("interleaved-1f1b", stages=1, microbatches=1, chunks=2),
        ActionCosts(transfer=9),
    )
    assert one.makespan == 6


def test_per_stage_costs_dict_and_callable() -> None:
    s = make_schedule("gpipe", stages=2, microbatches=1)
    r = simulate(s, ActionCosts(forward={1: 4.0}, backward=lambda stage: 1.0 + stage))
    assert times(r.times) == {"0F0": (0, 1), "1F0": (1, 5), "1B0": (5, 7), "0B0": (7, 8)}


def test_slow_stage_sets_the_pace_of_1f1b() -> None:
    # Stage 1 twice as slow (F=2, B=4): after 0F0 it runs 1F0 1F1, waits 1 for 2F0 + 2B0
    # (3) to pass its 1F1 (2), then its other 14 units back to back; 0B2 ends it.
    r = simulate(
        make_schedule("1f1b", stages=3, microbatches=3),
        ActionCosts(forward={1: 2.0}, backward={1: 4.0}),
    )
    assert r.busy[1] == 18
    assert r.times[Action.parse("1B0")] == (6, 10)
    assert r.makespan == 1 + 4 + 1 + 14 + 2


def test_split_backward_costs() -> None:
    r = simulate(make_schedule("zb-h1", stages=1, microbatches=2), ActionCosts(3, 100, 2, 5))
    assert r.makespan == 2 * (3 + 2 + 5)
    assert r.peak_weight_pending == {0: 1}  # W right after I on the first stage


def test_events_match_times_and_are_sorted() -> None:
    r = simulate(make_schedule("zb-h1", stages=3, microbatches=4))
    assert len(r.events) == len(r.times) == 3 * 4 * 3
    assert all(isinstance(e, TimelineEvent) for e in r.events)
    assert [(e.start, e.device) for e in r.events] == sorted((e.start, e.device) for e in r.events)
    for e in r.events:
        assert r.times[e.action] == (e.start, e.end)
        assert r.schedule.device_of(e.action.stage) == e.device


def test_summary_text() -> None:
    text = simulate(make_schedule("1f1b", stages=4, microbatches=8)).summary()
    assert "makespan: 33" in text
    assert "bubble: 0.2727 of device time (idle 36 over 4 devices)" in text
    assert "peak in flight per stage (F done, B/I not): 0: 4, 1: 3, 2: 2, 3: 1" in text
    assert "waiting for W" not in text
    zb = simulate(make_schedule("zb-h1", stages=2, microbatches=4)).summary()
    assert "peak waiting for W per stage (F done, W not): 0: 2, 1: 2" in zb


def test_invalid_schedule_is_rejected_before_simulating() -> None:
    bad = PipelineSchedule("hand", 1, 1, 1, 1, {0: [Action.parse("0F0")]})
    with pytest.raises(ScheduleError, match="missing backward"):
        simulate(bad)


def test_negative_cost_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"ActionCosts.forward for stage 0 is -1.0; costs must be finite and >= 0"
    ):
        simulate(make_schedule("gpipe", stages=1, microbatches=1), ActionCosts(forward=-1))
    # `nan < 0` is False: nan and inf went through and simulated nan makespans.
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="costs must be finite and >= 0"):
            simulate(make_schedule("gpipe", stages=2, microbatches=2),
                     ActionCosts(backward={1: bad}))


def test_parse_costs() -> None:
    assert ActionCosts.parse("1,2,1,1") == ActionCosts(1, 2, 1, 1, 0)
    assert ActionCosts.parse(" 1, 3 ,2,1,0.5") == ActionCosts(1, 3, 2, 1, 0.5)
    for text in ("1,2", "a,b,c,d", "1,2,1,-1", "1,2,1,1,1,1", "nan,1,1,1", "1,inf,1,1"):
        with pytest.raises(
            ValueError, match=r"expected 4 or 5 finite non-negative numbers 'F,B,I,W\[,T\]'"
        ):
            ActionCosts.parse(text)
