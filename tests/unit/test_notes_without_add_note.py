"""Notes on errors where ``add_note`` is missing, as on Python 3.10 (which we support).

There is no 3.10 interpreter here. On 3.10 looking up ``err.add_note`` raises
``AttributeError``; a property raising exactly that on PolicyMismatchError recreates
the lookup failure for batchgraph's own error type on 3.11+, which is all the code
under test touches. mypy (``python_version = "3.10"`` in pyproject) covers the rest.
"""

from __future__ import annotations

import traceback
from typing import Any, NoReturn

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.notes import add_note


def _missing(self: BaseException) -> NoReturn:
    raise AttributeError(f"{type(self).__name__!r} object has no attribute 'add_note'")


@pytest.fixture
def no_add_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bg.PolicyMismatchError, "add_note", property(_missing), raising=False)
    assert not hasattr(bg.PolicyMismatchError("x"), "add_note")


@pytest.mark.usefixtures("no_add_note")
def test_notes_go_where_add_note_puts_them_and_tracebacks_show_them() -> None:
    err = bg.PolicyMismatchError("handles of two policies")
    add_note(err, "first")
    add_note(err, "second")
    assert err.__notes__ == ["first", "second"]
    assert str(err) == "handles of two policies" and err.args == ("handles of two policies",)
    # The same list 3.11's traceback prints: the fallback stores notes, not a look-alike.
    assert "second" in "".join(traceback.format_exception(err))


def test_a_note_that_cannot_be_written_leaves_the_error_as_it_was() -> None:
    err = ValueError("bad width")
    err.__notes__ = "not a list"  # type: ignore[assignment,unused-ignore]
    add_note(err, "ignored")  # add_note itself would raise TypeError here
    assert err.__notes__ == "not a list"


@pytest.mark.usefixtures("no_add_note")
def test_an_example_failing_with_a_note_fails_alone_without_add_note() -> None:
    # Python 3.10: run_all raised AttributeError ('add_note') instead of returning
    # each example's PolicyMismatchError, so every other example's result was lost.
    lin = bg.batched_func(nn.Linear(2, 2))
    cache: dict[int, Any] = {}

    async def shares_a_cache(i: int) -> Any:  # combines handles of another group
        if i % 2 not in cache:
            cache[i % 2] = lin(torch.full((2,), float(i % 2)))
        return await bg.value(lin(cache[i % 2]))

    got = bg.run_all([shares_a_cache(i) for i in range(4)], groups=2,
                     return_exceptions=True)
    assert all(isinstance(g, torch.Tensor) for g in got[:2])
    for err in got[2:]:
        assert isinstance(err, bg.PolicyMismatchError)
        assert any("group of run_all(groups=k)" in n for n in err.__notes__)

    shared: list[Any] = []

    async def awaits_another_group(i: int) -> Any:
        if i == 0:
            shared.append(lin(torch.ones(2)))
        return await bg.value(shared[0])

    got = bg.run_all([awaits_another_group(i) for i in range(2)], groups=2,
                     return_exceptions=True)
    assert isinstance(got[0], torch.Tensor)
    assert isinstance(got[1], bg.PolicyMismatchError)
    assert any("records into a policy of its own" in n for n in got[1].__notes__)
