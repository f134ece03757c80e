"""torch's attention modules called on handles directly (not inside a BatchedModule):
their forwards ask ``query.is_nested`` first, which a handle did not answer
(AttributeError: "ResultHandle has no attribute 'is_nested'"), so
``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` could not be recorded at all.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

D = 8


def _models() -> dict[str, tuple[nn.Module, Callable[[nn.Module, torch.Tensor], torch.Tensor]]]:
    torch.manual_seed(0)
    return {
        "mha": (nn.MultiheadAttention(D, 2, batch_first=True),
                lambda m, x: m(x, x, x, need_weights=False)[0]),
        "mha-weights": (nn.MultiheadAttention(D, 2, batch_first=True),
                        lambda m, x: m(x, x * 2, x)[1]),
        "encoder": (nn.TransformerEncoderLayer(D, 2, 16, dropout=0.0, batch_first=True),
                    lambda m, x: m(x)),
        "decoder": (nn.TransformerDecoderLayer(D, 2, 16, dropout=0.0, batch_first=True),
                    lambda m, x: m(x, x.tanh())),
    }


MODELS = sorted(_models())


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(MODELS), lengths=st.lists(st.integers(1, 4), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_attention_modules_on_handles_equal_eager(name: str, lengths: list[int], seed: int) -> None:
    model, call = _models()[name]
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, n, D, generator=gen, requires_grad=True) for n in lengths]
    want = [call(model, x) for x in xs]
    sum((w * (i + 1)).sum() for i, w in enumerate(want)).backward()
    want_grads = [x.grad for x in xs] + [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    xb = [x.detach().clone().requires_grad_() for x in xs]
    with bg.BatchingPolicy() as policy:
        got = bg.compute([call(model, bg.batched_value(x)) for x in xb])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    sum((g * (i + 1)).sum() for i, g in enumerate(got)).backward()
    got_grads = [x.grad for x in xb] + [p.grad for p in model.parameters()]
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    if len(lengths) > 1 and len(set(lengths)) == 1:  # one signature: batched, not per example
        alone = bg.BatchingPolicy()
        with alone:
            bg.compute(call(model, bg.batched_value(xs[0].detach())))
        assert policy.stats.launches == alone.stats.launches


def test_a_handle_answers_is_nested_and_layout_as_a_dense_tensor() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.zeros(2, 3)) * 1
        assert (h.is_nested, h.is_sparse, h.layout) == (False, False, torch.strided)
