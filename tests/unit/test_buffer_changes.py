"""A module's buffers changed in place between recording and compute.

A batched call reads its module's buffers (running statistics, a counter) when it
runs; an eager call read them when it was made. So a buffer changed from outside
batchgraph after a call was recorded and before it was computed (statistics loaded,
an EMA update, an eager call) is refused (``BufferChangedError``, a
``ParameterChangedError``), while the changes the computation makes itself (a
``BatchNorm`` in training mode updating its statistics, over several steps and
computes, and in shape inference) are not.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from tests.property.decoder_models import run_eagerly

F64 = torch.float64


class Normed(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3).double()
        self.bn = nn.BatchNorm1d(3).double()

    def one(self, x: Any) -> Any:
        """One vector: a batch of one for the BatchNorm (eval mode only)."""
        return self.bn(x.unsqueeze(0)).squeeze(0)

    def rows(self, x: Any) -> Any:
        """A (rows, 3) matrix: its own batch statistics in training mode."""
        return self.bn(self.lin(x))

    def twice(self, x: Any) -> Any:
        """Two steps through the same BatchNorm."""
        return self.bn(torch.tanh(self.bn(self.lin(x))))


def _model(train: bool) -> Normed:
    torch.manual_seed(0)
    model = Normed()
    with torch.no_grad():  # statistics other than the defaults, so changes show
        model.bn.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
        model.bn.running_var.copy_(torch.tensor([2.0, 0.5, 1.5]))
    return model.train(train)


def _vectors(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, dtype=F64, generator=g) for _ in range(n)]


def _matrices(n: int, rows: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(rows, 3, dtype=F64, generator=g) for _ in range(n)]


def _load_other_statistics(model: Normed) -> None:
    # (Only the statistics: a whole state dict copies the parameters too, which is
    # refused as a parameter change first.)
    state = {name: t + 1.0 for name, t in model.state_dict().items() if "running_" in name}
    model.load_state_dict(state, strict=False)


def _eager_training_call(model: Normed) -> None:
    model.bn.train()
    model.bn(torch.randn(4, 3, dtype=F64))  # updates the running statistics
    model.bn.eval()


CHANGES: dict[str, tuple[Callable[[Normed], Any], str]] = {
    "add_": (lambda m: m.bn.running_mean.add_(5.0), "'running_mean'"),
    "load_state_dict": (_load_other_statistics, "'running_mean', 'running_var'"),
    # (torch's batch_norm updates the running statistics without moving their version
    # counters; num_batches_tracked += 1 moves its own.)
    "an eager call in training mode": (_eager_training_call, "'num_batches_tracked'"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_eval_statistics_changed_between_record_and_compute_are_refused(change: str) -> None:
    model = _model(train=False)
    xs = _vectors(3)
    with bg.BatchingPolicy() as policy:
        handles = [model.one(x) for x in xs]
    changer, named = CHANGES[change]
    with torch.no_grad():
        changer(model)
    with pytest.raises(bg.BufferChangedError, match=rf"buffer\(s\) {named}.*BatchNorm1d.*"
                       r"changed in place after its calls in this batch \(3\).*Compute what "
                       r"you recorded before changing the buffers"):
        policy.compute(handles)
    assert not any(h.computed for h in handles)  # refused before anything ran
    # Recorded again after the change, the calls compute with the new statistics.
    with bg.BatchingPolicy() as again:
        handles = [model.one(x) for x in xs]
    for got, x in zip(again.compute(handles), xs, strict=True):
        torch.testing.assert_close(got, model.one(x), rtol=0, atol=1e-12)


def test_the_error_is_a_parameter_changed_error() -> None:
    model = _model(train=False)
    with bg.BatchingPolicy() as policy:
        h = model.one(_vectors(1)[0])
    model.bn.running_var.mul_(2.0)
    with pytest.raises(bg.ParameterChangedError, match="'running_var'"):
        policy.compute(h)


def test_the_repro_uses_the_old_statistics_or_refuses() -> None:
    # The report's case: eval BatchNorm, running_mean.add_ between record and compute
    # used to give values 5 lower than eager, silently.
    class M(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def f(self, x: Any) -> Any:
            return self.bn(x.unsqueeze(0)).squeeze(0)

    m = M().eval()
    xs = [torch.randn(3) for _ in range(2)]
    with bg.BatchingPolicy():
        hs = [m.f(x) for x in xs]
    m.bn.running_mean.add_(5.0)
    with pytest.raises(bg.BufferChangedError, match="running_mean"):
        bg.compute(hs)


def test_unchanged_buffers_compute_as_eager_across_computes() -> None:
    model = _model(train=False)
    xs = _vectors(6)
    eager = [model.one(x) for x in xs]
    policy = bg.BatchingPolicy()
    with policy:
        first = [model.one(x) for x in xs[:3]]
    other = torch.zeros(3)
    other.add_(1.0)  # a tensor that is no buffer of the model: not watched
    got = policy.compute(first)
    with policy:
        second = [model.one(x) for x in xs[3:]]
    got += policy.compute(second)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def test_calls_recorded_after_a_change_compute_while_older_ones_are_refused() -> None:
    model = _model(train=False)
    x = _vectors(1)[0]
    with bg.BatchingPolicy() as policy:
        before = model.one(x)
        unrelated = bg.batched_func(torch.tanh)(x)
    policy.compute(unrelated)  # a compute: the next call notes the buffers anew
    model.bn.running_mean.add_(1.0)
    with policy:
        after = model.one(x)  # the same call, new statistics: not merged with `before`
    assert after.node != before.node
    torch.testing.assert_close(policy.compute(after), model.one(x), rtol=0, atol=1e-12)
    with pytest.raises(bg.BufferChangedError):
        policy.compute(before)


def test_a_change_between_two_calls_without_a_compute_counts_for_both() -> None:
    # As for parameters: only a compute makes calls note the buffers anew (documented).
    model = _model(train=False)
    x, y = _vectors(2)
    with bg.BatchingPolicy() as policy:
        model.one(x)
        model.bn.running_mean.add_(1.0)
        later = model.one(y)
    with pytest.raises(bg.BufferChangedError):
        policy.compute(later)


def test_buffers_replaced_by_a_conversion_are_watched_in_a_reused_policy() -> None:
    # model.float() makes new buffer tensors (parameters stay the same objects): the
    # policy's graph, which listed the old ones, watches the new ones from then on.
    model = _model(train=False)
    x = _vectors(1)[0]
    policy = bg.BatchingPolicy()
    with policy:
        h = model.one(x)
    policy.compute(h)
    model.float()
    with policy:
        h = model.one(x.float())
    torch.testing.assert_close(policy.compute(h), model.one(x.float()))
    with policy:
        h = model.one(x.float() + 1.0)
    model.bn.running_mean.add_(1.0)
    with pytest.raises(bg.BufferChangedError, match="'running_mean'"):
        policy.compute(h)


def test_a_function_reading_a_module_watches_its_buffers() -> None:
    model = _model(train=False)
    norm = model.bn
    f = bg.batched_func(lambda x: norm(x.unsqueeze(0)).squeeze(0))
    x = _vectors(1)[0]
    with bg.BatchingPolicy() as policy:
        h = f(x)
    norm.running_var.mul_(3.0)
    with pytest.raises(bg.BufferChangedError,
                       match=r"'BatchNorm1d\.running_var' \(of modules it reads\)"):
        policy.compute(h)


@pytest.mark.parametrize("kept", [False, True], ids=["old dropped", "old kept"])
def test_a_function_reading_a_module_watches_its_buffers_replaced(kept: bool) -> None:
    # `norm.running_mean = t` went unseen for a function reading norm (its calls
    # computed with t, silently); and calls recorded after it compute with t.
    model = _model(train=False)
    norm = model.bn
    f = bg.batched_func(lambda x: norm(x.unsqueeze(0)).squeeze(0))
    x = _vectors(1)[0]
    old = [norm.running_mean]
    with bg.BatchingPolicy() as policy:
        h = f(x)
    norm.running_mean = torch.ones(3, dtype=F64)
    if not kept:
        old.clear()
    with pytest.raises(bg.BufferChangedError,
                       match=r"'BatchNorm1d\.running_mean' \(of modules it reads\)"):
        policy.compute(h)
    with bg.BatchingPolicy() as fresh:
        again = f(x + 1)
    torch.testing.assert_close(fresh.compute(again), norm((x + 1).unsqueeze(0)).squeeze(0),
                               rtol=0, atol=1e-12)


def test_a_buffer_passed_as_an_argument_is_a_watched_constant() -> None:
    class Scaled(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3).double()
            self.register_buffer("scale", torch.full((3,), 2.0, dtype=F64))

        def f(self, x: Any) -> Any:
            return self.lin(x) * self.scale

    model = Scaled()
    x = _vectors(1)[0]
    with bg.BatchingPolicy() as policy:
        h = model.f(x)
    model.scale.add_(1.0)
    with pytest.raises(bg.ConstantChangedError):
        policy.compute(h)


# -- changes the computation makes itself ----------------------------------------------


def test_training_batchnorm_two_steps_through_one_module_in_one_compute_equals_eager() -> None:
    model = _model(train=True)
    reference = copy.deepcopy(model)
    xs = _matrices(4)
    eager = [reference.twice(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        handles = [model.twice(bg.batched_value(x)) for x in xs]
    got = policy.compute(handles)  # each BatchNorm step updates the statistics
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    assert int(model.bn.num_batches_tracked) > 0


def test_training_calls_waiting_across_computes_and_new_signatures_compute() -> None:
    # Each compute (and each new signature's run on fake tensors) updates the
    # statistics; none of that is a change from outside.
    model = _model(train=True)
    reference = copy.deepcopy(model)
    xs = _matrices(3) + _matrices(2, rows=5)
    eager = [reference.rows(x) for x in xs]
    with bg.BatchingPolicy() as policy:
        first = [model.rows(bg.batched_value(x)) for x in xs[:3]]
        second = [model.rows(bg.batched_value(x)) for x in xs[3:]]  # a new signature
    got = policy.compute(first[:1])
    got += policy.compute(first[1:])
    got += policy.compute(second)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


class Counting(nn.Module):
    """Counts the batches it runs in a buffer (as BatchNorm's num_batches_tracked),
    and scales by another buffer."""

    batch_key = bg.StackKey

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.full((3,), 2.0, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * self.scale


def test_a_module_updating_a_buffer_in_forward_batches_and_computes() -> None:
    counting = Counting()
    site = bg.batched_func(counting)
    xs = _vectors(4)
    with bg.BatchingPolicy() as policy:
        once = [site(bg.batched_value(x)) for x in xs]
        twice = [site(site(bg.batched_value(x))) for x in xs]
        waiting = [site(bg.batched_value(x + 1.0)) for x in xs]
    got = policy.compute(once + twice)  # two steps through the module: no refusal
    assert policy.stats.launches <= 3  # one constant step and two of the module
    got += policy.compute(waiting)  # recorded before the first compute's updates
    want = [x * 2.0 for x in xs] + [x * 4.0 for x in xs] + [(x + 1.0) * 2.0 for x in xs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with policy:
        pending = site(bg.batched_value(xs[0] - 1.0))  # (not merged with a computed call)
    counting.scale.fill_(3.0)  # the other buffer, changed from outside
    with pytest.raises(bg.BufferChangedError, match="'scale'"):
        policy.compute(pending)


@settings(deadline=None, max_examples=40)
@given(actions=st.lists(st.tuples(st.sampled_from(["record", "record", "compute"]),
                                  st.integers(0, 1), st.integers(0, 7)), max_size=16))
def test_training_statistics_updated_by_any_mix_of_computes_are_never_refused(
    actions: list[tuple[str, int, int]],
) -> None:
    """Calls of a BatchNorm in training mode recorded and computed in any order (two
    signatures, one or two steps per call, computes leaving calls waiting): every
    compute gives the eager values; the statistics it updates are no change."""
    model = _model(train=True)
    reference = copy.deepcopy(model)
    policy = bg.BatchingPolicy()
    pending: list[tuple[bg.ResultHandle, torch.Tensor]] = []
    for action, kind, arg in [*actions, ("compute", 0, 0)]:
        if action == "record":
            x = _matrices(1, rows=3 + kind)[0] + arg
            fn = (model.rows, model.twice)[arg % 2]
            eager = (reference.rows, reference.twice)[arg % 2](x)
            with policy:
                pending.append((fn(bg.batched_value(x)), eager))
        elif pending:
            chosen = pending[arg % len(pending):][:2]
            got = policy.compute([h for h, _ in chosen])
            for value, (_, eager) in zip(got, chosen, strict=True):
                torch.testing.assert_close(value, eager, rtol=0, atol=1e-12)
            pending = [p for p in pending if not any(p is c for c in chosen)]


# -- coroutines ----------------------------------------------------------------------


async def _phased(model: Normed, x: torch.Tensor, phases: int) -> list[torch.Tensor]:
    """Each phase loads its own statistics (the first example to get there does;
    the others find them loaded) and then records."""
    out = []
    for phase in range(phases):
        wanted = torch.full((3,), float(phase), dtype=F64)
        if not torch.equal(model.bn.running_mean, wanted):
            model.bn.running_mean.copy_(wanted)  # between awaits: legal
        out.append(await bg.value(model.one(x)))
    return out


def test_a_buffer_changed_between_awaits_reaches_the_calls_recorded_after_it() -> None:
    model = _model(train=False)
    xs = _vectors(5)
    eager = [run_eagerly(_phased(model, x, 3)) for x in xs]
    got = bg.run_all([_phased(model, x, 3) for x in xs])
    assert len(got) == len(eager)
    for g, e in zip(got, eager):
        for a, b in zip(g, e):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # (Phase p's values differ from phase 0's: the change did reach them.)
    assert not torch.allclose(got[0][0], got[0][2])


async def _twice(model: Normed, x: torch.Tensor, rounds: int) -> list[torch.Tensor]:
    out = []
    for _ in range(rounds):
        out.append(await bg.value(model.twice(bg.batched_value(x))))
    return out


@pytest.mark.parametrize("overlap", ["inline", "thread", "parallel"])
def test_training_lanes_updating_one_batchnorm_on_threads_are_never_refused(
    overlap: str,
) -> None:
    # One lane records while another lane's step updates the statistics (on an
    # executor thread): those updates are the computation's, not a change from outside.
    model = _model(train=True)
    reference = copy.deepcopy(model)
    xs = _matrices(8)
    eager = [run_eagerly(_twice(reference, x, 3)) for x in xs]
    got = bg.run_all([_twice(model, x, 3) for x in xs], groups=2, overlap=overlap)
    for g, e in zip(got, eager):
        for a, b in zip(g, e):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# -- batches recorded in workers ---------------------------------------------------------


def test_a_bound_batch_updating_statistics_leaves_waiting_calls_computable() -> None:
    model = _model(train=True)
    xs = _matrices(3)
    with bg.BatchingPolicy() as recorded:
        handles = [model.rows(bg.batched_value(x)) for x in xs]
    batch = bg.export(recorded, handles, model)  # as a worker would
    with bg.BatchingPolicy() as policy:
        waiting = [model.rows(bg.batched_value(x)) for x in xs]
    bg.Binder(model).run(batch)  # a computation: it updates the statistics
    reference = copy.deepcopy(model)
    for g, x in zip(policy.compute(waiting), xs, strict=True):
        torch.testing.assert_close(g, reference.rows(x), rtol=0, atol=1e-12)
