"""Tests that make the releaser forget released nodes sooner than it does by default."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import batchgraph as bg

__all__ = ["forgetting_every"]


@contextmanager
def forgetting_every(slack: int) -> Iterator[None]:
    """Releasers made inside this block forget what nothing can reach after ``slack``
    more nodes or notes (0: at every compute).

    Patched in the module the policies' releaser class comes from: pytest's doctest
    collection imports another copy of ``batchgraph.releasing``, which policies do not
    use, and patching that copy would leave the default in force, silently.
    """
    where = type(bg.BatchingPolicy().releaser).step.__globals__
    with mock.patch.dict(where, {"FORGET_SLACK": slack}):
        yield
