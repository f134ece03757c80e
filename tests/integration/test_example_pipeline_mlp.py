"""``examples/pipeline_mlp.py`` under torchrun, as the README runs it, with tiny settings.

The only example that needs several processes; run here as ``python -m
torch.distributed.run`` (what the ``torchrun`` script runs) on a free port.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pipeline_mlp.py"
TINY = ["--steps", "2", "--batch", "16", "--width", "16", "--depth", "4", "--microbatches", "4"]


def _torchrun(tmp_path: Path) -> str:
    """Run the example on 2 processes; returns what they printed."""
    png = tmp_path / "timeline.png"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(EXAMPLE),
        *TINY,
        "--png",
        str(png),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"
    return done.stdout


def test_pipeline_mlp_trains_and_rank0_prints_stats(tmp_path: Path) -> None:
    # The README's command (2 processes, 1F1B); other schedules and replicas are the
    # pipeline tests' business, and each torchrun costs ~20 s on a loaded 2-core host.
    out = _torchrun(tmp_path)
    losses = [float(x) for x in re.findall(r"step +\d+  loss ([\d.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], out  # one replica prints, SGD descends
    assert "1f1b, 2 stages x 1 replicas, m=4" in out
    assert re.search(r"^ +all .*makespan [\d.]+ s$", out, re.M), out
    assert f"timeline: {tmp_path / 'timeline.png'}" in out
