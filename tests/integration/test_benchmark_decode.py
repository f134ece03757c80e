"""Smoke test of ``benchmarks/decode.py``: every variant decodes the same sequences, the
table and the JSON come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.benchmark_scripts import load_benchmark


@pytest.mark.parametrize("overlap", ["auto", "parallel"])
def test_decode_benchmark_runs_every_variant_and_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    overlap: str,
) -> None:
    module = load_benchmark("decode", monkeypatch)
    out = tmp_path / "decode.json"
    threads = torch.get_num_threads()
    try:  # main() checks, in float64, that every variant decodes what eager decodes
        module.main(["--sizes", "tiny", "--counts", "6", "--reps", "1", "--max-len", "6",
                     "--overlap", overlap, "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    [row] = json.loads(out.read_text())["rows"]
    assert set(row["seconds"]) == {"eager", "hand", "hand2", "floor", "coro1", "coro2"}
    # float32 agreement is reported, not required: a near-tie may round either way.
    assert row["agree_float32"].endswith("/6") and row["floor_vs_hand"] > 0 and row["hand2_vs_hand"] > 0
    assert f"coro2 overlap {overlap}" in capsys.readouterr().out


def test_the_floor_driver_decodes_what_the_hand_batched_decoder_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = load_benchmark("decode", monkeypatch)
    torch.manual_seed(3)
    model = module.Decoder(9, 4, 5).double()
    states = torch.randn(7, 5, dtype=torch.float64)  # with seed 3: lengths 0, 1 and 8
    with torch.no_grad():
        hand = module.hand_batched(model, states, 8)
        floor = module.floor_driver(model, states, 8)
    assert floor == hand
    assert len({len(seq) for seq in hand}) > 1, "examples should end at different lengths"
