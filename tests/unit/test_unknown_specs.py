"""Results whose structure is unknown until they run (a host read, a data-dependent
shape): once computed, calls recorded on them batch.

A call whose output spec cannot be inferred on fake tensors runs one at a time, and
so does every call recorded on its result while that is unknown. After the result
has run, its spec is read from the real value (``signatures.computed_spec``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from tests.property.decoder_models import run_eagerly


def scale_by_max(x: torch.Tensor) -> torch.Tensor:
    """A host read (``float``): its output spec is unknown until it runs."""
    return x / float(x.detach().abs().max())


def positives(x: torch.Tensor) -> torch.Tensor:
    """A data-dependent shape: as many values as ``x`` has positive ones."""
    return x[x > 0]


def split_by_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A host read returning a pair: unknown, and not one tensor once run either."""
    peak = float(x.detach().max())
    return x - peak, x + peak


def _weighted_grads(
    outputs: list[torch.Tensor], leaves: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Gradients of ``leaves`` under a loss weighing example i's output by i + 1 (so
    gradients handed to another example's rows cannot match)."""
    for t in leaves:
        t.grad = None
    loss = sum((i + 1) * (o * torch.linspace(0.5, 1.5, o.numel()).view_as(o)).sum()
               for i, o in enumerate(outputs))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    grads = [t.grad for t in leaves]
    assert all(g is not None for g in grads)
    return [g.clone() for g in grads if g is not None]


def test_calls_recorded_on_a_computed_unknown_result_batch() -> None:
    lin, lin2 = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    xs = [torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(8)]
    leaves = [*lin.parameters(), *lin2.parameters(), *xs]

    def later(x: Any, m: Any, tanh: Any, second: Any) -> Any:
        return tanh(second(x) + m)

    scaled = [scale_by_max(lin(x)) for x in xs]
    eager = [later(x, m, torch.tanh, lin2) for x, m in zip(xs, scaled, strict=True)]
    eager_grads = _weighted_grads(eager, leaves)

    f, first, second = bg.batched_func(scale_by_max), bg.batched_func(lin), bg.batched_func(lin2)
    tanh = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy() as policy:
        ms = [f(first(x)) for x in xs]
    assert all(m.spec is None for m in ms)
    bg.compute(ms)
    assert policy.stats is not None and policy.stats.unbatched_calls == 8
    with policy:
        hs = [later(x, m, tanh, second) for x, m in zip(xs, ms, strict=True)]
    got = bg.compute(hs)
    # second, + and tanh: one launch each (before: 1 + 8 + 8, the add and tanh of
    # each example alone, their input's spec unknown).
    assert (policy.stats.launches, policy.stats.unbatched_calls) == (3, 0)
    assert all(m.spec == bg.TensorSpec((4,), torch.float64, torch.device("cpu")) for m in ms)
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    for g, e in zip(_weighted_grads(got, leaves), eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_data_dependent_shapes_batch_by_the_shape_each_turned_out(counts: list[int]) -> None:
    # Example i has counts[i] positive values: its later calls batch with those of
    # the examples whose results have as many, one launch per distinct count and call.
    xs = [torch.cat([torch.arange(1.0, n + 1), -torch.ones(4 - n)]).double() for n in counts]
    for x in xs:
        x.requires_grad_(True)
    eager = [torch.tanh(positives(x) * 3.0) for x in xs]
    eager_grads = _weighted_grads(eager, xs)
    pick, tanh = bg.batched_func(positives), bg.batched_func(torch.tanh)
    with bg.BatchingPolicy() as policy:
        ps = [pick(x) for x in xs]
    bg.compute(ps)
    with policy:
        hs = [tanh(p * 3.0) for p in ps]
    got = bg.compute(hs)
    assert policy.stats is not None
    assert (policy.stats.launches, policy.stats.unbatched_calls) == (2 * len(set(counts)), 0)
    assert [tuple(g.shape) for g in got] == [(n,) for n in counts]
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    for g, e in zip(_weighted_grads(got, xs), eager_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_a_computed_unknown_result_that_is_a_pair_stays_whole() -> None:
    # Not one tensor: a later call gets the whole pair, as recorded, one at a time.
    xs = [torch.randn(3, dtype=torch.float64) for _ in range(4)]
    split = bg.batched_func(split_by_max)
    first = bg.batched_func(lambda pair: pair[0] * pair[1])
    with bg.BatchingPolicy() as policy:
        pairs = [split(x) for x in xs]
    bg.compute(pairs)
    with policy:
        hs = [first(p) for p in pairs]
    got = bg.compute(hs)
    assert all(p.spec is None for p in pairs)
    assert policy.stats is not None and policy.stats.unbatched_calls == 4
    for g, x in zip(got, xs, strict=True):
        a, b = split_by_max(x)
        torch.testing.assert_close(g, a * b, rtol=1e-12, atol=1e-12)


def test_a_coroutine_reading_an_unknown_result_every_step_batches_after_the_first() -> None:
    # m is computed with the first step, where the calls on it run one at a time;
    # later steps batch. The last step: lin, + and tanh once each (before: 24
    # launches, once per example each, as h itself stayed of unknown spec).
    lin = nn.Linear(4, 4).double()
    xs = [torch.randn(4, dtype=torch.float64) for _ in range(8)]

    async def example(x: torch.Tensor, fn: Any, f: Any, tanh: Any) -> list[Any]:
        m = f(fn(x))
        h, out = x, []
        for _ in range(4):
            h = tanh(fn(h) + m)
            out.append(await bg.value(h))
        return out

    policies: list[bg.BatchingPolicy] = []

    def policy() -> bg.BatchingPolicy:
        policies.append(bg.BatchingPolicy())
        return policies[-1]

    eager = [v for x in xs for v in run_eagerly(example(x, lin, scale_by_max, torch.tanh))]
    batched = [example(x, bg.batched_func(lin), bg.batched_func(scale_by_max),
                       bg.batched_func(torch.tanh)) for x in xs]
    got = [v for values in bg.run_all(batched, make_policy=policy) for v in values]
    assert len(policies) == 1 and policies[0].stats is not None
    assert (policies[0].stats.launches, policies[0].stats.unbatched_calls) == (3, 0)
    assert len(got) == len(eager) == 32
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    params = list(lin.parameters())
    for g, e in zip(_weighted_grads(got, params), _weighted_grads(eager, params), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_named_fields_of_a_result_of_unknown_structure_record_as_items_do() -> None:
    # torch.linalg.lstsq's residuals have a shape that depends on the rank found, so
    # its result's structure is unknown until it runs; `.solution` records the read
    # (it failed: "ResultHandle has no attribute 'solution'"), as `[0]` does.
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(n, n, generator=gen, dtype=torch.float64) + 3 * torch.eye(n, dtype=torch.float64),
              torch.randn(n, 1, generator=gen, dtype=torch.float64)) for n in (3, 3, 2)]
    for a, _ in pairs:
        a.requires_grad_()

    def solve(a: Any, b: Any) -> list[Any]:
        found = torch.linalg.lstsq(a, b)
        return [found.solution * 2, found[0], found.rank]

    leaves = [a for a, _ in pairs]
    eager = [solve(a, b) for a, b in pairs]
    eager_grads = _weighted_grads([vs[0] for vs in eager], leaves)
    with bg.BatchingPolicy():
        handles = [solve(bg.batched_value(a), b) for a, b in pairs]
    got = bg.compute(handles)
    for want, values in zip(eager, got):
        for w, g in zip(want, values):
            torch.testing.assert_close(g, w)
    for w, g in zip(eager_grads, _weighted_grads([vs[0] for vs in got], leaves)):
        torch.testing.assert_close(g, w)


def test_a_name_no_result_has_still_fails_where_it_is_read() -> None:
    with bg.BatchingPolicy():
        found = torch.linalg.lstsq(bg.batched_value(torch.eye(2)), torch.ones(2, 1))
        with pytest.raises(AttributeError, match="no attribute 'solutions'"):
            found.solutions  # noqa: B018  (the read itself is what fails)
