"""bg.value, bg.compute and run_all give back a dict subclass as the kind it was:
a defaultdict keeps its default_factory, an OrderedDict its order."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, defaultdict
from typing import Any

import pytest
import torch

import batchgraph as bg

X = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def _kinds(value: Any) -> list[dict[str, Any]]:
    return [defaultdict(list, b=value, a=2), OrderedDict(b=value, a=2), Counter(b=value)]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_await_and_compute_rebuild_dict_subclasses(which: int) -> None:
    # A defaultdict was rebuilt as defaultdict(items), which takes the items for its
    # default_factory: "first argument must be callable or None".
    double = bg.batched_func(torch.mul)

    async def example() -> Any:
        return await bg.value(_kinds(double(X, 2.0))[which])

    want = _kinds(X * 2)[which]
    for got in (bg.run_all([example()])[0], asyncio.run(example())):
        assert type(got) is type(want) and list(got) == list(want)
        torch.testing.assert_close(got["b"], want["b"])
    with bg.BatchingPolicy():
        handle = double(X, 2.0)
    got = bg.compute(_kinds(handle)[which])
    assert type(got) is type(want) and list(got) == list(want)
    if isinstance(got, defaultdict):
        assert got.default_factory is list and got["missing"] == []
