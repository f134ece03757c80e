"""The built-in batching rules keep each example's meaning in their corner cases.

Each case once gave a batched answer different from the eager one: silently (a
softmax across examples, an index taken for an int) or with an error where eager
code runs. ``tests/property/test_tensor_ops_property.py`` covers the same ground with
random programs; these are the named regressions.
"""

from __future__ import annotations

import warnings
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.errors import BatchedCallError
from batchgraph.keys import StackKey


def _batched(fn: Callable[..., Any], *columns: list[torch.Tensor]) -> tuple[list[Any], Any]:
    """``fn`` recorded on each example's values, computed; and the policy."""
    with bg.BatchingPolicy() as policy:
        handles = [fn(*map(bg.batched_value, row)) for row in zip(*columns)]
        return bg.compute(handles), policy


def _assert_equal_eager(fn: Callable[..., Any], *columns: list[torch.Tensor]) -> Any:
    got, policy = _batched(fn, *columns)
    for row, value in zip(zip(*columns), got):
        want = fn(*row)
        assert value.shape == want.shape
        torch.testing.assert_close(value, want, rtol=0, atol=0)
    return policy


SCALARS = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(5.0)]


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: torch.softmax(x, -1),  # was a softmax across the examples, silently
        lambda x: torch.log_softmax(x, 0),
        lambda x: x.sum(-1),
        lambda x: x.sum(0, keepdim=True),
        lambda x: x.argmax(-1),
        lambda x: x.cumsum(-1),
        nn.Softmax(dim=-1),  # the module's rule, as well as the function's
        bg.batched_func(nn.LogSoftmax(dim=-1)),
        lambda x: torch.stack([x, x * 2], -1),  # stack's dim counts its output's dims
    ],
)
def test_dim_ops_on_0d_values_act_per_example(fn: Callable[..., Any]) -> None:
    _assert_equal_eager(fn, SCALARS)


def test_index_by_a_1d_tensor_handle_is_not_taken_for_a_static_index() -> None:
    # The tensor index's placeholder (a NamedTuple) was read as the static index (1,).
    xs = [torch.randn(5, 3), torch.randn(5, 3)]
    idx = [torch.tensor([0, 2]), torch.tensor([3, 4])]
    _assert_equal_eager(lambda x, i: x[i], xs, idx)


@pytest.mark.parametrize(
    "fn",
    [
        lambda t, x, i, j: t[i],
        lambda t, x, i, j: t[i, :, j],
        lambda t, x, i, j: t[..., j],
        lambda t, x, i, j: t[i, None, j],
        lambda t, x, i, j: x[i],
        lambda t, x, i, j: x[i, 1:],
        lambda t, x, i, j: t[i][j],
        lambda t, x, i, j: t[i.to(torch.int32)],
    ],
)
def test_index_by_0d_integer_handles_has_a_known_shape(fn: Callable[..., Any]) -> None:
    # table[token] with a predicted token: its shape is known when recorded (so
    # later calls batch and the handle answers .shape), and the values are eager's.
    table = torch.randn(5, 4, 3)
    xs = [torch.randn(5, 3) for _ in range(4)]
    first = [torch.tensor(v) for v in (0, 3, 2, 1)]
    second = [torch.tensor(v) for v in (2, 0, 1, 1)]
    with bg.BatchingPolicy():
        h = fn(table, bg.batched_value(xs[0]), bg.batched_value(first[0]),
               bg.batched_value(second[0]))
        assert h.shape == fn(table, xs[0], first[0], second[0]).shape
    _assert_equal_eager(lambda x, i, j: fn(table, x, i, j), xs, first, second)


def test_index_by_a_0d_handle_batches_into_one_call() -> None:
    table = torch.randn(10, 4)
    tokens = [torch.tensor(v) for v in (3, 1, 4, 1, 5)]
    policy = _assert_equal_eager(lambda i: table[i], tokens)
    assert policy.stats.launches == 1  # one batched indexing (before: one per token)
    assert policy.stats.unbatched_calls == 0


def test_a_0d_bool_index_keeps_an_unknown_shape() -> None:
    # x[mask] has a data-dependent shape: not guessed, run per example.
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.randn(3))[bg.batched_value(torch.tensor(True))]
        assert h.spec is None


