"""A shape error found while recording is the error alone: torch logs nothing for it."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import batchgraph as bg
from batchgraph.inference import on_fake_tensors

TORCH_LOG = "failed while attempting to run meta"


def _torch_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    # caplog, not capfd: torch's handler writes to the sys.stderr of when torch was
    # imported (pytest's own capture, at collection), which capfd never sees.
    got = [r.getMessage() for r in caplog.records
           if r.name.startswith("torch") and r.levelno >= logging.ERROR]
    caplog.clear()
    return got


def _fake_mm_error() -> None:
    with pytest.raises(RuntimeError, match="same reduction dim"), FakeTensorMode():
        torch.ones(1, 5) @ torch.ones(3, 2)


def test_a_caught_shape_error_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    # Torch logged the meta kernel's traceback (a dozen ERROR lines) on stderr for
    # every ShapeMismatchError, caught or not.
    lin = bg.batched_func(nn.Linear(3, 2))
    with bg.BatchingPolicy(), pytest.raises(bg.ShapeMismatchError) as info:
        lin(torch.ones(5))
    assert _torch_errors(caplog) == []
    # torch's explanation is in the error itself, and its exception is the cause
    assert "a and b must have same reduction dim, but got [1, 5] X [3, 2]" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_torch_logs_as_before_outside_batchgraphs_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # After a run (and in another thread during one) torch's own fake tensor work
    # logs as it always does: only batchgraph's runs are quiet.
    with pytest.raises(RuntimeError), on_fake_tensors():
        torch.ones(1, 5) @ torch.ones(3, 2)
    assert _torch_errors(caplog) == []
    _fake_mm_error()
    assert any(TORCH_LOG in m for m in _torch_errors(caplog))

    inside, done = threading.Event(), threading.Event()

    def batchgraph_run() -> None:
        with on_fake_tensors():
            inside.set()
            done.wait(10)

    worker = threading.Thread(target=batchgraph_run)
    worker.start()
    try:
        assert inside.wait(10)
        _fake_mm_error()
    finally:
        done.set()
        worker.join()
    assert any(TORCH_LOG in m for m in _torch_errors(caplog))


def test_stderr_of_a_program_that_catches_a_shape_error_is_empty() -> None:
    # What a user sees, without pytest's capture in between: torch's handler writes
    # to the real stderr of a fresh process.
    program = (
        "import torch, batchgraph as bg\n"
        "lin = bg.batched_func(torch.nn.Linear(3, 2))\n"
        "with bg.BatchingPolicy():\n"
        "    try:\n"
        "        lin(torch.ones(5))\n"
        "    except bg.ShapeMismatchError as err:\n"
        "        print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300, check=True)
    assert "same reduction dim" in done.stdout
    assert done.stderr == ""
