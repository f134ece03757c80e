"""A small GRU decoder written as coroutine examples (float64), shared by the coroutine tests."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import torch
from torch import nn

import batchgraph as bg


class Decoder(bg.BatchedModule):
    """Greedy decoding from a start state; each example stops at its own stop token."""

    def __init__(self, vocab: int = 12, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.cell = nn.GRUCell(dim, dim)
        self.out = nn.Linear(dim, vocab)

    async def greedy(self, h: Any, stop: int, max_len: int) -> list[int]:
        tokens: list[int] = []
        tok = 0
        for _ in range(max_len):
            h = self.cell(self.embed(bg.batched_value(tok)), h)
            tok = int((await bg.value(self.out(h))).argmax())
            if tok == stop:
                break
            tokens.append(tok)
        return tokens

    async def greedy_with_state(self, h: Any, stop: int, max_len: int) -> tuple[list[int], Any]:
        """Like ``greedy`` but also returns the final state as an unawaited handle."""
        tokens: list[int] = []
        tok = 0
        for _ in range(max_len):
            h = self.cell(self.embed(bg.batched_value(tok)), h)
            tok = int(await bg.value(self.out(h).argmax()))  # argmax batched too
            if tok == stop:
                break
            tokens.append(tok)
        return tokens, h


def run_eagerly(coro: Coroutine[Any, Any, Any]) -> Any:
    """The trivial driver: outside a policy every await finishes at once."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("an eager coroutine example suspended")


def make_decoder(seed: int, vocab: int = 12, dim: int = 6) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(vocab, dim).double()
