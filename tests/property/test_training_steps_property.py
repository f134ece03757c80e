"""Training under batchgraph follows eager training, step after step.

The same model trained eagerly (one tree at a time) and batched, for several optimizer
steps over random trees: parameters equal after every step, in float64. Varied: the
optimizer (SGD with momentum, Adam foreach or fused, AdamW), gradient accumulation over
several policies before a step, gradient clipping, ``zero_grad(set_to_none=...)``, an
output layer tied to the embedding, and a hook on a parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.data.trees import Tree
from batchgraph.models.treelstm import TreeLSTMClassifier

VOCAB = 8

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, foreach=False),
}


def _model(tied: bool) -> TreeLSTMClassifier:
    """A TreeLSTM whose root predicts a token, through the embedding's weights if tied."""
    model = TreeLSTMClassifier(VOCAB, VOCAB, hidden=4)
    if tied:
        model.out.weight = model.embed.weight
    return model


nested = st.recursive(st.integers(0, VOCAB - 1), lambda kids: st.tuples(kids, kids),
                      max_leaves=6)
batches = st.lists(st.lists(nested, min_size=1, max_size=4), min_size=1, max_size=3)


def _loss(logits: list[torch.Tensor], trees: list[Any]) -> torch.Tensor:
    targets = torch.tensor([_first_token(t) for t in trees])
    return F.cross_entropy(torch.stack(logits), targets)


def _first_token(tree: Any) -> int:
    return tree if isinstance(tree, int) else _first_token(tree[1])


@settings(deadline=None, max_examples=25)
@given(seed=st.integers(0, 2**16), steps=st.lists(batches, min_size=1, max_size=3),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)), tied=st.booleans(),
       clip=st.sampled_from([None, 0.05, 10.0]), to_none=st.booleans(), hook=st.booleans())
def test_parameters_after_each_step_equal_eager_training(
    seed: int, steps: list[list[list[Any]]], optimizer: str, tied: bool,
    clip: float | None, to_none: bool, hook: bool,
) -> None:
    torch.manual_seed(seed)
    eager = _model(tied).double()
    model = copy.deepcopy(eager)
    assert (model.out.weight is model.embed.weight) == tied
    opts = [OPTIMIZERS[optimizer](m.parameters()) for m in (eager, model)]
    if hook:  # scales the gradient as it reaches the parameter
        for m in (eager, model):
            m.cell.proj.weight.register_hook(lambda g: g * 0.5)
    for step in steps:
        for opt in opts:
            opt.zero_grad(set_to_none=to_none)
        for chunk in step:  # accumulated over one policy per chunk
            trees = [Tree.from_nested(t) for t in chunk]
            _loss([eager.logits(t) for t in trees], chunk).backward()
            with bg.BatchingPolicy() as policy:
                handles = [model.logits(t) for t in trees]
            _loss(policy.compute(handles), chunk).backward()
        for m, opt in zip((eager, model), opts, strict=True):
            if clip is not None:
                nn.utils.clip_grad_norm_(m.parameters(), clip)
            opt.step()
        for (name, p), q in zip(eager.named_parameters(), model.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=1e-9, msg=name)
