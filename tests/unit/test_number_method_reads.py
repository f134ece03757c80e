"""A count read by control flow through the number's own methods and properties.

Before: ``number_reads``' watching numbers inherited ``int.bit_length``,
``float.is_integer``, ``.real``, ``.numerator`` and the like from ``int`` and
``float``, which read the plain value without noting it, so a count read only
through one of them (``self.n += 1; if self.n.bit_length() > 2: return lin(x) * 2``)
looked like a count nothing reads: its calls batched, every call of a batch took the
branch the first recorded runs took, and the count counted batches (outputs off from
the fourth call on, silently). Now these read the number too, and such calls run one
at a time in recorded order, as the comparisons' reads do.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_forward_caches import Holder, Keeping, runs_alike


class BitLength(Keeping):
    """Calls 4.. take the other branch, read through ``int.bit_length``."""

    def fresh(self) -> dict[str, Any]:
        return {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.lin(x) * 2 if self.n.bit_length() > 2 else self.lin(x)


class WholeQuarter(Keeping):
    """Every fourth call takes the other branch, read through ``float.is_integer``."""

    def fresh(self) -> dict[str, Any]:
        return {"t": 0.0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t = self.t + 0.25
        return self.lin(x) - 1 if self.t.is_integer() else self.lin(x)


class RealPart(Keeping):
    """Calls 4.. take the other branch, read through the ``real`` property."""

    def fresh(self) -> dict[str, Any]:
        return {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.lin(x) * 3 if self.n.real > 3 else self.lin(x)


class Numerator(Keeping):
    """Calls 4.. take the other branch, read through ``as_integer_ratio``."""

    def fresh(self) -> dict[str, Any]:
        return {"n": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        top, _ = self.n.as_integer_ratio()
        return self.lin(x) + 1 if top in (4, 5, 6, 7, 8) else self.lin(x)


@pytest.mark.parametrize("entry", ["stub", "method", "function"])
@pytest.mark.parametrize("pattern", [BitLength, WholeQuarter, RealPart, Numerator],
                         ids=lambda p: p.__name__)
@settings(max_examples=3, deadline=None)
@given(lengths=st.lists(st.integers(1, 3), min_size=4, max_size=7), seed=st.integers(0, 99))
def test_a_count_read_through_its_own_methods_computes_as_eagerly(
        entry: str, pattern: type[Keeping], lengths: list[int], seed: int) -> None:
    torch.manual_seed(seed)
    eager = Holder(pattern()).double()
    model = copy.deepcopy(eager)
    xs = [torch.randn(n, 4, dtype=torch.float64) for n in lengths]
    runs_alike(model, eager, entry, xs, "state")  # values, gradients, the count left


def test_the_watching_numbers_answer_their_methods_as_the_plain_numbers() -> None:
    from batchgraph.number_reads import _watch

    noted: set[Any] = set()
    n, t = _watch(12, frozenset({"n"}), noted), _watch(2.5, frozenset({"t"}), noted)
    got = (n.bit_length(), n.bit_count(), n.real, n.imag, n.numerator, n.denominator,
           n.to_bytes(2, "little"), n.as_integer_ratio(), n.conjugate(),
           t.is_integer(), t.hex(), t.real, t.imag, t.as_integer_ratio())
    want = (4, 2, 12, 0, 12, 1, b"\x0c\x00", (12, 1), 12,
            False, (2.5).hex(), 2.5, 0.0, (5, 2))
    assert got == want
    assert all(type(g) is type(w) for g, w in zip(got, want, strict=True))
    assert noted == {"n", "t"}
