"""Launch and byte counts of the executor's gathers (in the style of tinygrad's
kernel-count tests).

Results stay right whether a batched input is passed as a view of the stored value
or copied out of it first, so only counts catch a gather that copies what it could
view. ``GatherCopies`` counts the copying ops (``index_select``, ``cat``, ``stack``,
``index``) that ``batchgraph/executor.py`` issues itself, with the bytes each writes:
the calls' own ops run from ``keys.py`` and below, handing values out from
``graph.py``, so neither is counted.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import batchgraph as bg
from batchgraph import executor
from batchgraph.testing import assert_batched_matches_eager
from tests.property.models import TreeModel
from tests.unit.test_scheduling import _fixed_trees

COPYING = frozenset({"index_select", "cat", "stack", "index"})
_EXECUTOR = executor.__file__
_TORCH = torch.__file__.rsplit("/", 1)[0]


class GatherCopies(TorchDispatchMode):
    """Counts the copying ops the executor makes, and the bytes they write, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in COPYING and self._from_executor():
            self.launches[name] += 1
            self.bytes[name] += out.numel() * out.element_size()
        return out

    @staticmethod
    def _from_executor() -> bool:
        # The first frame outside torch is the code that issued the op (tensor
        # methods and torch functions are C, so they add no frame of their own).
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
            frame = frame.f_back
        return frame is not None and frame.f_code.co_filename == _EXECUTOR


class Chain(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4).double()
        self.second = torch.nn.Linear(4, 4).double()

    def forward(self, x: torch.Tensor) -> Any:
        return self.second(torch.tanh(self.first(x)))


def test_a_chain_of_calls_over_a_batch_passes_each_output_on_as_is() -> None:
    # Every call takes all rows of the step before, in order: no gather copies a row.
    model = Chain()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(8)]
    with GatherCopies() as counts:
        report = assert_batched_matches_eager(model, xs, rtol=1e-12, atol=1e-12)
    assert report.stats is not None and report.stats.launches == 3
    assert counts.launches == {}


def test_a_treelstm_batch_gathers_each_level_with_one_cat_and_one_select() -> None:
    # The 32 fixed trees of the pinned launch counts: 20 distinct leaves, 8 levels of
    # BinaryCell calls (91, 67, 45, 29, 20, 15, 7, 3 nodes), 32 roots. The embedding
    # and the leaf cell take the step before whole (views); each cell level and the
    # output layer gather with one cat of their sources (the carried rows, the level
    # before's h and c) and one index_select of the rows they need and carry.
    model = TreeModel()
    with GatherCopies() as counts:
        report = assert_batched_matches_eager(model.logits, _fixed_trees(32, seed=7))
    assert report.stats is not None and report.stats.launches == 11
    assert counts.launches == {"cat": 9, "index_select": 9}
    cell_inputs, roots, carried = 4 * (91 + 67 + 45 + 29 + 20 + 15 + 7 + 3), 32, 462
    row = 6 * 4  # float32
    assert counts.bytes == {"cat": 1056 * row,
                            "index_select": (cell_inputs + roots + carried) * row}
