"""Coroutine runs release each step's values once nothing can read them.

A long decode must not hold every step's outputs (memory growing with steps), and
whatever an example can still read must stay: handles it holds, handles a later
merge revives, and inputs of nodes nobody awaited yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.graph import STORE_SHIFT
from tests.property.decoder_models import run_eagerly
from tests.releaser_slack import forgetting_every

WIDE = 256  # per-example output width of a "logits" call: what must not pile up


def _held(policy: bg.BatchingPolicy) -> tuple[int, int]:
    """Stores still held and their bytes."""
    stores = [s for s in policy.graph.stores if s]
    size = sum(t.numel() * t.element_size() for s in stores for t in s
               if isinstance(t, torch.Tensor))
    return len(stores), size


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cell = bg.batched_func(nn.Linear(8, 8).double())
        self.out = bg.batched_func(nn.Linear(8, WIDE).double())

    async def decode(self, h: Any, steps: int) -> list[int]:
        tokens = []
        for _ in range(steps):
            h = torch.tanh(self.cell(h)) if isinstance(h, torch.Tensor) else self.cell(h).tanh()
            tokens.append(int((await bg.value(self.out(h))).argmax()))
        return tokens


def _policies() -> tuple[list[bg.BatchingPolicy], Any]:
    made: list[bg.BatchingPolicy] = []

    def make() -> bg.BatchingPolicy:
        made.append(bg.BatchingPolicy())
        return made[-1]

    return made, make


@pytest.mark.parametrize("groups", [1, 2])
def test_a_long_decode_holds_a_few_steps_of_values_not_all_of_them(groups: int) -> None:
    model = _Decoder()
    states = [torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
              for i in range(5)]
    made, make = _policies()
    steps = 60
    with torch.no_grad():
        got = bg.run_all([model.decode(h, steps) for h in states], groups=groups,
                         make_policy=make, overlap="inline")
        assert got == [run_eagerly(model.decode(h, steps)) for h in states]
    for policy in made:
        held, size = _held(policy)
        assert policy.computes == steps
        # Each step makes three stores (cell, tanh, out); the last step's stay (the
        # examples held them when it ended), older ones are gone.
        assert held <= 6, f"{held} of {len(policy.graph.stores)} stores still held"
        assert size < 3 * len(states) * WIDE * 8
        assert not policy.graph.constants  # computed constants are not kept either


def test_a_handle_held_across_many_steps_stays_readable_and_recordable() -> None:
    lin = bg.batched_func(nn.Linear(4, 4).double())

    async def example(x: torch.Tensor) -> tuple[list[float], torch.Tensor]:
        memory = lin(x)  # like an encoder's output, read at every step
        seen = []
        h = x
        for _ in range(12):
            h = lin(h)
            seen.append(float((await bg.value(h + memory)).sum()))
        return seen, await bg.value(memory)

    xs = [torch.randn(4, dtype=torch.float64) for _ in range(3)]
    with torch.no_grad():
        got = bg.run_all([example(x) for x in xs])
        want = [run_eagerly(example(x)) for x in xs]
    for (seen, memory), (seen_eager, memory_eager) in zip(got, want):
        assert seen == pytest.approx(seen_eager)
        assert torch.allclose(memory, memory_eager)


def test_repeated_calls_merge_across_steps_and_a_released_one_is_recorded_anew() -> None:
    embed = bg.batched_func(nn.Embedding(5, 3).double())
    scale = bg.batched_func(torch.mul)

    async def example(tokens: list[int]) -> list[float]:
        out = []
        for i, t in enumerate(tokens):
            e = embed(bg.batched_value(t))  # may merge with an earlier step's node
            tick = float(await bg.value(scale(bg.batched_value(float(i)), 1.5)))
            # e is read only after that step: a merged node must still be held then.
            out.append(tick + float((await bg.value(scale(e, i + 2.0))).sum()))
        return out

    # One example, so nothing merges within a step. Token 1 twice in a row: merged,
    # the earlier value is still held. Token 1 again after tokens 2 and 3: its value
    # was released meanwhile, so it is recorded anew.
    made, make = _policies()
    with torch.no_grad():
        assert bg.run_all([example([1, 1, 2, 3, 1])], make_policy=make) == [
            run_eagerly(example([1, 1, 2, 3, 1]))]
        sequences = [[1, 1, 2, 3, 4, 1], [2, 1, 1, 3, 4, 1], [4, 4, 4, 0, 0, 4]]
        assert bg.run_all([example(s) for s in sequences]) == [
            run_eagerly(example(s)) for s in sequences]
    graph = made[0].graph
    embedded = [n for n, k in enumerate(graph.node_key)
                if "Embedding" in graph.keys[k].label]
    assert len(embedded) == 4  # tokens 1, 2, 3 and 1 again; the second 1 merged


def test_a_long_run_forgets_released_nodes_and_still_merges_live_ones() -> None:
    embed = bg.batched_func(nn.Embedding(5, 8).double())
    model = _Decoder()

    async def example(token: int, steps: int) -> tuple[list[int], bool]:
        start = embed(bg.batched_value(token))  # held to the end
        h, tokens = start, []
        for _ in range(steps):
            h = model.cell(h).tanh()
            tokens.append(int((await bg.value(model.out(h))).argmax()))
        again = embed(bg.batched_value(token))  # merges with the held node
        return tokens, again.node == start.node if isinstance(again, bg.ResultHandle) else True

    made, make = _policies()
    with torch.no_grad(), forgetting_every(0):
        got = bg.run_all([example(t, 40) for t in (1, 2, 1)], make_policy=make)
        assert got == [run_eagerly(example(t, 40)) for t in (1, 2, 1)]
    assert all(merged for _, merged in got)
    graph = made[0].graph
    held = {n for n in range(len(graph)) if graph.stores[graph.node_loc[n] >> STORE_SHIFT]}
    assert set(graph.dedupe_table.values()) <= held  # only nodes still held are noted
    released = [n for n in range(len(graph)) if n not in held]
    assert len(released) > 200  # of about 240 nodes (examples 0 and 2 merge)
    assert all(graph.node_inputs[n] == () for n in released)  # their inputs let go


def test_a_batched_tensor_changed_in_place_after_a_step_is_still_refused() -> None:
    # Eagerly bg.batched_value(t) is t itself, so `v += 1` changes t too, which cannot be
    # recorded: refused before a step, as in a plain policy. After a step the releaser
    # had dropped the constant's value, and the change was recorded on the handle alone:
    # the example read t unchanged (tanh(0) + 0, not tanh(1) + 1 as eagerly).
    async def example(t: torch.Tensor) -> Any:
        v = bg.batched_value(t)
        await bg.value(torch.tanh(v))  # a step computes v's constant
        v += 1
        return torch.tanh(v) + t

    with pytest.raises(bg.CoroutineExampleError, match=r"`\+=` on .* the tensor given to "
                       r"bg.batched_value"):
        bg.run_all([example(torch.zeros(2)) for _ in range(2)])


def test_inputs_of_a_node_nobody_awaited_yet_are_kept() -> None:
    lin = bg.batched_func(nn.Linear(3, 3).double())

    async def example(x: torch.Tensor) -> torch.Tensor:
        a = lin(x)
        await bg.value(a)
        later = lin(a).tanh()  # recorded now, awaited only after many other steps
        del a  # nothing holds a's handle: only `later`'s pending input needs its value
        h = x + 1  # (lin(x) again would merge with a)
        for _ in range(8):
            h = lin(h)
            await bg.value(h)
        return await bg.value(later)

    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    with torch.no_grad():
        got = bg.run_all([example(x) for x in xs])
        want = [run_eagerly(example(x)) for x in xs]
    for g, w in zip(got, want):
        assert torch.allclose(g, w)


def test_gradients_flow_through_released_steps() -> None:
    lin = nn.Linear(4, 4).double()
    site = bg.batched_func(lin)

    async def example(x: torch.Tensor) -> Any:
        h = x
        total = 0.0
        for _ in range(6):
            h = site(h).tanh()
            total = total + (await bg.value(h)).sum()  # values joined across steps
        return total

    xs = [torch.randn(4, dtype=torch.float64) for _ in range(3)]
    got = torch.stack(bg.run_all([example(x) for x in xs])).sum()
    grad = torch.autograd.grad(got, lin.weight)[0]
    eager = torch.stack([run_eagerly(example(x)) for x in xs]).sum()
    assert torch.allclose(got, eager)
    assert torch.allclose(grad, torch.autograd.grad(eager, lin.weight)[0])


def test_the_releaser_keeps_what_a_live_handle_stands_for() -> None:
    tanh = bg.batched_func(torch.tanh)
    policy = bg.BatchingPolicy()
    releaser = policy.releaser  # each compute steps it
    with policy:
        kept = tanh(torch.ones(2))
        dropped = tanh(torch.zeros(3))
    policy.compute([kept, dropped])
    del dropped
    with policy:
        again = tanh(torch.full((3,), 2.0))  # another step, so the first generation closes
    policy.compute(again)
    assert releaser.released == 0  # one generation: `kept` holds it
    del kept
    releaser.step()
    assert releaser.released > 0
    assert torch.allclose(bg.compute(again), torch.tanh(torch.full((3,), 2.0)))


def test_two_groups_cannot_share_one_policy_but_runs_one_after_another_can() -> None:
    lin = bg.batched_func(nn.Linear(2, 2).double())

    async def example(x: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        await bg.value(h)
        return await bg.value(lin(h))

    xs = [torch.randn(2, dtype=torch.float64) for _ in range(4)]
    shared = bg.BatchingPolicy()
    with pytest.raises(ValueError, match="same policy for two groups"):
        bg.run_all([example(x) for x in xs], groups=2, make_policy=lambda: shared)
    with torch.no_grad():
        want = [run_eagerly(example(x)) for x in xs]
        for _ in range(2):  # one group: the policy's second run starts where the first ended
            got = bg.run_all([example(x) for x in xs], make_policy=lambda: shared)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)


def test_async_batcher_lanes_cannot_share_one_policy() -> None:
    def slow(x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)  # keeps the first lane computing while the second request comes
        return x + 1

    step = bg.batched_func(slow)
    shared = bg.BatchingPolicy()

    async def example(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = await bg.value(step(x))
        return x

    async def main() -> None:
        batcher = bg.AsyncBatcher(max_latency=0.0, groups=2, make_policy=lambda: shared)
        first = asyncio.ensure_future(batcher.run(example(torch.zeros(2))))
        await asyncio.sleep(0.02)
        second = asyncio.ensure_future(batcher.run(example(torch.ones(2))))
        with pytest.raises(ValueError, match="another lane still uses"):
            await asyncio.gather(first, second)
        for task in (first, second):
            task.cancel()
        with contextlib.suppress(Exception):
            await batcher.aclose()

    asyncio.run(main())


def test_a_training_loop_in_one_policy_holds_one_batch_of_values() -> None:
    # One `with BatchingPolicy():` around a whole training loop: every compute's
    # batched outputs used to stay in the graph for the policy's life (memory growing
    # with every batch). Values and parameters must still equal the eager loop's.
    torch.manual_seed(0)
    eager_model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    model.load_state_dict(eager_model.state_dict())
    site = bg.batched_func(model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = bg.BatchingPolicy()

    def held_bytes() -> int:
        return sum(t.numel() * t.element_size() for store in policy.graph.stores
                   for t in store if isinstance(t, torch.Tensor))

    held = []
    with policy:
        for step in range(12):
            xs = [torch.randn(5, dtype=torch.float64) for _ in range(4 + step % 3)]
            loss = sum(site(x).sum() ** 2 for x in xs)
            got = policy.compute(loss)
            got.backward()
            opt.step()
            opt.zero_grad()
            want = sum(eager_model(x).sum() ** 2 for x in xs)
            want.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            assert torch.allclose(got, want)
            del loss
            held.append(held_bytes())
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.allclose(p, q)
    assert max(held[2:]) <= 2 * max(held[:3])  # bounded, not growing with the steps
    assert policy.releaser.released > 0
