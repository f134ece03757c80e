"""Coroutine decoding equals the eager per-example run, over random weights, lengths, stops."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import batchgraph as bg
from tests.property.decoder_models import make_decoder, run_eagerly

examples = st.lists(
    st.tuples(st.integers(0, 2**16), st.integers(-1, 11), st.integers(0, 12)),
    min_size=1,
    max_size=9,
)


@given(
    seed=st.integers(0, 2**16),
    batch=examples,
    groups=st.integers(1, 3),
    overlap=st.sampled_from(["auto", "inline", "thread", "parallel"]),
)
def test_greedy_decoding_equals_eager(
    seed: int, batch: list[tuple[int, int, int]], groups: int, overlap: str
) -> None:
    model = make_decoder(seed)
    states = [
        torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        for s, _, _ in batch
    ]
    eager = [run_eagerly(model.greedy(h, stop, n)) for h, (_, stop, n) in zip(states, batch)]
    got = bg.run_all(
        [model.greedy(h, stop, n) for h, (_, stop, n) in zip(states, batch)],
        groups=groups,
        overlap=overlap,
    )
    assert got == eager


@given(seed=st.integers(0, 2**16), batch=examples)
def test_final_states_and_batched_argmax_equal_eager(
    seed: int, batch: list[tuple[int, int, int]]
) -> None:
    model = make_decoder(seed)
    states = [
        torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
        for s, _, _ in batch
    ]
    coros = [model.greedy_with_state(h, stop, n) for h, (_, stop, n) in zip(states, batch)]
    for (tokens, state), h, (_, stop, n) in zip(bg.run_all(coros), states, batch):
        want_tokens, want_state = run_eagerly(model.greedy_with_state(h, stop, n))
        assert tokens == want_tokens
        if isinstance(want_state, torch.Tensor):
            torch.testing.assert_close(state, want_state, rtol=0, atol=1e-10)
        else:  # max_len 0: the start state comes back untouched
            assert state is h
