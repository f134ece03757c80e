"""Smoke test of the README demo, ``examples/treelstm.py``, with tiny settings."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "treelstm.py"


def test_demo_trains_and_reports_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    # In-process (not a subprocess) so the stdlib parse cached by other tests is reused.
    spec = importlib.util.spec_from_file_location("treelstm_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--limit", "40", "--epochs", "1", "--hidden", "8", "--batch-size", "8",
                 "--timing-batches", "1"])
    out = capsys.readouterr().out
    assert "32 train, 8 test" in out
    epoch = re.search(r"epoch 1: loss/tree ([\d.]+)  train acc ([\d.]+)  test acc ([\d.]+)", out)
    assert epoch is not None, out
    assert float(epoch.group(1)) > 0 and 0 <= float(epoch.group(3)) <= 1
    speedup = re.search(r"speed-up\s*:\s*([\d.]+)x", out)
    assert speedup is not None and float(speedup.group(1)) > 0, out
