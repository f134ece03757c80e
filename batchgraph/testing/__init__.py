"""Helpers for users' own tests: batched-vs-eager checks and hypothesis strategies.

``assert_batched_matches_eager`` needs only torch; the strategies in
``batchgraph.testing.strategies`` need ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

from batchgraph.testing.check import BatchedCheckReport, assert_batched_matches_eager

__all__ = ["BatchedCheckReport", "assert_batched_matches_eager"]
