"""The examples' flags: unusual but valid values run, and values out of range fail as
argparse fails (usage, the flag, exit status 2) instead of with a traceback from inside
the run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("count", [1, 2])
def test_decode_runs_with_fewer_examples_than_it_shows(
    count: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: IndexError after every decode had run, printing the first three sources.
    decode = _load("decode", monkeypatch)
    decode.main(["--examples", str(count), "--hidden", "8", "--max-len", "3", "--beam", "1",
                 "--depth", "0", "--vocab", "3"])
    out = capsys.readouterr().out
    assert out.count("  src ") == count
    assert "batched outputs equal the eager ones (checked)" in out


@pytest.mark.parametrize(
    ("example", "argv", "message"),
    [
        ("decode", ["--examples", "0"], "argument --examples: must be an integer >= 1, got 0"),
        ("decode", ["--vocab", "2"], "argument --vocab: must be an integer >= 3, got 2"),
        ("decode", ["--beam", "0"], "argument --beam: must be an integer >= 1, got 0"),
        ("decode", ["--max-len", "0"], "argument --max-len: must be an integer >= 1, got 0"),
        ("treelstm", ["--batch-size", "0"], "argument --batch-size: must be an integer >= 1"),
        ("treelstm", ["--limit", "0"], "argument --limit: must be an integer >= 1, got 0"),
        ("treelstm", ["--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        ("treelstm", ["--classes", "1"], "argument --classes: must be an integer >= 2, got 1"),
        ("treelstm", ["--timing-batches", "0"], "argument --timing-batches: must be an integer"),
        ("train_treelstm", ["--pool", "0"], "argument --pool: must be an integer >= 1, got 0"),
        ("train_treelstm", ["--workers", "-1"], "argument --workers: must be an integer >= 0"),
    ],
)
def test_values_out_of_range_fail_as_argparse_fails(
    example: str,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = _load(example, monkeypatch)
    with pytest.raises(SystemExit) as exited:
        module.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


def test_pipeline_mlp_refuses_a_bad_count_before_starting_processes() -> None:
    # Parsed before torch.distributed starts, so plain python shows it.
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "pipeline_mlp.py"), "--microbatches", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "argument --microbatches: must be an integer >= 1, got 0" in done.stderr