def test_results_keep_their_named_fields() -> None:
    xs = [torch.randn(3, 4) for _ in range(3)]
    with bg.BatchingPolicy():
        hs = [bg.batched_value(x) for x in xs]
        maxes = [h.max(-1) for h in hs]
        assert type(maxes[0]) is type(xs[0].max(-1))
        picked = [m.values + m.indices for m in maxes]  # the fields, as on tensors
        tops = [torch.topk(h, 2, dim=-1).indices for h in hs]
        got = bg.compute([maxes, picked, tops])
    for x, m, p, t in zip(xs, *got):
        want = x.max(-1)
        assert type(m) is type(want)
        torch.testing.assert_close(m.indices, want.indices)
        torch.testing.assert_close(p, want.values + want.indices)
        torch.testing.assert_close(t, torch.topk(x, 2, dim=-1).indices)


Pair = namedtuple("Pair", "low high")


def test_a_recorded_function_returning_a_list_or_namedtuple_returns_handles_so() -> None:
    as_list = bg.batched_func(lambda x: [x - 1, x + 1])
    as_pair = bg.batched_func(lambda x: Pair(x - 1, x + 1))
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.zeros(2))
        listed, paired = as_list(h), as_pair(h)
        assert type(listed) is list and type(paired) is Pair
        got = bg.compute([listed, paired])
    assert type(got[0]) is list and type(got[1]) is Pair
    torch.testing.assert_close(got[1].high, torch.ones(2))


def test_mask_and_integer_operators_record_as_on_tensors() -> None:
    def fn(x: Any) -> Any:
        ints = (x * 10).long()
        mask = ((x > 0) & (x < 1)) | ~(x > -0.5) ^ (x > 2)
        return (ints // 3 + 7 // (ints.abs() + 1) + ints % 4 + 5 % (ints.abs() + 1)).double() \
            + mask.double() + (+x)

    _assert_equal_eager(fn, [torch.randn(4, dtype=torch.float64) for _ in range(3)])


def test_a_rule_that_changes_an_examples_shape_fails_loudly() -> None:
    # Run as StackKey, x.sum(1) sums the wrong dimension of the batch: (B, 3) rows
    # where each call alone gives (2,). The executor checks every step's shapes.
    total = bg.batched_func(lambda x: x.sum(1))
    fn = total.fn
    with bg.BatchingPolicy(rules={fn: StackKey}):
        handles = [total(bg.batched_value(torch.randn(2, 3))) for _ in range(2)]
        with pytest.raises(BatchedCallError, match=r"per-example shape \(3,\).*returns \(2,\)"):
            bg.compute(handles)


def test_a_result_holding_none_returns_none_in_its_place() -> None:
    # nn.MultiheadAttention(..., need_weights=False) returns (out, None); such a
    # result was refused as "not a tensor".
    pair = bg.batched_func(lambda x: (x * 2, None, (x + 1, None)))
    xs = [torch.randn(3) for _ in range(3)]
    with bg.BatchingPolicy() as policy:
        outs = [pair(bg.batched_value(x)) for x in xs]
        assert outs[0][1] is None and outs[0][2][1] is None
        got = bg.compute(outs)
    assert policy.stats.launches == 1
    for x, (doubled, none, (plus, inner)) in zip(xs, got, strict=True):
        assert none is None and inner is None
        torch.testing.assert_close(doubled, x * 2)
        torch.testing.assert_close(plus, x + 1)


# vmap runs CPU attention through its (slower, correct) per-example fallback, and says so.
@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_attention_without_weights_matches_eager() -> None:
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    site = bg.batched_func(attention)
    xs = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(3, 4)]
    with bg.BatchingPolicy():
        outs = [site(*[bg.batched_value(x)] * 3, need_weights=False) for x in xs]
        got = bg.compute(outs)
    for x, (out, weights) in zip(xs, got, strict=True):
        want, _ = attention(x, x, x, need_weights=False)
        assert weights is None
        torch.testing.assert_close(out, want)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, c: x * c,  # float32 (3,) times a float64 0-d tensor is float32
        lambda x, c: torch.where(x > 0, x, c),
        lambda x, c: torch.maximum(x, c),
        lambda x, c: x > c,  # compared in float32, as eagerly
        lambda x, c: c * torch.ones(2),  # the 0-d handle itself
        lambda x, c: (x * 10).int() & c.long(),
        lambda x, c: x.to(c),  # a conversion takes c's dtype: no cast
        lambda x, c: (x * 10).int() + c.long() + 2.5,
    ],
)
def test_0d_inputs_keep_their_rank_in_type_promotion(fn: Callable[..., Any]) -> None:
    # Stacked, a 0-d input gains a dimension and would win the promotion.
    xs = [torch.randn(3) for _ in range(3)]
    cs = [torch.tensor(v, dtype=torch.float64) for v in (0.3, -1.5, 2.0)]
    got, _ = _batched(fn, xs, cs)
    for x, c, value in zip(xs, cs, got):
        want = fn(x, c)
        assert value.dtype == want.dtype
        torch.testing.assert_close(value, want, rtol=0, atol=0)


