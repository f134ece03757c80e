"""A deep copy of a handle is a value of its own for views too, as a tensor's is.

``copy.deepcopy(h)`` gave a twin handle of ``h``'s value (39e3381), which shared the
value's views: changing the copy in place was taken as changing the original's views
(``s = h[0]; g = copy.deepcopy(h); g += 1; s * 2`` refused as "shares memory eagerly",
where eagerly ``g`` shares nothing), a copy of a view was refused any change in place
("would change in place a view of another value"), and a view of the original computed
together with both (``y, gg, s = bg.compute((h, g, h[0]))``) was handed out as a copy,
so ``y.add_(100)`` left it, silently. A deep copy now records a clone.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import batchgraph as bg


def _program(h: Any, compute: Any, view_of: str, view_first: bool, changed: str,
             together: bool) -> tuple[Any, ...]:
    """Copy ``h`` (or, ``view_of`` "view", a view of it) before or after taking a view
    (of the copy where ``view_of`` is "copy"), change ``changed`` in place, then read
    all three; ``together``: hand the three out at once and change ``changed``'s tensor
    after, outside recording."""
    if view_first:
        v = h[1]
        g = copy.deepcopy(v if view_of == "view" else h)
    else:
        g = copy.deepcopy(h)
        v = (g if view_of == "copy" else h)[1]
        if view_of == "view":
            g = copy.deepcopy(v)
    target = {"original": h, "copy": g}[changed]
    if together:
        got = compute((h, g, v))
        {"original": got[0], "copy": got[1]}[changed].add_(100)
        return (*got, got[2] * 2)
    target.add_(100)
    return compute((h * 1, g * 1, v * 2))


@settings(max_examples=60, deadline=None)
@given(view_of=st.sampled_from(["original", "copy", "view"]), view_first=st.booleans(),
       changed=st.sampled_from(["original", "copy"]), together=st.booleans(),
       examples=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_a_deep_copy_shares_no_view_with_its_original(
        view_of: str, view_first: bool, changed: str, together: bool, examples: int,
        seed: int) -> None:
    viewed = "copy" if view_of == "copy" and not view_first else "original"
    # A view read after its own value changed in place is refused (README), copy or not.
    assume(together or changed != viewed)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 4, generator=gen) for _ in range(examples)]
    want = [_program(x * 1, lambda t: t, view_of, view_first, changed, together) for x in xs]
    with bg.BatchingPolicy():
        got = [_program(bg.batched_value(x) * 1, bg.compute, view_of, view_first, changed,
                        together) for x in xs]
    for w, g in zip(want, got, strict=True):
        for a, b in zip(w, g, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_copies_of_one_value_batch_as_one_call() -> None:
    xs = [torch.randn(4) for _ in range(6)]
    with bg.BatchingPolicy() as policy:
        copies = [copy.deepcopy(bg.batched_value(x) * 2) for x in xs]
        got = bg.compute(copies)
    for x, g in zip(xs, got, strict=True):
        torch.testing.assert_close(g, x * 2)
    assert policy.stats.launches <= 2  # the product and the clones: one call each
