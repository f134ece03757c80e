"""``copy.deepcopy`` of a handle is a value of its own, as a tensor's deep copy is.

It returned the handle itself, written when handles never changed; since in-place
calls rebind the handle they change (``h += g``), a deep copy changed in place changed
the original too: ``g = copy.deepcopy(h); g += 1`` left ``h`` at ``[2, 3]`` where
eagerly ``[1, 2]``, silently (a beam search copying its hypotheses, then extending
one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchgraph as bg


def _add(t: Any) -> None:
    t += 1


def _scale(t: Any) -> None:
    t.mul_(3)


def _assign(t: Any) -> None:
    t[0] = -5.0


_CHANGES: dict[str, Callable[[Any], None]] = {"add": _add, "scale": _scale, "assign": _assign}


def _program(h: Any, change: str, changed: str) -> Any:
    """A state copied, one of the two changed in place, both read afterwards; the
    copy's two references stay one tensor, as deepcopy's memo keeps them."""
    state = {"h": h, "again": h}
    copied = copy.deepcopy(state)
    target = copied["h"] if changed == "copy" else state["h"]
    _CHANGES[change](target)
    return state["h"] * 1, copied["h"] * 1, copied["again"] * 1


@settings(max_examples=20, deadline=None)
@given(change=st.sampled_from(sorted(_CHANGES)), changed=st.sampled_from(["copy", "original"]),
       values=st.lists(st.floats(-4, 4, width=32), min_size=2, max_size=4),
       computed_first=st.booleans())
def test_a_deep_copy_changes_apart_from_its_original(
    change: str, changed: str, values: list[float], computed_first: bool
) -> None:
    x = torch.tensor(values)
    # A value handed out refuses an in-place change of its handle: change the copy.
    which = "copy" if computed_first else changed
    eager = _program(x * 1, change, which)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        if computed_first:  # its value handed out already: copied as a tensor
            bg.compute(h)
        recorded = _program(h, change, which)
    for got, want in zip(bg.compute(recorded), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_deep_copy_keeps_the_gradient_path_of_a_value_recorded() -> None:
    x = torch.randn(3, requires_grad=True)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 2
        copied = copy.deepcopy(h)
        out = copied * h
    # Eagerly deepcopy of a non-leaf that requires grad raises; recorded, the copy is
    # the same value, and its gradient reaches x through both factors.
    got = bg.compute(out)
    torch.testing.assert_close(got, (x * 2) ** 2)
    (grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(grad, 8 * x.detach())


def test_a_deep_copy_of_the_tensor_given_to_batched_value_is_a_new_tensor() -> None:
    x = torch.tensor([1.0, 2.0])
    with bg.BatchingPolicy():
        h = bg.batched_value(x)
        copied = copy.deepcopy(h)
        copied += 1  # eagerly a new tensor, changed alone
        out = h * 1
    assert isinstance(copied, torch.Tensor) and copied is not x
    torch.testing.assert_close(bg.compute(out), torch.tensor([1.0, 2.0]), rtol=0, atol=0)
    torch.testing.assert_close(copied, torch.tensor([2.0, 3.0]), rtol=0, atol=0)


def test_a_deep_copy_after_the_block_computes_as_its_original() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)) * 4
    copied = copy.deepcopy([h])
    assert copied[0] is not h
    torch.testing.assert_close(bg.compute(copied)[0], torch.full((2,), 4.0))
    with pytest.raises(bg.PolicyClosedError):
        copied[0] + 1
