"""Smoke test of ``benchmarks/recording.py``: every call style records one node, and the
table and the JSON come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import batchgraph as bg
from tests.integration.benchmark_scripts import load_benchmark


def test_recording_benchmark_writes_a_row_per_call_style(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("recording", monkeypatch)
    out = tmp_path / "recording.json"
    threads = torch.get_num_threads()
    try:
        module.main(["--reps", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.read_text())["rows"]
    assert [r["call"] for r in rows] == list(module._styles())
    assert all(r["recorded_ns"] > 0 and r["eager_ns"] > 0 for r in rows)


def test_each_call_style_records_one_node_that_computes_the_eager_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    styles = load_benchmark("recording", monkeypatch)._styles()
    x = torch.randn(8, dtype=torch.float64)
    for name, fn in styles.items():
        with bg.BatchingPolicy() as policy:
            h = bg.batched_value(x)
            before = len(policy.graph)
            out = fn(h)
        assert len(policy.graph) == before + 1, name
        torch.testing.assert_close(bg.compute(out), fn(x))
