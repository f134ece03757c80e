"""Smoke test of ``benchmarks/treelstm.py``: tiny sizes, every variant (one DataLoader
worker for the workers row), JSON written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.benchmark_scripts import load_benchmark


def test_benchmark_runs_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("treelstm", monkeypatch)
    out_file = tmp_path / "treelstm.json"
    module.main(["--datasets", "sst", "--batch-sizes", "4", "--rounds", "1",
                 "--trees-per-round", "4", "--hidden", "8", "--sst-vocab", "50",
                 "--out", str(out_file)])
    printed = capsys.readouterr().out
    assert "torch" in printed and "intra-op thread" in printed
    result = json.loads(out_file.read_text())
    rows = result["rows"]
    assert {(r["mode"], r["variant"]) for r in rows} == {
        (m, v) for m in ("inference", "training")
        for v in ("eager", "hand", "agenda", "depth", "workers")
    }
    assert result["loss_max_relative_diff"] <= 1e-5
    for r in rows:
        assert r["trees_per_s"] > 0
        if r["variant"] in ("agenda", "depth"):
            assert r["launches"] >= r["lower_bound"] > 0
            assert r["record_schedule_us_per_node"] > 0
    assert next(r for r in rows if r["variant"] == "eager")["vs_eager"] == 1.0
