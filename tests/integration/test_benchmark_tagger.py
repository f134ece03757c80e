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
                 "--embed", "8", "--hidden", "8", "--mlp", "4", "--max-len", "30",
                 "--out", str(out_file)])
    printed = capsys.readouterr().out
    assert "intra-op threads 1" in printed
    result = json.loads(out_file.read_text())
    rows = result["rows"]
    variants = ("eager", "hand", "agenda", "depth",
                "seq-eager", "seq-hand", "seq-default", "seq-rows")
    assert {(r["mode"], r["variant"]) for r in rows} == {
        (m, v) for m in ("inference", "training") for v in variants
    }
    assert result["max_relative_diff"] <= 1e-5
    for r in rows:
        assert r["sentences_per_s"] > 0
        if r["variant"] in ("agenda", "depth", "seq-default", "seq-rows"):
            assert r["launches"] >= r["lower_bound"] > 0
        if r["variant"] == "seq-rows":  # embedding, packed LSTM, MLP: one launch each
            assert r["launches"] == 3
    # Lengths 3 to 30 here: the default keys batch the embedding and the MLP per length.
    default = next(r for r in rows if r["variant"] == "seq-default")
    lengths = len({len(s.words) for s in module.sentences(6, 50, seed=6, max_len=30)})
    assert lengths > 1 and default["launches"] == 2 * lengths + 1


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


def test_sequence_level_variants_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    # SeqTagger's hand-batched ceiling and its row-wise batchgraph run compute what the
    # per-sentence code does, in the batch's sentence order, gradients included.
    module = load_benchmark("tagger", monkeypatch)
    batch = module.sentences(7, vocab=30, seed=3, max_len=40)
    names = ("seq-eager", "seq-hand", "seq-default", "seq-rows")
    variants = module.make_variants(30, 6, 5, 4, names)
    for v in variants:
        v.model.double()
    assert module.check_equal(variants, batch, tol=1e-12) <= 1e-12
    assert variants[3].last is not None and variants[3].last.launches == 3
