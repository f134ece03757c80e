"""Policies raise the collector's threshold while they work and always restore it."""

from __future__ import annotations

import gc

import pytest
import torch

import batchgraph as bg


def test_thresholds_restored_after_nesting_and_errors() -> None:
    before = gc.get_threshold()
    with bg.BatchingPolicy() as outer:
        assert gc.get_threshold()[0] >= 50_000
        h = bg.batched_value(torch.ones(2)) * 2
        with pytest.raises(RuntimeError, match="boom"), bg.BatchingPolicy():
            raise RuntimeError("boom")
        assert gc.get_threshold()[0] >= 50_000  # the outer policy is still recording
    assert gc.get_threshold() == before
    outer.compute(h)
    assert gc.get_threshold() == before
