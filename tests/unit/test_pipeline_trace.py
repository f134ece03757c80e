"""Timeline exports: Chrome/Perfetto JSON and the PNG timeline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from batchgraph.pipeline import (
    Action,
    ActionCosts,
    TimelineEvent,
    draw_timeline,
    make_schedule,
    simulate,
    to_chrome_trace,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_chrome_trace_structure() -> None:
    events = [
        TimelineEvent(0, Action.parse("0F0"), 0.0, 1.0),
        TimelineEvent(1, Action.parse("1I0"), 1.5, 2.0),
    ]
    trace = to_chrome_trace(events, scale=1e6, name="demo")
    assert trace["displayTimeUnit"] == "ms"
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert meta[0] == {
        "name": "process_name",
        "ph": "M",
        "pid": 0,
        "tid": 0,
        "args": {"name": "demo"},
    }
    assert [m["args"]["name"] for m in meta[1:]] == ["device 0", "device 1"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans[1] == {
        "name": "1I0",
        "cat": "I",
        "ph": "X",
        "ts": 1.5e6,
        "dur": 0.5e6,
        "pid": 0,
        "tid": 1,
        "args": {"stage": 1, "kind": "I", "microbatch": 0},
    }


def test_write_chrome_trace_from_simulation(tmp_path: Path) -> None:
    r = simulate(make_schedule("zb-h1", stages=3, microbatches=4), ActionCosts(1, 1, 1, 1))
    path = write_chrome_trace(tmp_path / "sub" / "t.json", r.events, scale=1.0)
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 3 * 4 * 3
    assert {e["cat"] for e in spans} == {"F", "I", "W"}
    assert max(e["ts"] + e["dur"] for e in spans) == r.makespan


def test_draw_timeline_png(tmp_path: Path) -> None:
    r = simulate(make_schedule("interleaved-1f1b", stages=2, microbatches=4, chunks=2))
    path = draw_timeline(r.events, tmp_path / "out" / "t.png", title="demo")
    assert path.read_bytes()[:8] == PNG_MAGIC
    empty = draw_timeline([], tmp_path / "empty.png")
    assert empty.read_bytes()[:8] == PNG_MAGIC


def test_draw_timeline_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import fail as if matplotlib were missing.
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install batchgraph\[viz\]"):
        draw_timeline([], tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
