"""Smoke test of ``examples/decode.py`` (greedy, beam search and the grammar-based tree
decoder as coroutine examples), with tiny settings: it checks its own batched outputs
(one group and two) against the eager run and raises if they differ."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "decode.py"


def test_decode_example_runs_and_equals_eager(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("decode_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    module.main(["--examples", "6", "--hidden", "16", "--max-len", "6", "--beam", "2",
                 "--depth", "2"])
    out = capsys.readouterr().out
    assert "batched outputs equal the eager ones (checked)" in out
    for name in ("greedy", "beam", "tree"):
        assert f"\n{name}" in out, out
