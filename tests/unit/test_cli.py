"""The `batchgraph` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchgraph.cli import main


def test_schedule_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, trace = tmp_path / "out.png", tmp_path / "out.json"
    argv = ["schedule", "1f1b", "--stages", "4", "--microbatches", "8"]
    assert main([*argv, "--png", str(png), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1f1b: 4 devices, 4 stages, 8 microbatches (rows: unit-cost time steps)")
    assert "   3  0F3   1F2   2F1   3F0" in out
    assert "makespan: 33" in out
    assert "bubble: 0.2727" in out
    assert "peak in flight per stage (F done, B/I not): 0: 4, 1: 3, 2: 2, 3: 1" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]) == 64


def test_costs_and_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "zb-h1", "-p", "4", "-m", "8", "--costs", "1,1,1,1"]) == 0
    out = capsys.readouterr().out
    assert "makespan: 27" in out  # 3m + p - 1
    assert "peak waiting for W per stage" in out
    assert main(["schedule", "interleaved-1f1b", "-p", "2", "-m", "4", "-v", "2"]) == 0
    assert "2 devices, 4 stages, 4 microbatches" in capsys.readouterr().out


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "gpipe", "--chunks", "2"]) == 2
    assert "chunks must be 1" in capsys.readouterr().err
    assert main(["schedule", "1f1b", "--costs", "1,2"]) == 2
    assert "expected 4 or 5 finite non-negative numbers" in capsys.readouterr().err
    assert main(["schedule", "pipedream"]) == 2
    assert "invalid choice: 'pipedream'" in capsys.readouterr().err
    assert main([]) == 2
    assert "schedule" in capsys.readouterr().out


def test_python_dash_m() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "batchgraph", "schedule", "gpipe", "-p", "2", "-m", "1"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "   3  0B0" in done.stdout


@pytest.mark.parametrize("costs", ["nan,1,1,1", "1,inf,1,1", "1,2,1,1,nan"])
def test_costs_that_are_not_finite_are_refused(
    costs: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: accepted, and the simulation printed nan makespans and bubbles, status 0.
    assert main(["schedule", "1f1b", "-p", "2", "-m", "2", "--costs", costs]) == 2
    captured = capsys.readouterr()
    assert f"costs {costs!r}: expected 4 or 5 finite non-negative numbers" in captured.err
    assert captured.out == ""


def test_output_paths_that_cannot_be_written_say_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a traceback (a file where a folder should be), or, for a folder given as
    # the PNG, a picture written beside it as <folder>.png, reported as the folder.
    assert main(["schedule", "1f1b", "-p", "2", "-m", "2", "--png", str(tmp_path)]) == 2
    assert f"--png {str(tmp_path)!r} is a folder; name the file to write in it" in (
        capsys.readouterr().err
    )
    assert not Path(f"{tmp_path}.png").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    for option in ("--trace", "--png"):
        target = blocker / "out"
        assert main(["schedule", "1f1b", "-p", "2", "-m", "2", option, str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("batchgraph schedule: error: cannot write ") and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-p", "0"], "argument -p/--stages: must be an integer >= 1, got 0"),
        (["--microbatches", "-3"], "argument -m/--microbatches: must be an integer >= 1, got -3"),
        (["-v", "two"], "argument -v/--chunks: must be an integer >= 1, got 'two'"),
    ],
)
def test_counts_out_of_range_name_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "stages must be an int >= 1, got 0; pass the number of devices as
    # stages= ...", the Python keyword, which the command does not take.
    assert main(["schedule", "gpipe", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "usage: batchgraph schedule" in err


def test_main_returns_the_status_instead_of_raising(capsys: pytest.CaptureFixture[str]) -> None:
    # main()'s docstring promises an exit status; argparse's exits escaped as SystemExit.
    assert main(["--help"]) == 0
    assert "schedule" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "invalid choice: 'bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("costs", ["-1,2,1,1", "-.5,1,1,1"])
def test_negative_costs_reach_the_costs_check(costs: str, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse took "-1,2,1,1" for an option: "argument --costs: expected one argument".
    assert main(["schedule", "1f1b", "-p", "2", "-m", "2", "--costs", costs]) == 2
    assert f"costs {costs!r}: expected 4 or 5 finite non-negative numbers" in capsys.readouterr().err
