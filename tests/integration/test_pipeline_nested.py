"""A stage whose forward runs another pipeline (a pipeline inside a pipeline).

A stage of code not torch.nn's runs its first step holding the CPU generator's lock
(batchgraph.pipeline.rng), and the inner pipeline's stages, on threads of their own,
waited for that lock while the outer stage waited for their step: it hung, under every
schedule. An inner step now gives its stages a lock of their own, and trains as one
device. The job runs in a process of its own: a hang leaves the lock held for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def test_a_pipeline_inside_a_stage_trains_as_one_device() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.integration.nested_pipeline_job"],
                              cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError("a pipeline inside a pipeline's stage hung (120 s)") from None
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = json.loads(done.stdout)
    assert len(gaps) == 8 and all(gap < 1e-10 for gap in gaps.values()), gaps
