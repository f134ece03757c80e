"""Smoke test of ``benchmarks/workers.py --quick``: every table, JSON written, one loader pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.multiprocess


def test_workers_benchmark_runs_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("workers", monkeypatch)
    out = tmp_path / "workers.json"
    result = module.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    hand, in_process, workers = result["throughput"]
    # Same weights, data and order: the three paths train to the same loss.
    assert hand["final_loss"] == pytest.approx(workers["final_loss"], rel=1e-5)
    assert in_process["final_loss"] == workers["final_loss"]
    waits = workers["wait_ms"]
    assert waits["fill"] is not None and waits["prefetched"] is not None
    assert set(workers["ms_per_batch"]) == {"wait-for-worker", "bind", "execute", "backward+step"}
    assert [row["pool"] for row in result["bucketing"]] == ["1", "8", "None"]
    assert result["cache"]["hit_rate_first_epoch"] == 0.0
    assert result["cache"]["hit_rate_repeated_epoch"] == 1.0
