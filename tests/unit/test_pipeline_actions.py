"""The schedule IR: compact strings, parsing, and device/stage bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchgraph.pipeline import Action, ActionKind, PipelineSchedule, make_schedule


def test_str_and_parse_round_trip() -> None:
    a = Action(2, ActionKind.FORWARD, 0)
    assert str(a) == "2F0"
    assert repr(a) == "Action(2F0)"
    assert Action.parse("2F0") == a
    assert Action.parse(" 12W31 ") == Action(12, ActionKind.BACKWARD_WEIGHT, 31)
    assert str(ActionKind.BACKWARD_INPUT) == "I"


@given(st.integers(0, 999), st.sampled_from(list(ActionKind)), st.integers(0, 999))
def test_round_trip_any(stage: int, kind: ActionKind, mb: int) -> None:
    a = Action(stage, kind, mb)
    assert Action.parse(str(a)) == a


@pytest.mark.parametrize("text", ["", "2X0", "F0", "2F", "-1F0", "2 F 0"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"cannot parse action .*expected '<stage><F\|B\|I\|W>"):
        Action.parse(text)


def test_device_and_stage_mapping() -> None:
    s = make_schedule("interleaved-1f1b", stages=3, microbatches=3, chunks=2)
    assert (s.stages, s.devices, s.chunks) == (6, 3, 2)
    assert [s.device_of(k) for k in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.stages_of(1) == [1, 4]
    assert all(s.device_of(a.stage) == d for d, acts in s.order.items() for a in acts)


def test_split_backward_flag() -> None:
    assert make_schedule("zb-h1", stages=2, microbatches=2).split_backward
    assert not make_schedule("1f1b", stages=2, microbatches=2).split_backward
    assert not PipelineSchedule("empty", 1, 1, 1, 1).split_backward
