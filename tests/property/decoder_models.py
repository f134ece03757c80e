"""A small GRU decoder written as coroutine examples (float64), shared by the coroutine tests."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph import releasing
from tests.releaser_slack import forgetting_every


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


class TokenModel(nn.Module):
    """Token embeddings and a linear map (float64), for programs of recorded calls on
    small token ids: identical calls merge across examples and steps."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = bg.batched_func(nn.Embedding(3, 4).double())
        self.lin = bg.batched_func(nn.Linear(4, 4).double())

    async def run(self, program: list[tuple[str, int]]) -> list[float]:
        """One example: the values it reads while running ``program``."""
        raise NotImplementedError

    def assert_reads_equal_eager(
        self, batch: list[list[tuple[str, int]]], groups: int, forget_every_step: bool = False
    ) -> None:
        """Every value each program reads under ``run_all`` equals its eager run
        (``forget_every_step``: released nodes are forgotten after every step, not
        only once a long run has noted thousands)."""
        slack = 0 if forget_every_step else releasing.FORGET_SLACK
        with torch.no_grad(), forgetting_every(slack):
            eager = [run_eagerly(self.run(p)) for p in batch]
            got = bg.run_all([self.run(p) for p in batch], groups=groups, overlap="inline")
        assert len(got) == len(eager)
        for g, e in zip(got, eager):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def programs(ops: tuple[str, ...], steps: int) -> st.SearchStrategy[list[list[tuple[str, int]]]]:
    """Up to five examples' programs: lists of (operation, argument) pairs."""
    op = st.tuples(st.sampled_from(ops), st.integers(0, 7))
    return st.lists(st.lists(op, min_size=1, max_size=steps), min_size=1, max_size=5)


def make_decoder(seed: int, vocab: int = 12, dim: int = 6) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(vocab, dim).double()