class _PromotingKey(StackKey):
    """A broken rule: its batched call comes out in float64."""

    def run(self, fn: Callable[..., Any], inputs: Any, size: int) -> Any:
        return super().run(fn, inputs, size).double()


def test_a_rule_that_changes_an_examples_dtype_fails_loudly() -> None:
    tanh = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy(rules={torch.tanh: _PromotingKey}):
        handles = [tanh(bg.batched_value(torch.randn(3))) for _ in range(2)]
        with pytest.raises(BatchedCallError, match=r"returned torch\.float64 .* returns torch\.float32"):
            bg.compute(handles)


def test_operators_answer_operands_they_do_not_take_as_tensors_do() -> None:
    t = torch.ones(2)
    with bg.BatchingPolicy():
        h = bg.batched_value(t)
        # A tensor compared with None (or a string) is unequal to it; not an error.
        assert (h == None) is False and (h != None) is True  # noqa: E711
        assert (None == h) is False and None not in [h]  # noqa: E711, SIM300 (reflected ==)
        with pytest.raises(TypeError, match="unsupported operand"):
            _ = h + "a"


@pytest.mark.parametrize(
    "fn",
    [
        # NumPy's ``axis=`` names ``dim`` eagerly; the rule added ``dim=`` beside it
        # and the batched call failed ("unexpected keyword argument 'axis'").
        lambda x: torch.cat([x, x * 2], axis=0),
        lambda x: torch.cat([x, x * 2], axis=-1),
        lambda x: torch.concat([x, x * 2], axis=1),
        lambda x: torch.concatenate([x, x * 2], axis=-2),
        lambda x: torch.stack([x, x * 3], axis=0),
        lambda x: torch.stack([x, x * 3], axis=-1),
        lambda x: torch.softmax(x, axis=0),
        lambda x: torch.log_softmax(x, axis=-1),
        lambda x: x.softmax(axis=1),
        lambda x: x.sum(axis=0, keepdims=True),
        lambda x: torch.logsumexp(x, axis=-1),
    ],
)
def test_axis_keyword_acts_as_dim(fn: Callable[..., Any]) -> None:
    xs = [torch.randn(2, 3, requires_grad=True) for _ in range(3)]
    weights = [torch.randn_like(fn(x)) for x in xs]
    got, policy = _batched(fn, xs)
    assert policy.stats.launches * 3 == policy.stats.nodes  # one call per op, all 3 examples
    grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), xs)
    for x, w, value, grad in zip(xs, weights, got, grads):
        want = fn(x)
        assert value.shape == want.shape
        torch.testing.assert_close(value, want, rtol=0, atol=0)
        (want_grad,) = torch.autograd.grad((want * w).sum(), [x])
        torch.testing.assert_close(grad, want_grad)


_SLICINGS: dict[str, Callable[[Any], Any]] = {
    "h[1:]": lambda h: h[1:],
    "h[..., :2]": lambda h: h[..., :2],
    "h[1:4:2, 0]": lambda h: h[1:4:2, 0],
    "h[-2:, :1]": lambda h: h[-2:, :1],
}


