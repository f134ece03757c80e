"""Computing the calls a randomized record/change/compute sequence left pending."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchgraph as bg


def compute_pending(
    policy: bg.BatchingPolicy, pending: list[tuple[Any, ...]], refused: type[Exception] | None
) -> None:
    """Compute ``pending`` ``(handle, eager value, ...)`` tuples: expect ``refused``
    raised when given (``pending`` is left as it was, the calls still waiting), else
    each eager value (and ``pending`` is emptied)."""
    handles = [p[0] for p in pending]
    if refused is not None:
        with pytest.raises(refused):
            policy.compute(handles)
        return
    for got, p in zip(policy.compute(handles), pending, strict=True):
        torch.testing.assert_close(got, p[1])
    pending.clear()
