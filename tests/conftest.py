"""Shared test setup: seeded RNGs, hypothesis profiles, and skips for missing hardware.

Profiles (pick with HYPOTHESIS_PROFILE): ``ci`` (quick, derandomized, used by .ci/run),
``dev`` (default), ``thorough`` (many examples, for a long local run).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=15,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# One intra-op thread keeps timing-free tests deterministic and cheap on 2 cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_everything() -> None:
    random.seed(0)
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA; none is available here")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
