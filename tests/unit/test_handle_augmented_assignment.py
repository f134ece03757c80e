"""Augmented assignment on handles (`h += g`) acts as on tensors: in place, so every
name bound to the value sees the change, with the value's shape and dtype kept.
Also the metadata and operators handles answer as tensors do."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import batchgraph as bg

_FLOAT_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul,
    "/=": operator.itruediv, "**=": operator.ipow, "//=": operator.ifloordiv,
    "%=": operator.imod,
}
_INT_OPS: dict[str, Callable[[Any, Any], Any]] = {
    "&=": operator.iand, "|=": operator.ior, "^=": operator.ixor,
    "<<=": operator.ilshift, ">>=": operator.irshift, "+=": operator.iadd,
}


def _aliasing(op: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def example(x: Any, y: Any) -> Any:
        z = x * 1
        states = [z]  # bound to another name before the change
        z = op(z, y)
        return states[0], z
    return example


@pytest.mark.parametrize("symbol", sorted(_FLOAT_OPS))
def test_float_ops_change_every_name_bound_to_the_value(symbol: str) -> None:
    example = _aliasing(_FLOAT_OPS[symbol])
    torch.manual_seed(0)
    xs = [torch.rand(3, dtype=torch.float64) + 1 for _ in range(4)]
    grad = symbol != "//="  # floor_divide has no derivative, eagerly either
    ys = [(torch.rand(3, dtype=torch.float64) + 0.5).requires_grad_(grad) for _ in range(4)]
    eager = [example(x, y) for x, y in zip(xs, ys, strict=True)]
    with bg.BatchingPolicy():
        handles = [example(bg.batched_value(x), bg.batched_value(y)) for x, y in zip(xs, ys, strict=True)]
    got = bg.compute(handles)
    for (a, b), (ea, eb) in zip(got, eager, strict=True):
        torch.testing.assert_close(a, ea)
        torch.testing.assert_close(b, eb)
    if grad:
        # Example i weighs i + 1: with equal weights, gradients that reached another
        # example's rows matched for the ops whose gradient is the same everywhere.
        def loss(values: list[Any]) -> Any:
            return sum((i + 1) * (a.sum() * 3 + b.sum()) for i, (a, b) in enumerate(values))

        grads = torch.autograd.grad(loss(got), ys)
        eager_grads = torch.autograd.grad(loss(eager), ys)
        for g, eg in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(g, eg)


@pytest.mark.parametrize("symbol", sorted(_INT_OPS))
def test_integer_ops_change_every_name_bound_to_the_value(symbol: str) -> None:
    example = _aliasing(_INT_OPS[symbol])
    xs = [torch.tensor([5, 12, 7]) + i for i in range(3)]
    eager = [example(x, 2) for x in xs]
    with bg.BatchingPolicy():
        handles = [example(bg.batched_value(x), 2) for x in xs]
    for (a, b), (ea, eb) in zip(bg.compute(handles), eager, strict=True):
        assert torch.equal(a, ea) and torch.equal(b, eb)


def test_calls_recorded_before_the_change_see_the_old_value() -> None:
    def example(x: Any) -> Any:
        z = x * 1
        before = z.exp()
        z += 1
        return before, z.exp()
    x = torch.arange(3.0)
    with bg.BatchingPolicy():
        h = example(bg.batched_value(x))
    for got, want in zip(bg.compute(h), example(x), strict=True):
        torch.testing.assert_close(got, want)


def test_a_sum_accumulated_with_plus_equals() -> None:
    def example(xs: list[Any]) -> Any:
        total = 0
        for x in xs:
            total += x.tanh()  # 0 + handle, then handle += handle
        return total
    data = [[torch.randn(2) for _ in range(n)] for n in (1, 3, 4)]
    with bg.BatchingPolicy():
        handles = [example([bg.batched_value(x) for x in xs]) for xs in data]
    for got, xs in zip(bg.compute(handles), data, strict=True):
        torch.testing.assert_close(got, example(xs))


def test_shape_and_dtype_stay_as_on_tensors() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(3)) * 1
        with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
            h += torch.ones(2, 3)
        n = bg.batched_value(torch.arange(3)) * 1
        with pytest.raises(RuntimeError, match="can't be cast"):
            n += 0.5
        f = bg.batched_value(torch.ones(3)) * 1
        f += torch.full((3,), 0.1, dtype=torch.float64)  # computed in float64, kept float32
        assert f.dtype == torch.float32
    eager = torch.ones(3)
    eager += torch.full((3,), 0.1, dtype=torch.float64)
    assert torch.equal(bg.compute(f), eager)


def test_changing_a_batched_value_in_place_is_refused() -> None:
    # Eagerly bg.batched_value(x) is x itself: `+=` would change the caller's tensor.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(3))
        with pytest.raises(TypeError, match="batched_value"):
            h += 1
        s = bg.batched_value(2.0)  # a new tensor eagerly: its own to change
        s += 1
    assert bg.compute(s).item() == 3.0


def test_metadata_answered_as_by_tensors() -> None:
    x = torch.randn(5)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        assert h.ndimension() == x.ndimension()
        assert (h.get_device(), h.is_cuda, h.is_cpu, h.is_meta) == (
            x.get_device(), x.is_cuda, x.is_cpu, x.is_meta)
        assert h.is_signed() == x.is_signed()
        dist = torch.distributions.Categorical(logits=h, validate_args=False)
        log_prob = dist.logits
    torch.testing.assert_close(
        bg.compute(log_prob), torch.distributions.Categorical(logits=x).logits)


def test_shifts_record() -> None:
    x = torch.tensor([1, 2, 8])
    with bg.BatchingPolicy():
        h = bg.batched_value(x)
        out = [h << 2, h >> 1, 1 << h, 64 >> h]
    for got, want in zip(bg.compute(out), [x << 2, x >> 1, 1 << x, 64 >> x], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("call", ["torch.equal", "method equal", "allclose"])
def test_python_valued_functions_are_not_known_while_recording(call: str) -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2))
        with pytest.raises(TypeError, match="not known while recording"):
            if call == "torch.equal":
                torch.equal(h, h)
            elif call == "method equal":
                h.equal(h)
            else:
                torch.allclose(h, h)


@pytest.mark.parametrize("make", ["row", "view", "transpose"])
def test_changing_a_view_in_place_is_refused(make: str) -> None:
    # Eagerly the change would reach the value it views too; batched values share none.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2, 2)) * 1
        target = {"row": lambda: h[0], "view": lambda: h.view(4), "transpose": lambda: h.t()}[make]()
        with pytest.raises(TypeError, match="view of another value"):
            target += 1


@pytest.mark.parametrize("make", ["contiguous", "row", "view of a view"])
def test_views_of_a_changed_value_read_afterwards_are_refused(make: str) -> None:
    # h changes in place; a value sharing its memory eagerly changes with it, so the
    # calls reading it before the change are exact and those after are refused.
    def views(h: Any) -> Any:
        return {"contiguous": lambda: h.contiguous(), "row": lambda: h[1],
                "view of a view": lambda: h.t()[0]}[make]()

    x = torch.arange(4.0).view(2, 2)
    eager = x * 1
    eager_before = views(eager) * 3
    eager += 1
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        other = views(h)
        before = other * 3  # read before the change: the old value, as eagerly
        h += 1
        after = other * 2
        got, got_before = bg.compute([h, before])
        with pytest.raises(TypeError, match=r"changed in place by `\+=`.*reads it"):
            bg.compute(after)
        with pytest.raises(TypeError, match=r"changed in place by `\+=`.*asked for"):
            bg.compute(other)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got_before, eager_before)


def test_reading_a_view_before_changing_its_base_works_as_eagerly() -> None:
    x = torch.arange(6.0).view(2, 3)
    eager = x * 1
    eager[0] = eager[0] + 10
    eager += eager[1] * 1  # (eager += eager[1] itself is refused by torch: overlap)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        h[0] = h[0] + 10  # y[0] = y[0] + v: the view is read before the change
        h += h[1] * 1
        got = bg.compute(h)
    torch.testing.assert_close(got, eager)


def test_a_copy_may_be_changed_and_leaves_the_original_alone() -> None:
    # (reshape counts as a view: whether it copies depends on strides, which
    # per-example values do not have; torch tells not to rely on either.)
    x = torch.arange(6.0).view(2, 3)
    with bg.BatchingPolicy():
        h = bg.batched_value(x) * 1
        copy = h.clone()
        copy += 1
        got = bg.compute([h, copy])
    torch.testing.assert_close(got[0], x)
    torch.testing.assert_close(got[1], x + 1)


def test_a_tensor_changed_in_place_with_a_recorded_value_is_refused() -> None:
    # Eagerly `t += h` changes t itself (and every name bound to it); torch turned the
    # refusal into NotImplemented, and Python silently rebound t to t + h.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(3)) * 1
        t = torch.ones(3)
        with pytest.raises(RuntimeError, match=r"t \+= h"):
            t += h
        with pytest.raises(RuntimeError, match="would change a tensor in place"):
            t.mul_(h)
    assert torch.equal(t, torch.ones(3))


_CHANGES: dict[str, Callable[[Any, Any], Any]] = {
    "add_": lambda t, g: t.add_(g),
    "mul_": lambda t, g: t.mul_(g),
    "copy_": lambda t, g: t.copy_(g),
    "addcmul_": lambda t, g: t.addcmul_(g, g, value=0.5),
    "+=": operator.iadd,
}


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # addcmul_ through vmap
@pytest.mark.parametrize("change", sorted(_CHANGES))
def test_a_tensor_is_refused_the_change_a_handle_of_its_spec_made_before(change: str) -> None:
    # The signature of `h.add_(g)` (recorded on a copy, h rebound to it) is the one of
    # `t.add_(g)` for a tensor t of h's spec: the cached entry took t for a handle and
    # failed with "'Tensor' object has no attribute '_graph'" (found by the DAG fuzzer).
    fn = _CHANGES[change]
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(3, 4)) * 1
        g = bg.batched_value(torch.ones(3, 4)) * 2
        fn(h, g)
        t = torch.ones(3, 4)
        with pytest.raises(RuntimeError, match="would change a tensor in place"):
            fn(t, g)
        got = bg.compute(h)
    assert torch.equal(t, torch.ones(3, 4))
    want = torch.ones(3, 4)
    fn(want, torch.ones(3, 4) * 2)
    torch.testing.assert_close(got, want)


def test_the_refusal_of_copy_into_a_tensor_advises_code_that_records() -> None:
    # t.copy_(h) advised `t = torch.copy(t, ...)`, which torch has not; the form it
    # advises now records, and gives what copy_ makes eagerly.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.tensor([1.5, -2.0])) * 1
        t = torch.zeros(3, 2, dtype=torch.float64)
        with pytest.raises(RuntimeError, match=re.escape("t = h.expand_as(t).to(t.dtype)")) as err:
            t.copy_(h)
        assert "torch.copy" not in str(err.value)
        made = h.expand_as(t).to(t.dtype)
        got = bg.compute(made)
    torch.testing.assert_close(got, torch.zeros(3, 2, dtype=torch.float64).copy_(torch.tensor([1.5, -2.0])))


def test_item_assignment_into_a_tensor_with_a_recorded_index_or_value_is_refused() -> None:
    # `t[h] = v` recorded a __setitem__ call that returned None and was never computed:
    # t stayed as it was, silently, where eagerly it changes. `t[i] = h` failed with a
    # misleading "returned NoneType". Both now say what happens and what to write.
    lookup = bg.batched_func(torch.argmax)
    with bg.BatchingPolicy():
        index = lookup(torch.tensor([0.0, 3.0, 1.0]))
        value = bg.batched_value(torch.tensor(5.0)) * 1
        t = torch.zeros(3)
        with pytest.raises(RuntimeError, match=r"t\[index\] = value .* would change the tensor t"):
            t[index] = 1.0
        with pytest.raises(RuntimeError, match=r"t = t.index_put\(\(index,\), value\)"):
            t[0] = value
        # The out-of-place form the message suggests records, and equals eager.
        made = t.index_put((index,), value)
        got = bg.compute(made)
    assert torch.equal(t, torch.zeros(3))
    torch.testing.assert_close(got, torch.tensor([0.0, 5.0, 0.0]))


def _set_items(x: Any) -> Any:
    """Item assignments of every kind of index and value, on a copy of ``x`` (2-d)."""
    y = x * 1
    kept = [y]  # bound to another name before the changes: sees them, as eagerly
    before = y.sum()  # recorded before: the old value
    y[0] = 5.0
    y[:, 1] = x[:, 2] * 3  # a recorded value
    y[..., -1] = x.sum()  # broadcast
    y[x[:, 0].argmax()] = x[1]  # a recorded index
    y[[0, 2]] = x[1]
    y[x > 0.5] = 0.25  # a recorded boolean mask (vmap refuses it: one call at a time)
    return before, kept[0], y


def test_item_assignment_changes_every_name_bound_to_the_value() -> None:
    # `h[i] = v` used to fail with Python's "'ResultHandle' object does not support
    # item assignment".
    torch.manual_seed(0)
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    eager = [_set_items(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [_set_items(bg.batched_value(x)) for x in xs]
    got = bg.compute(handles)
    for values, want in zip(got, eager, strict=True):
        for g, w in zip(values, want, strict=True):
            torch.testing.assert_close(g, w)

    def loss(values: list[Any]) -> Any:
        return sum((i + 1) * sum(v.sum() * (k + 1) for k, v in enumerate(vs))
                   for i, vs in enumerate(values))

    for g, w in zip(torch.autograd.grad(loss(got), xs), torch.autograd.grad(loss(eager), xs),
                    strict=True):
        torch.testing.assert_close(g, w)


def test_item_assignment_keeps_the_dtype_and_refuses_what_eager_code_shares() -> None:
    with bg.BatchingPolicy():
        x = bg.batched_value(torch.ones(2, 3))
        ints = (x * 2).long()
        ints[0, 0] = 2.7  # cast to the value's dtype, as eagerly
        with pytest.raises(TypeError, match=r"h\[index\] = value.*bg.batched_value"):
            x[0] = 1.0
        y = x * 1
        with pytest.raises(bg.ShapeMismatchError, match="index 5 is out of bounds"):
            y[5] = 1.0
        row = y[0]
        y[0] = 2.0  # eagerly row changes too: it is refused where it is read afterwards
    assert ints.dtype == torch.long
    torch.testing.assert_close(bg.compute(ints), torch.tensor([[2, 2, 2], [2, 2, 2]]))
    torch.testing.assert_close(bg.compute(y), torch.tensor([[2.0] * 3, [1.0] * 3]))
    with pytest.raises(TypeError, match=r"changed in place by `h\[index\] = value`"):
        bg.compute(row)


def _with_numpy(x: Any) -> Any:
    import numpy as np

    y = x * 1
    y += np.full(3, 0.5, dtype=np.float32)  # keeps y's dtype, as on a tensor
    return (x + np.arange(3.0), np.float64(2.0) * x, x * np.float32(3.0),
            np.int64(2) + x, y)


# Torch's own, from the eager run's NumPy scalar times a tensor.
@pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context")
def test_numpy_operands_act_as_on_tensors() -> None:
    # Used to fail with "a NumPy array of <ResultHandle ...> is not known while
    # recording": torch.add refuses an array (a tensor's `+` takes it), and NumPy
    # scalars tried to convert the handle instead of leaving it the operation.
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy():
        handles = [_with_numpy(bg.batched_value(x)) for x in xs]
    for got, x in zip(bg.compute(handles), xs, strict=True):
        for g, w in zip(got, _with_numpy(x), strict=True):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w)


@pytest.mark.parametrize("make", ["tensor", "as_tensor"])
def test_torch_tensor_of_a_handle_says_what_to_use_instead(make: str) -> None:
    # torch.as_tensor(h) of a (3,) handle said only "len() of a 0-d tensor handle"
    # (torch had read it as a sequence down to its items).
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(3)) * 2
        with pytest.raises(TypeError, match=r"torch.as_tensor\(...\) read their data as "
                           r"\(nested\) sequences.*h.to\(dtype\)"):
            getattr(torch, make)(h)


def test_changing_a_value_whose_view_was_computed_is_refused() -> None:
    # The view's value may be held by the caller; eagerly it would change too.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2, 2)) * 1
        row = h[0]
        held = bg.compute(row)
        with pytest.raises(TypeError, match="handed out already"):
            h += 1
    torch.testing.assert_close(held, torch.ones(2))


def test_a_call_on_a_changed_view_is_not_merged_with_the_same_call_made_before() -> None:
    # Merged, the call recorded after the change would be the one made before it,
    # which read the old value, and no refusal would see it.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)) * 1
        row = h[0]
        before = row * 2
        h += 1
        after = row * 2
        assert after.node != before.node
        torch.testing.assert_close(bg.compute(before), torch.tensor(2.0))
        with pytest.raises(TypeError, match=r"changed in place by `\+=`.*reads it"):
            bg.compute(after)


def test_changing_a_handle_whose_value_was_handed_out_is_refused() -> None:
    # Eagerly the awaited (or computed) tensor is the value itself and changes with
    # it; the recorded change never reached it: the held value stayed, silently.
    async def example(x: torch.Tensor) -> Any:
        y = bg.batched_value(x) * 1
        held = await bg.value(y)
        y += 1
        return held

    with pytest.raises(bg.CoroutineExampleError, match="already handed out"):
        bg.run_all([example(torch.zeros(2))])
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.zeros(2)) * 1
        held = bg.compute(h)
        with pytest.raises(TypeError, match="already handed out"):
            h += 1
        held += 1  # changing the held tensor is how to do it: later calls read it
        torch.testing.assert_close(bg.compute(h * 2), torch.full((2,), 2.0))
