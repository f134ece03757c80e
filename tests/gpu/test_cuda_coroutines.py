"""Coroutine examples on CUDA: equal to eager, with lanes taking turns inline (skipped without CUDA)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import batchgraph as bg
from batchgraph.stepping import Lane
from tests.property.decoder_models import Decoder, run_eagerly

pytestmark = pytest.mark.gpu


class CudaDecoder(Decoder):
    """Greedy decoding on the GPU; the chosen token crosses to the host once per batch."""

    async def greedy(self, h: Any, stop: int, max_len: int) -> list[int]:
        tokens: list[int] = []
        tok = 0
        for _ in range(max_len):
            token = bg.batched_value(tok, device=self.out.weight.device)
            h = self.cell(self.embed(token), h)
            tok = int(await bg.value(self.out(h).argmax().cpu()))
            if tok == stop:
                break
            tokens.append(tok)
        return tokens


@pytest.mark.parametrize(("groups", "overlap"), [(1, "auto"), (2, "auto"), (3, "inline"),
                                                 (2, "thread")])
def test_decoding_on_cuda_equals_eager(groups: int, overlap: str) -> None:
    torch.manual_seed(0)
    model = CudaDecoder().double().cuda()
    states = [torch.randn(6, dtype=torch.float64, device="cuda") for _ in range(9)]
    free = [run_eagerly(model.greedy(h, -1, 8)) for h in states]
    stops = [seq[i % len(seq)] for i, seq in enumerate(free)]
    eager = [run_eagerly(model.greedy(h, s, 8)) for h, s in zip(states, stops)]
    got = bg.run_all([model.greedy(h, s, 8) for h, s in zip(states, stops)], groups=groups,
                     overlap=overlap)
    assert got == eager


def test_a_lane_that_records_cuda_tensors_takes_turns_inline() -> None:
    lane = Lane(bg.BatchingPolicy(), [])
    with lane.policy:
        bg.batched_func(torch.tanh)(torch.zeros(3, device="cuda"))
    assert lane.records_on_cuda()
