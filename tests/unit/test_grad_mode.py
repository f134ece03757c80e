"""A recorded call runs in the grad mode it was recorded in, as it would have eagerly,
whatever the mode when it is computed; coroutine examples each keep their own mode."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import batchgraph as bg
from batchgraph.stepping import Example, Lane
from tests.property.decoder_models import run_eagerly


def _linear() -> bg.BatchedFunc:
    torch.manual_seed(0)
    return bg.batched_func(nn.Linear(3, 3).double())


def test_a_call_recorded_under_no_grad_gets_no_gradient() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    # A baseline computed without grad: the loss must not reach lin through it.
    with bg.BatchingPolicy():
        with torch.no_grad():
            baseline = lin(bg.batched_value(x))
        score = lin(bg.batched_value(x * 2.0))
        loss = (score - baseline).pow(2).sum()
        value = bg.compute(loss)
    assert not baseline.value.requires_grad
    value.backward()
    batched = lin.__wrapped__.weight.grad.clone()
    lin.__wrapped__.weight.grad = None
    with torch.no_grad():
        eager_baseline = lin(x)
    (lin(x * 2.0) - eager_baseline).pow(2).sum().backward()
    torch.testing.assert_close(batched, lin.__wrapped__.weight.grad)


def test_a_call_recorded_with_grad_keeps_it_when_computed_under_no_grad() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with torch.no_grad(), bg.BatchingPolicy():
        with torch.enable_grad():
            tracked = lin(bg.batched_value(x))
        untracked = lin(bg.batched_value(x + 1.0))
        bg.compute([tracked, untracked])
    assert tracked.value.requires_grad and not untracked.value.requires_grad


def test_one_callable_in_both_modes_is_two_batches() -> None:
    lin = _linear()
    with bg.BatchingPolicy() as policy:
        hs = [lin(torch.full((3,), float(i), dtype=torch.float64)) for i in range(3)]
        with torch.no_grad():
            hs += [lin(torch.full((3,), float(i), dtype=torch.float64)) for i in range(3)]
        values = bg.compute(hs)
    assert policy.stats is not None and policy.stats.launches == 2
    assert [v.requires_grad for v in values] == [True] * 3 + [False] * 3
    assert hs[0].node != hs[3].node  # identical calls in different modes are not merged
    for v, w in zip(values[:3], values[3:]):
        torch.testing.assert_close(v.detach(), w)


def test_each_coroutine_keeps_its_own_grad_mode_across_awaits() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)

    async def example(i: int) -> tuple[bool, bool, bool]:
        with torch.no_grad():  # suspended in here, while the others run
            v = await bg.value(lin(bg.batched_value(x * i)))
        w = await bg.value(lin(bg.batched_value(x * i + 1.0)))
        return v.requires_grad, w.requires_grad, torch.is_grad_enabled()

    eager = [run_eagerly(example(i)) for i in range(3)]
    assert eager == [(False, True, True)] * 3
    assert bg.run_all([example(i) for i in range(3)], groups=1) == eager
    assert bg.run_all([example(i) for i in range(3)], groups=2, overlap="inline") == eager
    assert torch.is_grad_enabled()  # the driver's own mode is back


def test_a_chain_recorded_with_grad_backpropagates_when_computed_under_no_grad() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    with bg.BatchingPolicy():
        with torch.enable_grad():
            first = lin(bg.batched_value(x))
            second = lin(first)  # gathers first's rows: the gather must keep their history
        with torch.no_grad():
            value = bg.compute(second)
    value.sum().backward()
    batched = lin.__wrapped__.weight.grad.clone()
    lin.__wrapped__.weight.grad = None
    lin(lin(x)).sum().backward()
    torch.testing.assert_close(batched, lin.__wrapped__.weight.grad)


def test_an_example_awaiting_inside_inference_mode_keeps_it_to_itself() -> None:
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)

    async def example(i: int) -> tuple[bool, bool]:
        if i == 0:
            with torch.inference_mode():  # suspended in here while the others record
                await bg.value(lin(bg.batched_value(x)))
        v = await bg.value(lin(bg.batched_value(x * i + 1.0)))
        return v.is_inference(), torch.is_inference_mode_enabled()

    eager = [run_eagerly(example(i)) for i in range(3)]
    assert bg.run_all([example(i) for i in range(3)]) == eager == [(False, False)] * 3
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()


def test_closing_an_example_suspended_in_its_own_modes_restores_the_callers() -> None:
    """As AsyncBatcher does for a cancelled task: the example closes in its own modes
    (its with-blocks restore them as they exit), and no guard is left to undo later."""
    lin, x = _linear(), torch.ones(3, dtype=torch.float64)
    closed: list[bool] = []

    async def waiting() -> None:
        with torch.inference_mode(), torch.no_grad():
            try:
                await bg.value(lin(bg.batched_value(x)))
            finally:
                closed.append(torch.is_inference_mode_enabled())

    example = Example(0, waiting())
    lane = Lane(bg.BatchingPolicy(), [example])
    lane.start()  # suspended inside both blocks
    assert example.inference is not None
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    lane.close([example])
    assert closed == [True]  # its finally ran in its own inference mode
    assert example.inference is None
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_a_view_recorded_under_no_grad_does_not_require_grad() -> None:
    """Before: the squeeze's input was gathered together with rows a later call needs
    grad for, so the squeezed value (a view) required grad without history, where
    the eager value does not: ``.numpy()`` on it raised."""
    x = torch.randn((), dtype=torch.float64).requires_grad_()

    def f(a: Any, b: Any) -> Any:
        return a + b.sum()

    with bg.BatchingPolicy() as policy:
        h = bg.batched_value(x)
        with torch.no_grad():
            baseline = f(h, h)
        score = f(h, h)  # the same call with grad: its rows ride in the same gather
        with torch.no_grad():
            squeezed = torch.squeeze(baseline)
        got_baseline, got_score, got_squeezed = policy.compute([baseline, score, squeezed])
    with torch.no_grad():
        want = torch.squeeze(f(x, x))
    assert not got_squeezed.requires_grad and not want.requires_grad
    assert got_squeezed.numpy() == want.numpy()
    assert got_score.requires_grad and not got_baseline.requires_grad


def test_an_op_returning_its_input_under_no_grad_keeps_its_history() -> None:
    """Eagerly, dropout in eval mode returns its input itself, so under no_grad too
    the result carries gradient to it; so does the batched value."""
    drop = bg.batched_func(nn.Dropout(0.5).eval())
    x = torch.randn(3, dtype=torch.float64).requires_grad_()
    with torch.no_grad():
        eager = drop(x)
    assert eager is x
    with bg.BatchingPolicy() as policy:
        with torch.no_grad():
            handle = drop(bg.batched_value(x))
        got = policy.compute(handle)
    (grad,) = torch.autograd.grad((got * 2.0).sum(), [x])
    torch.testing.assert_close(grad, torch.full((3,), 2.0, dtype=torch.float64))


def test_calls_recorded_with_grad_keep_it_when_computed_and_read_in_inference_mode() -> None:
    """Before: computed inside ``torch.inference_mode()``, they gave inference tensors
    without history (backward raised "does not require grad"), and a value read there
    (``h.value``) had none either."""
    lin = _linear()
    xs = [torch.full((3,), float(i), dtype=torch.float64) for i in range(3)]
    with bg.BatchingPolicy():
        handles = [lin(bg.batched_value(x)) for x in xs]
    with torch.inference_mode():
        values = bg.compute(handles)
        read = handles[0].value
    assert all(v.grad_fn is not None and not v.is_inference() for v in [*values, read])
    (torch.stack(values).sum() + read.sum()).backward()
    batched = lin.__wrapped__.weight.grad.clone()
    lin.__wrapped__.weight.grad = None
    (torch.stack([lin(x) for x in xs]).sum() + lin(xs[0]).sum()).backward()
    torch.testing.assert_close(batched, lin.__wrapped__.weight.grad)


def test_calls_recorded_in_inference_mode_and_computed_there_give_inference_tensors() -> None:
    lin = _linear()
    with torch.inference_mode():
        with bg.BatchingPolicy():
            handles = [lin(bg.batched_value(torch.ones(3, dtype=torch.float64)))
                       for _ in range(2)]
        values = bg.compute(handles)
        want = lin(torch.ones(3, dtype=torch.float64))
    assert want.is_inference() and all(v.is_inference() for v in values)


def test_a_constant_that_requires_grad_keeps_its_gradient_when_stacked_under_no_grad() -> None:
    """Before: read first under no_grad (or inference mode), a ``batched_value`` of a
    tensor that requires grad was stacked without history, and calls recorded with
    grad on it later gave no gradient to it (or, from inference mode, raised)."""
    lin = _linear()
    for region in (torch.no_grad, torch.inference_mode):
        x = torch.ones(3, dtype=torch.float64, requires_grad=True)
        with bg.BatchingPolicy() as policy:
            h = bg.batched_value(x)
            with region():
                policy.compute(h)
            out = policy.compute(lin(h).sum())
        (grad,) = torch.autograd.grad(out, [x])
        torch.testing.assert_close(grad, lin.__wrapped__.weight.sum(0).detach())


def test_calls_recorded_in_inference_mode_run_without_grad_wherever_computed() -> None:
    """Computed with others outside inference mode, they give normal tensors without
    grad (inference tensors there could not be saved by later calls with grad, where
    eager values, views of normal tensors, could); computed wholly inside it, they
    give inference tensors, as eagerly."""
    lin = _linear()
    with bg.BatchingPolicy() as policy:
        with torch.inference_mode():
            handles = [lin(bg.batched_value(torch.full((3,), float(i), dtype=torch.float64)))
                       for i in range(2)]
        score = lin(bg.batched_value(torch.ones(3, dtype=torch.float64)))
        values = policy.compute([*handles, score])
    assert not any(v.is_inference() or v.requires_grad for v in values[:2])
    assert values[2].requires_grad
    with torch.inference_mode():
        with bg.BatchingPolicy() as policy:
            handles = [lin(bg.batched_value(torch.ones(3, dtype=torch.float64)))
                       for _ in range(2)]
        assert all(v.is_inference() for v in policy.compute(handles))


def test_calls_recorded_with_grad_enabled_inside_inference_mode_get_no_gradient() -> None:
    """Inside ``torch.inference_mode()`` even ``torch.enable_grad()`` builds no autograd
    graph: eager values are inference tensors that do not require grad. Before, such
    a call was recorded as made with grad, and its batched value required grad (a
    backward through it reached the weights, where eager code had nothing to
    backpropagate); a coroutine example entering ``enable_grad`` under an inference
    mode caller got it too."""
    lin = _linear()
    x = torch.ones(3, dtype=torch.float64)
    with torch.inference_mode(), torch.enable_grad():
        assert not lin(x).requires_grad  # the eager reference
        with bg.BatchingPolicy():
            handle = lin(bg.batched_value(x))
        value = bg.compute(handle)
    assert not value.requires_grad
    torch.testing.assert_close(value, lin(x).detach())

    async def example(i: int) -> bool:
        with torch.enable_grad():
            v = await bg.value(lin(bg.batched_value(x * i)))
        return v.requires_grad

    with torch.inference_mode():
        eager = [run_eagerly(example(i)) for i in range(3)]
        assert bg.run_all([example(i) for i in range(3)]) == eager == [False] * 3
