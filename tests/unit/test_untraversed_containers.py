"""bg.compute and bg.value take handles out of lists, tuples, dicts and dataclasses; a
set, frozenset or deque that holds a handle is refused, instead of coming back with the
handle not computed (silently: the caller got a handle where it expected a tensor)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


@pytest.mark.parametrize(
    ("wrap", "kind"),
    [
        (lambda h: {h}, "set"),
        (lambda h: frozenset([h]), "frozenset"),
        (lambda h: collections.deque([h]), "deque"),
        (lambda h: [1, {"k": collections.deque([torch.ones(1), h])}], "deque"),
    ],
)
def test_compute_refuses_a_container_it_would_hand_back_uncomputed(wrap: Any, kind: str) -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)) * 2
    with pytest.raises(TypeError, match=rf"a {kind} holds <ResultHandle .*put the handles "
                       r"in a list or tuple instead"):
        bg.compute(wrap(h))


def test_such_containers_without_handles_pass_unchanged() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)) * 2
    ones = collections.deque([torch.ones(1)])
    got = bg.compute([h, {1, 2}, ones])
    torch.testing.assert_close(got[0], torch.full((2,), 2.0))
    assert got[1] == {1, 2} and got[2] is ones


def test_awaiting_or_returning_a_set_of_handles_is_refused() -> None:
    square = bg.batched_func(torch.square)

    async def awaits(x: torch.Tensor) -> Any:
        return await bg.value([{square(x)}])

    async def returns(x: torch.Tensor) -> Any:
        return {square(x)}

    with pytest.raises(bg.CoroutineExampleError) as caught:  # raised at its await
        bg.run_all([awaits(torch.ones(2))])
    assert isinstance(caught.value.__cause__, TypeError)
    assert "a set holds <ResultHandle" in str(caught.value.__cause__)
    # Its result is resolved by the driver once every example finished.
    with pytest.raises(TypeError, match=r"a set holds <ResultHandle"):
        bg.run_all([returns(torch.ones(2))])


def test_export_refuses_a_set_of_handles() -> None:
    # Before: exported with the handles inside, failing only when pickled for the main
    # process ("cannot be pickled: ... Pickle computed tensors").
    model = nn.Sequential(nn.Linear(2, 2))
    with bg.BatchingPolicy() as policy:
        outputs = [{bg.batched_func(model[0])(torch.ones(2))}]
    with pytest.raises(TypeError, match=r"a set holds <ResultHandle"):
        bg.export(policy, outputs, model)


@pytest.mark.parametrize("wrap", [
    lambda hs: (h for h in hs), lambda hs: map(lambda h: h, hs), lambda hs: zip(hs),
    lambda hs: {"out": (h * 2 for h in hs)},
])
def test_a_generator_of_handles_is_refused_not_handed_back(wrap: Any) -> None:
    # bg.compute(h for h in hs) gave the generator back: iterating it gave handles.
    with bg.BatchingPolicy() as policy:
        hs = [bg.batched_value(torch.ones(2)) * i for i in range(3)]
        for compute in (bg.compute, policy.compute):
            with pytest.raises(TypeError, match=r"cannot look into it without using it up"):
                compute([hs[0], wrap(hs)])
            if not isinstance(wrap(hs), dict):
                with pytest.raises(TypeError, match=r"make it a list first"):
                    compute(wrap(hs))
