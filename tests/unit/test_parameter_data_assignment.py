"""``p.data = t`` between recording and compute moves no version counter, only the
parameter's data. The batched calls read the new data where eager calls read the old,
silently; now refused as other parameter changes are. Calls recorded after a compute
read the new data, as eagerly. Calls equal to ones an earlier compute computed with
grad are computed anew, not merged with those: a backward since may have freed their
graphs ("backward through the graph a second time"), and `p.data -= lr * p.grad`
may have changed the weights without a trace."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


def _model() -> tuple[nn.Linear, bg.BatchedFunc]:
    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    return lin, bg.batched_func(lin)


def test_data_assigned_before_compute_is_refused() -> None:
    lin, site = _model()
    with bg.BatchingPolicy():
        h = site(torch.ones(3, dtype=torch.float64))
        lin.weight.data = lin.weight.data * 2
        with pytest.raises(bg.ParameterChangedError, match=r"`p\.data = t`"):
            bg.compute(h)


def test_data_assigned_to_a_tensor_a_function_reads_is_refused() -> None:
    scale = torch.ones(3)
    site = bg.batched_func(lambda x: x * scale)
    with bg.BatchingPolicy():
        h = site(torch.ones(3))
        scale.data = torch.full((3,), 2.0)
        with pytest.raises(bg.ParameterChangedError):
            bg.compute(h)


def test_calls_recorded_after_a_compute_read_the_new_data() -> None:
    lin, site = _model()
    x = torch.arange(3, dtype=torch.float64)
    with bg.BatchingPolicy():
        first = bg.compute(site(x))
        torch.testing.assert_close(first, lin(x))
        lin.weight.data = lin.weight.data * 2
        second = bg.compute(site(x))
    torch.testing.assert_close(second, lin(x))
    assert not torch.allclose(first, second)


def test_an_unchanged_model_is_not_refused() -> None:
    lin, site = _model()
    xs = [torch.full((3,), float(i), dtype=torch.float64) for i in range(4)]
    with bg.BatchingPolicy():
        got = bg.compute([site(x) for x in xs])
    for g, x in zip(got, xs, strict=True):
        torch.testing.assert_close(g, lin(x))


def test_data_changed_in_place_between_computes_reaches_repeated_calls() -> None:
    # Manual SGD (`p.data -= lr * p.grad`) moves no version counter: a call identical
    # to one computed before it was merged with that one, and read the old weights.
    # (Without grad such calls still merge: decoders' repeated tokens; README.)
    lin, site = _model()
    x = torch.arange(3, dtype=torch.float64)
    with bg.BatchingPolicy():
        first = bg.compute(site(x))
        lin.weight.data -= 1.0
        second = bg.compute(site(x))
        third = bg.compute(site(x.clone()))
    torch.testing.assert_close(second, lin(x))
    torch.testing.assert_close(third, lin(x))
    assert not torch.allclose(first, second)


@given(
    tokens=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5), min_size=2, max_size=4),
)
@settings(max_examples=15, deadline=None)
def test_gradients_accumulate_over_computes_of_a_long_lived_policy(tokens: list[list[int]]) -> None:
    # Repeated tokens in later steps were merged with the earlier steps' calls, whose
    # graphs the earlier backward had freed: "backward through the graph a second time".
    torch.manual_seed(0)
    emb, lin = nn.Embedding(5, 4).double(), nn.Linear(4, 1).double()
    embed, out = bg.batched_func(emb), bg.batched_func(lin)

    def grads() -> list[torch.Tensor]:
        found = [p.grad for p in (*emb.parameters(), *lin.parameters())]
        emb.zero_grad(set_to_none=True)
        lin.zero_grad(set_to_none=True)
        return [g.clone() for g in found if g is not None]

    for step in tokens:
        sum(lin(emb(torch.tensor(t))).sum() for t in step).backward()
    want = grads()
    with bg.BatchingPolicy():
        for step in tokens:
            values = bg.compute([out(embed(bg.batched_value(t))) for t in step])
            sum(v.sum() for v in values).backward()
    got = grads()
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
