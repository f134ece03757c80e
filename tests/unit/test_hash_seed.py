"""Batched results and schedules do not depend on ``PYTHONHASHSEED`` (nor on the
process): the order of launches, the nodes of each and their rows, and every value
bit for bit are the same in each run of ``hash_seed_program``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).with_name("hash_seed_program.py")


def _run(hash_seed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-W", "ignore", str(PROGRAM)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_schedules_and_values_are_the_same_under_each_hash_seed() -> None:
    runs = {seed: _run(seed) for seed in ("0", "1", "4", "5")}
    first = runs["0"]
    assert "VmapKey" in first and len(first.splitlines()) > 40  # it printed a schedule
    for seed, out in runs.items():
        differing = [i for i, (a, b) in enumerate(zip(first.splitlines(), out.splitlines()))
                     if a != b]
        assert out == first, f"PYTHONHASHSEED={seed}: lines {differing[:10]} differ from seed 0"
