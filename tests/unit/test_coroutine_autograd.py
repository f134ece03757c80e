"""Autograd inside coroutine examples: values of one batched step share one graph."""

from __future__ import annotations

import torch
from torch import nn

import batchgraph as bg
from tests.property.decoder_models import run_eagerly

torch.manual_seed(0)
_lin = bg.batched_func(nn.Linear(4, 4).double())
_XS = [torch.randn(4, dtype=torch.float64) for _ in range(3)]


async def _input_gradient(i: int, retain: bool) -> torch.Tensor:
    w = torch.ones(4, dtype=torch.float64, requires_grad=True)
    v = await bg.value(_lin(_XS[i] * w))
    (g,) = torch.autograd.grad(v.sum(), w, retain_graph=retain)
    return g


def test_an_example_freeing_the_shared_graph_is_explained() -> None:
    """Eagerly each example backpropagates through its own graph once. Batched, the
    first one's ``autograd.grad`` frees the step's graph for all: the others failed
    with torch's "Trying to backward through the graph a second time", though none
    did; now the error says why, and what to do."""
    got = bg.run_all([_input_gradient(i, retain=False) for i in range(3)],
                     return_exceptions=True)
    assert isinstance(got[0], torch.Tensor)
    for err in got[1:]:
        assert isinstance(err, RuntimeError) and "graph a second time" in str(err)
        assert any("share one autograd graph" in note and "retain_graph=True" in note
                   for note in err.__notes__)
    eager = [run_eagerly(_input_gradient(i, retain=False)) for i in range(3)]
    got = bg.run_all([_input_gradient(i, retain=True) for i in range(3)])
    for have, want in zip(got, eager):
        torch.testing.assert_close(have, want)
