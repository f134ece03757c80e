"""A traced model splits at any cut: sizes and shapes are read again after it, and the
items of a layer's tuple cross it, never the tuple.

Before, a cut after ``B, T = idx.size()`` (a GPT's first line, used by its last
``view(B, T, -1)``) sent Python ints to the next stage, and a cut between an LSTM and
the unpacking of its ``(output, (h, c))`` sent a tuple of a tuple: the first step
failed with "stage 0 (Stage0) returned int at output 0; a stage must return a tensor
or a tuple of tensors", at every number of stages that put a cut there.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, partition_graph
from tests.pipeline_models import assert_grads_equal, mlp, reference


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc(self.norm(x))


class TinyGPT(nn.Module):
    """Reads the batch and sequence sizes first and uses them last, as nanoGPT does; an
    LSTM whose tuple is unpacked, and a chunked tensor, in between."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(2))
        self.rnn = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width // 2, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        out, (h, c) = self.rnn(x)
        half = x.shape[-1] // 2
        left, right = out.chunk(2, dim=-1)
        y = (
            left * torch.sigmoid(right)
            + h[-1].unsqueeze(1)[..., :half]
            + c[-1].unsqueeze(1)[..., half:]
        )
        return self.head(y).view(b, t, -1)


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _operations(model: nn.Module) -> int:
    graph = torch.fx.symbolic_trace(model).graph
    return sum(1 for n in graph.nodes if n.op in ("call_module", "call_function", "call_method"))


def test_every_cut_of_the_graph_computes_the_model() -> None:
    torch.manual_seed(0)
    model = TinyGPT().double()
    idx = torch.randint(0, 11, (3, 5))
    want = model(idx)
    for parts in range(1, _operations(model) + 1):
        values: tuple[Tensor, ...] = (idx,)
        for piece in partition_graph(model, parts):
            result = piece(*values)
            values = tuple(result) if isinstance(result, tuple) else (result,)
            assert all(isinstance(v, Tensor) for v in values), (parts, [type(v) for v in values])
        torch.testing.assert_close(values[0], want, msg=lambda m, p=parts: f"{p} parts: {m}")


@settings(max_examples=8, deadline=None)
@given(
    stages=st.integers(2, 6),
    schedule=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    m=st.integers(1, 3),
)
def test_a_traced_gpt_trains_as_on_one_device(stages: int, schedule: str, m: int) -> None:
    torch.manual_seed(stages * 10 + m)
    model = TinyGPT().double()
    idx = torch.randint(0, 11, (4, 5))
    targets = torch.randint(0, 11, (4, 5))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with Pipeline(
        model, stages=stages, microbatches=m, schedule=schedule, loss_fn=_loss, timeout=30
    ) as pipe:
        for _ in range(2):
            want_loss, want = reference(ref, idx, targets, _loss)
            loss = pipe.train_step(idx, targets)
            torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
            assert_grads_equal(model, want)
            for p, g in zip(ref.parameters(), want):
                p.grad = g
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch.testing.assert_close(pipe.forward(idx), ref(idx), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("parts", [2, 3])
def test_a_size_read_in_a_later_part_is_its_microbatch_size(parts: int) -> None:
    # Read again in the later part, the size is that of the microbatch the part runs on.
    class Pairs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp(layers=2, width=6, inputs=4, outputs=6)

        def forward(self, x: Tensor) -> Tensor:
            n = x.size(0)
            return self.body(x).reshape(n, 2, 3).sum(-1)

    model = Pairs()
    x = torch.randn(7, 4, dtype=torch.float64)
    with Pipeline(model, stages=parts, microbatches=3, loss_fn=nn.MSELoss()) as pipe:
        torch.testing.assert_close(pipe.forward(x), model(x))
