"""Smoke test of ``benchmarks/tagger.py``: tiny sizes, every variant, JSON written, and
the check that every variant's loss and gradients equal eager's before timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.benchmark_scripts import load_benchmark


def test_benchmark_runs_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load_benchmark("tagger", monkeypatch)
    out_file = tmp_path / "tagger.json"
    module.main(["--batch-sizes", "6", "--batches", "1", "--rounds", "1", "--vocab", "50",
                 "--embed", "8", "--hidden", "8", "--mlp", "4", "--max-len", "12",
                 "--out", str(out_file)])
    printed = capsys.readouterr().out
    assert "intra-op threads 1" in printed
    result = json.loads(out_file.read_text())
    rows = result["rows"]
    assert {(r["mode"], r["variant"]) for r in rows} == {
        (m, v) for m in ("inference", "training") for v in ("eager", "hand", "agenda", "depth")
    }
    assert result["max_relative_diff"] <= 1e-5
    for r in rows:
        assert r["sentences_per_s"] > 0
        if r["variant"] in ("agenda", "depth"):
            assert r["launches"] >= r["lower_bound"] > 0


def test_hand_batched_scores_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # The ceiling must compute what the per-sentence code does, word for word, in the
    # batch's sentence order (it sorts by length and reverses for the backward chain).
    import torch

    module = load_benchmark("tagger", monkeypatch)
    batch = module.sentences(7, vocab=30, seed=3, max_len=40)
    assert len({len(s.words) for s in batch}) > 3  # lengths differ
    model = module.Tagger(30, 6, 5, 4).double()
    eager = torch.stack([s for sent in batch for s in model.logits(sent.words)])
    hand = module.hand_logits(model, batch)
    torch.testing.assert_close(hand, eager, rtol=1e-12, atol=1e-12)