@pytest.mark.parametrize("name", sorted(_SLICINGS))
def test_slicing_batches_into_one_launch(name: str) -> None:
    # Slices are unhashable before Python 3.12: keyed as they were, every call (a new
    # slice object each time) was a key of its own and ran alone.
    index = _SLICINGS[name]
    xs = [torch.randn(5, 3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    with bg.BatchingPolicy() as policy:
        handles = [index(bg.batched_value(x)) for x in xs]
    got = bg.compute(handles)
    assert policy.stats.launches == 1  # one batched indexing (constants are not launches)
    for value, x in zip(got, xs):
        torch.testing.assert_close(value, index(x))
    # Each example's output weighs i + 1: under a plain sum every example's gradient
    # is the same mask of ones, and gradients sent to another example's rows matched.
    grads = torch.autograd.grad(sum((i + 1) * v.sum() for i, v in enumerate(got)), xs)
    for i, (g, x) in enumerate(zip(grads, xs, strict=True)):
        torch.testing.assert_close(g, torch.autograd.grad((i + 1) * index(x).sum(), x)[0])


@pytest.mark.parametrize(
    "fn",
    [lambda x: x.argmax(keepdim=True), lambda x: torch.argmin(x, keepdim=True)],
)
def test_a_call_vmap_batches_with_another_shape_runs_one_at_a_time(
    fn: Callable[..., Any],
) -> None:
    # Under vmap, argmax(keepdim=True) with no dim gives each example (1,), where
    # eagerly it is (1, 1): compute raised a BatchedCallError advising VmapKey, the
    # rule already in use. The record-time probe now compares shapes, and such a
    # call runs one call at a time, as vmap cannot batch it.
    _assert_equal_eager(fn, [torch.randn(2, 3) for _ in range(3)])


@pytest.mark.parametrize("other_shape", [(2, 3), (4, 1, 3), ()])
def test_a_conversion_to_a_tensor_of_another_rank_keeps_the_values_shape(
    other_shape: tuple[int, ...],
) -> None:
    # x.to(other) takes only other's dtype and device; ElementwiseKey padded x to
    # other's rank as for a broadcast, and the batch came out (1, 3) per example.
    xs = [torch.arange(3) + i for i in range(3)]
    others = [torch.randn(other_shape, dtype=torch.float64) for _ in range(3)]
    policy = _assert_equal_eager(lambda x, c: x.to(c), xs, others)
    assert policy.stats.launches <= 3  # the constants and one conversion


@pytest.mark.parametrize("module", [nn.Softmax, nn.LogSoftmax])
@pytest.mark.parametrize("new_dim", [0, 1, None])
def test_a_softmax_modules_dim_set_after_its_signature_was_cached_acts_per_example(
    module: Callable[..., nn.Module], new_dim: int | None
) -> None:
    # A call site keeps the key chosen for a signature (stacked, for a dim from the
    # end). Setting the module's dim to one from the front afterwards took the softmax
    # across the examples, silently; the dim is now read when the batch runs.
    layer = module(dim=-1)
    site = bg.batched_func(layer)
    xs = [torch.randn(2, 3) for _ in range(3)]
    with bg.BatchingPolicy():
        first = [site(bg.batched_value(x)) for x in xs]
    bg.compute(first)
    layer.dim = new_dim
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an implicit dim (None): torch warns, eagerly too
        with bg.BatchingPolicy() as policy:
            handles = [site(bg.batched_value(x)) for x in xs]
        eager = [layer(x) for x in xs]
        got = bg.compute(handles)
    assert policy.stats is not None and policy.stats.launches == 1
    for g, want in zip(got, eager, strict=True):
        torch.testing.assert_close(g, want)


def _zero_where_positive(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = x * 2
    out[mask] = 0.0  # vmap refuses a boolean mask on real tensors, not on fake ones
    return out


def test_a_call_vmap_refuses_only_on_real_tensors_runs_one_at_a_time() -> None:
    # The record-time probe (on fake tensors) passed, so compute raised
    # BatchedCallError ("vmap: We do not support batching operators that can support
    # dynamic shape"), adding that the call fails alone too, for code that runs eagerly.
    site = bg.batched_func(_zero_where_positive)
    torch.manual_seed(0)
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    for _ in range(2):  # and again, once the key knows
        with bg.BatchingPolicy() as policy:
            got = policy.compute([site(x, bg.batched_value(x) > 0) for x in xs])
        assert policy.stats.unbatched_callables == (
            "tests.unit.test_batching_rules._zero_where_positive",)
        want = [_zero_where_positive(x, x > 0) for x in xs]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
        loss = sum((i + 1) * g.sum() for i, g in enumerate(got))
        eager_loss = sum((i + 1) * w.sum() for i, w in enumerate(want))
        for g, w in zip(torch.autograd.grad(loss, xs), torch.autograd.grad(eager_loss, xs),
                        strict=True):
            torch.testing.assert_close(g, w)


def test_a_call_failing_alone_too_still_names_the_batch_and_the_example() -> None:
    def bad_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = x * 2
        out[mask] = torch.ones(2)  # eagerly fails too (the count of True differs)
        return out

    site = bg.batched_func(bad_mask)
    with bg.BatchingPolicy() as policy:
        hs = [site(x, bg.batched_value(x) > 0) for x in [torch.ones(3), -torch.ones(3)]]
    with pytest.raises(bg.BatchedCallError, match=r"raised in a batched call of 2 calls.*"
                       r"Run alone, the call of example 0 \(row 0\) fails too"):
        policy.compute(hs)


def _rows_gathered_in_a_loop(x: Any) -> Any:
    acc = torch.empty(0, dtype=x.dtype)  # torch.cat skips a 1-d empty input (legacy)
    for i in range(x.shape[0]):
        acc = torch.cat([acc, x[i][None] * (i + 1)])
    return acc


def test_rows_gathered_by_cat_from_an_empty_tensor_match_eager() -> None:
    # The first cat, of the (0,) start and a (1, 4) row, batched by DimArgKey as
    # (B, 0) and (B, 1, 4), failed at compute: "Tensors must have same number of
    # dimensions: got 2 and 3". It now runs through vmap, which skips it as torch does.
    xs = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    policy = _assert_equal_eager(_rows_gathered_in_a_loop, xs)
    assert policy.stats.unbatched_calls == 0


def _set_to_ones(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.set_(torch.ones(x.shape))
    return x + y


def _set_to_storage(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y.set_(torch.arange(3.0).untyped_storage(), 0, x.shape, (0, 1))
    return x * y


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("fn", [_set_to_ones, _set_to_storage])
def test_a_function_pointing_a_tensor_elsewhere_with_set_matches_eager(
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    # Under vmap, set_ points one example's slice of the batch elsewhere, and the
    # batch kept its values with no error: y read as x's copy.
    xs = [torch.arange(6.0).view(2, 3) + i for i in range(3)]
    got, policy = _batched(bg.batched_func(fn), xs)
    for x, value in zip(xs, got, strict=True):
        torch.testing.assert_close(value, fn(x))
    assert policy.stats is not None and policy.stats.unbatched_calls == 3


@pytest.mark.parametrize(("base", "dim", "index"), [((2, 3), 0, 1), ((2, 3), -1, 0), ((4,), 0, -1)])
@pytest.mark.parametrize("method", [False, True])
def test_select_scatter_gradients_match_eager(
    base: tuple[int, ...], dim: int, index: int, method: bool,
) -> None:
    # Through vmap, select_scatter's backward doubled the gradient of src.
    def scatter(b: Any, s: Any) -> Any:
        return b.select_scatter(s, dim, index) if method else torch.select_scatter(
            b, s, dim=dim, index=index)

    torch.manual_seed(0)
    src = list(torch.empty(base).select(dim, 0).shape)
    bases = [torch.randn(base, requires_grad=True) for _ in range(3)]
    srcs = [torch.randn(src, requires_grad=True) for _ in range(3)]
    got, _ = _batched(scatter, bases, srcs)
    eager = [scatter(b, s) for b, s in zip(bases, srcs, strict=True)]
    weights = [torch.randn(base) for _ in range(3)]
    leaves = [*bases, *srcs]
    want = torch.autograd.grad(sum((e * w).sum() for e, w in zip(eager, weights)), leaves)
    grads = torch.autograd.grad(sum((g * w).sum() for g, w in zip(got, weights)), leaves)
    for value, expected in zip(got, eager, strict=True):
        torch.testing.assert_close(value, expected)
    for grad, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(grad, expected)
