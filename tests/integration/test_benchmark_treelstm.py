"""Smoke test of ``benchmarks/treelstm.py``: tiny sizes, every variant (one DataLoader
worker for the workers row), JSON written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "treelstm.py"


def test_benchmark_runs_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("treelstm_benchmark", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class is created.
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
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
