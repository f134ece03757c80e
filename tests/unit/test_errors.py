"""Bad input gets errors that name the call, the values and what to do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg


def test_mixing_handles_of_two_policies() -> None:
    lin = bg.batched_func(nn.Linear(2, 2))
    with bg.BatchingPolicy(name="first"):
        a = lin(torch.ones(2))
        with bg.BatchingPolicy(name="second"), pytest.raises(
            bg.PolicyMismatchError, match=r"recorded by policy 'first'.*policy 'second'"
        ):
            lin(a)


def test_operators_and_methods_on_a_handle_of_another_policy() -> None:
    with bg.BatchingPolicy(name="outer"):
        a = bg.batched_value(torch.ones(2)) * 2
        for record in (lambda: a.tanh(), lambda: a + 1, lambda: torch.exp(a)):
            with bg.BatchingPolicy(name="inner"), pytest.raises(
                bg.PolicyMismatchError, match=r"policy 'outer'.*policy 'inner'"
            ):
                record()
        b = a.tanh()  # back in its own policy: recorded (the method is cached by now)
    torch.testing.assert_close(bg.compute(b), torch.tanh(torch.full((2,), 2.0)))


def test_computing_handles_of_two_policies_together() -> None:
    with bg.BatchingPolicy(name="p1"):
        a = bg.batched_value(torch.ones(2)) + 1
    with bg.BatchingPolicy(name="p2") as p2:
        b = bg.batched_value(torch.ones(2)) + 2
    with pytest.raises(bg.PolicyMismatchError, match=r"belongs to policy 'p1', not 'p2'"):
        p2.compute([b, a])


def test_using_a_handle_after_its_policy_closed() -> None:
    with bg.BatchingPolicy():
        a = bg.batched_value(torch.ones(2)) * 2
    with pytest.raises(bg.PolicyClosedError, match=r"`with` block has ended.*Compute it first"):
        _ = a + 1
    with pytest.raises(bg.PolicyClosedError, match="has ended"):
        torch.tanh(a)
    # Computing after the block is fine.
    torch.testing.assert_close(bg.compute(a), torch.full((2,), 2.0))


def test_shape_mismatch_is_caught_when_recorded() -> None:
    lin = bg.batched_func(nn.Linear(4, 3))
    with bg.BatchingPolicy(), pytest.raises(
        bg.ShapeMismatchError,
        match=r"Linear\(in_features=4, out_features=3, bias=True\) does not accept these "
        r"per-example inputs \(input 0: \(5,\) float32 on cpu\).*no batch\s+dimension",
    ):
        lin(torch.randn(5))


def test_exception_inside_a_batched_call_names_key_and_example() -> None:
    embed = bg.batched_func(nn.Embedding(10, 2))
    tokens = [1, 2, 50, 3]  # 50 is out of range; only running it can tell
    with bg.BatchingPolicy():
        hs = [embed(bg.batched_value(t)) for t in tokens]
    with pytest.raises(
        bg.BatchedCallError,
        match=r"StackKey\[Embedding\(10, 2\)\] raised in a batched call of 4 calls "
        r"\(examples 0, 1, 2, 3\): IndexError.*call of example 2 \(row 2\) fails too",
    ):
        bg.compute(hs)


@pytest.mark.parametrize("shape", [(), (3,)])
def test_a_call_run_one_at_a_time_names_the_example_that_fails(shape: tuple[int, ...]) -> None:
    # combine="list" rules (UnbatchedKey) take a list per input: the diagnosis ran
    # each example with its bare value, so a 0-d one failed with "invalid index of a
    # 0-dim tensor" blamed on example 0, and a (3,) one ran on its first element.
    def checked(x: torch.Tensor) -> torch.Tensor:
        if x.shape != shape:
            raise RuntimeError(f"got shape {tuple(x.shape)}")
        if float(x.sum()) > 10:
            raise ValueError("too big")
        return x * 2

    site = bg.batched_func(checked)
    values = [torch.full(shape, v) for v in (1.0, 20.0, 0.5)]
    with bg.BatchingPolicy(rules={checked: bg.UnbatchedKey}):
        hs = [site(bg.batched_value(v)) for v in values]
    with pytest.raises(
        bg.BatchedCallError,
        match=r"ValueError: too big\. Run alone, the call of example 1 \(row 1\) fails too: "
        r"ValueError: too big$",
    ):
        bg.compute(hs)


def test_non_tensor_result_is_refused() -> None:
    count = bg.batched_func(lambda t: t.shape[0])
    with bg.BatchingPolicy(), pytest.raises(
        bg.NotATensorError, match=r"returned int; a recorded call must return a tensor"
    ):
        count(torch.ones(3))


def test_a_non_tensor_in_a_tuple_result_is_named() -> None:
    extra = bg.batched_func(lambda t: (t, None, 3))
    with bg.BatchingPolicy(), pytest.raises(
        bg.NotATensorError, match=r"returned tuple holding int at \[2\];"
    ):
        extra(torch.ones(3))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dedupe": "no"}, r"dedupe must be True or False, got 'no'"),
    ({"dedupe": 0}, r"dedupe must be True or False, got 0"),
    ({"name": 3}, r"name must be a string .* got 3"),
])
def test_bad_policy_settings_are_refused_where_given(kwargs: dict[str, Any], message: str) -> None:
    # dedupe="no" merged identical calls (a non-empty string is true), silently.
    with pytest.raises(TypeError, match=message):
        bg.BatchingPolicy(**kwargs)


def test_unknown_scheduler() -> None:
    with pytest.raises(ValueError, match=r"unknown scheduler 'fifo'; choose one of"):
        bg.BatchingPolicy(scheduler="fifo")


def test_unpacking_an_unknown_structure() -> None:
    f = bg.batched_func(lambda t: (t, t) if t.sum().item() > 0 else (t, -t))
    with bg.BatchingPolicy():
        h = f(torch.ones(2))
        with pytest.raises(TypeError, match="only known once it runs"):
            _a, _b = h
        g = bg.batched_func(lambda pair: pair[0] + pair[1])(h)
    first, second = bg.compute(h)
    torch.testing.assert_close(first, torch.ones(2))
    torch.testing.assert_close(second, torch.ones(2))
    torch.testing.assert_close(bg.compute(g), torch.full((2,), 2.0))


def test_in_place_operations_on_a_handle_shared_with_other_tensors_are_refused() -> None:
    # In-place calls on a handle record on a copy (tests/unit/test_in_place_on_copy.py),
    # except where eagerly the change would reach other tensors too.
    with bg.BatchingPolicy():
        x = bg.batched_value(torch.ones(2))
        with pytest.raises(TypeError, match=r"relu_.*tensor given to bg\.batched_value"):
            x.relu_()
        a = x * 2
        view = a[0]
        with pytest.raises(TypeError, match=r"add_.*view of another value \(getitem\)"):
            view.add_(1)
        a.add_(1)  # its view, read afterwards, is refused at compute
        bg.batched_func(nn.ReLU(inplace=True))(a)
        b = a.add(1)  # the out-of-place form records
    torch.testing.assert_close(bg.compute(b), torch.full((2,), 4.0))
    with pytest.raises(TypeError, match=r"changed in place by `Tensor\.add_`.*it is asked for"):
        bg.compute(view)


def test_an_in_place_layer_inside_a_recorded_module_acts_on_its_own_values() -> None:
    inner = bg.batched_func(nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True)))
    with bg.BatchingPolicy():
        b = inner(bg.batched_value(torch.ones(2)))
    assert bg.compute(b).shape == (2,)


def test_a_call_writing_into_an_out_tensor_is_refused() -> None:
    """Eagerly `out=` fills the caller's tensor; a recorded call never would."""
    out = torch.zeros(2)
    with bg.BatchingPolicy():
        a = bg.batched_value(torch.ones(2))
        for _ in range(2):  # refused every time: nothing is cached for the signature
            with pytest.raises(TypeError, match=r"tanh\(\.\.\., out=\.\.\.\) writes"):
                torch.tanh(a, out=out)
        with pytest.raises(TypeError, match=r"add\(\.\.\., out=\.\.\.\)"):
            torch.add(a, 1.0, out=out)
        assert bg.compute(torch.tanh(a, out=None)).shape == (2,)  # out=None is no out
        # A function's own parameter named out, not a tensor, is just an argument.
        scaled = bg.batched_func(lambda x, out=1.0: x * out)
        assert bg.compute(scaled(a, out=3.0)).tolist() == [3.0, 3.0]


def test_a_reused_input_buffer_changed_before_compute_is_refused() -> None:
    lin = bg.batched_func(nn.Linear(3, 2))
    buffer = torch.zeros(3)
    with torch.no_grad(), bg.BatchingPolicy():
        handles = []
        for i in range(3):
            buffer[0] = float(i)  # eagerly each call saw its own value; batched, the last
            handles.append(lin(buffer))
        with pytest.raises(bg.ConstantChangedError, match=r"changed in place.*clone"):
            bg.compute(handles)


def test_a_constant_changed_only_after_compute_is_fine() -> None:
    lin = bg.batched_func(nn.Linear(3, 2))
    x = torch.zeros(3)
    with torch.no_grad(), bg.BatchingPolicy():
        first = bg.compute(lin(x))
        x.add_(1.0)  # computed already: nothing reads it again
        second = bg.compute(lin(x))  # recorded anew, with its new version
    assert not torch.equal(first, second)


def test_a_coroutine_that_changes_its_constant_fails_alone() -> None:
    lin = bg.batched_func(nn.Linear(3, 2))

    async def example(i: int, change: bool) -> torch.Tensor:
        x = torch.full((3,), float(i))  # distinct values: not merged with the others
        h = lin(x)
        if change:
            x.mul_(2.0)  # before the step computes it
        return await bg.value(h)

    with torch.no_grad():
        got = bg.run_all([example(0, False), example(1, True), example(2, False)],
                         return_exceptions=True)
    assert isinstance(got[1], bg.ConstantChangedError)
    assert isinstance(got[0], torch.Tensor) and isinstance(got[2], torch.Tensor)


@pytest.mark.parametrize("read", [
    int, float, complex, lambda h: h.item(), lambda h: h.tolist(), lambda h: h.numpy(),
    lambda h: [0, 1, 2][h], lambda h: __import__("numpy").asarray(h), lambda h: f"{h:.2f}",
])
def test_reading_a_python_value_of_a_handle_tells_how(read: Any) -> None:
    """The usual slip in a decoder, `tok = int(logits.argmax())` without an await."""
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.tensor(1))
        with pytest.raises(TypeError, match=r"not known while recording.*await bg.value"):
            read(h)


@pytest.mark.parametrize("read", [
    bool, int, float, lambda h: h.item(), lambda h: h.tolist(), lambda h: [0, 1][h],
    lambda h: 1 if h > 0 else 0, lambda h: h.value,
])
def test_reading_a_value_before_compute_is_a_not_computed_error(read: Any) -> None:
    """The README's Errors section names NotComputedError for a value read before
    compute; `float(h)`, `if h > 0:` and `h.item()` raised a bare TypeError, which
    `except bg.NotComputedError` (or `except bg.BatchgraphError`) did not catch. It
    stays a TypeError, as Python's protocols and torch's argument parsing expect."""
    with bg.BatchingPolicy():
        # (A recorded call: bg.batched_value(t).value is t itself, known at once.)
        h = bg.batched_value(torch.tensor(1)) + 0
        with pytest.raises(bg.NotComputedError) as caught:
            read(h)
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, bg.BatchgraphError)


@pytest.mark.parametrize("call", [
    lambda h: h.sum().backward(), lambda h: h.register_hook(print), lambda h: h.retain_grad(),
])
def test_autograd_on_a_handle_tells_to_compute_first(call: Any) -> None:
    """Before: recorded as a call, then refused by shape inference with an autograd
    error about its fake input ("element 0 of tensors does not require grad")."""
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2, requires_grad=True))
        with pytest.raises(TypeError, match=r"runs on computed values.*compute it first"):
            call(h)


def test_pickling_a_handle_says_why_not_and_copies_are_values() -> None:
    import copy
    import pickle

    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2))
        # Before: "cannot pickle 'weakref.ReferenceType' object", from deep inside.
        with pytest.raises(TypeError, match=r"cannot be pickled.*GraphCollate"):
            pickle.dumps([h])
        copied = copy.deepcopy({"state": [h, 1]})
        # A deep copy is a value of its own (tests/unit/test_handle_deepcopy.py); a
        # shallow one shares the value, as a tensor's does.
        assert copied["state"][0] is not h and copy.copy(h) is h
        torch.testing.assert_close(copied["state"][0], torch.ones(2))


def test_torch_tensor_of_handles_points_to_stack() -> None:
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2)).sum()
        with pytest.raises(TypeError, match=r"use torch\.stack\(\[\.\.\.\]\)"):
            torch.tensor([h, h])
        assert torch.stack([h, h]).shape == (2,)


def test_a_failing_call_is_shown_failing_as_eager_code_fails() -> None:
    # The call run alone was a batch of one through vmap, whose error names the
    # batch's dimensions: "index 7 is out of bounds for dimension 1" for an index
    # of the example's dimension 0.
    with bg.BatchingPolicy():
        table = bg.batched_value(torch.ones(2, 3))
        h = table[bg.batched_value(torch.tensor(7))]  # an index by a handle: vmap
    with pytest.raises(
        bg.BatchedCallError,
        match=r"Run alone, the call of example 0 \(row 0\) fails too: IndexError: index 7 "
        r"is out of bounds for dimension 0 with size 2$",
    ):
        bg.compute(h)


@pytest.mark.parametrize("thing", [3, "torch.tanh", None])
def test_batched_func_of_something_not_callable_is_refused_where_made(thing: Any) -> None:
    # Used to make a call site that failed only when called ("'int' object is not
    # callable", from inside a recorded call).
    with pytest.raises(TypeError, match=r"batched_func takes the function or nn.Module"):
        bg.batched_func(thing)


@pytest.mark.parametrize("method", ["is_contiguous", "stride", "storage_offset"])
def test_a_tensor_method_answering_a_python_value_says_to_compute_first(method: str) -> None:
    # Used to advise wrapping "the tensor work in a module or function that returns
    # tensors", which does not fit h.is_contiguous().
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(2, 3)) * 2
        with pytest.raises(bg.NotATensorError, match=r"a Python value: on a handle it is "
                           r"not known while recording.*Compute the handle first"):
            getattr(h, method)()


def _doubles_its_input(x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)  # eagerly the caller's tensor changes too
    return x.sum()


def test_a_function_changing_its_input_in_place_is_refused_where_recorded() -> None:
    # Used to record: the batched call doubled a gathered copy, so a later use of the
    # value (h + 0 below) read the old values where eager code read the doubled ones.
    site = bg.batched_func(_doubles_its_input)
    with bg.BatchingPolicy():
        h = torch.tanh(bg.batched_value(torch.ones(3))) * 1
        with pytest.raises(TypeError, match=r"_doubles_its_input changes its input 0 "
                           r"\(\(3,\) float32 on cpu\) in place.*x = x.clone\(\) first"):
            site(h)
    doubled_copy = bg.batched_func(lambda x: _doubles_its_input(x.clone()))
    with bg.BatchingPolicy():
        total = doubled_copy(bg.batched_value(torch.ones(3)))  # a copy: recorded
    torch.testing.assert_close(bg.compute(total), torch.tensor(6.0))


class _FailingKey(bg.StackKey):
    """A rule that fails on every batch, where the call itself runs."""

    def run(self, fn: Any, inputs: Any, size: int) -> Any:
        raise ValueError("this rule cannot batch")


def test_a_rule_failing_where_the_call_runs_eagerly_says_so() -> None:
    # The diagnosis ran a batch of one through the rule itself and, when the eager
    # call ran, reported the rule's own error as "the call fails too" (found while
    # fuzzing, where vmap failed on examples with no elements).
    site = bg.batched_func(torch.tanh)
    with bg.BatchingPolicy(rules={torch.tanh: _FailingKey}):
        hs = [site(bg.batched_value(torch.full((2,), v))) for v in (1.0, 2.0)]
    with pytest.raises(bg.BatchedCallError) as err:
        bg.compute(hs)
    message = str(err.value)
    assert "fails too" not in message
    assert "the call of example 0 (row 0) runs: the rule fails where eager code does not" in message
    assert "ValueError: this rule cannot batch" in message
    assert "bg.UnbatchedKey" in message


def test_a_call_run_alone_against_a_wrong_inference_blames_the_inference() -> None:
    # torch's fake run of x.nansum(dim=[]) keeps x's shape, its real run reduces all:
    # the call runs alone (UnbatchedKey), so the rule was blamed (and VmapKey advised)
    # for what only the recorded spec got wrong (found by the fuzzer).
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.ones(3, 4)).nansum(dim=[])
    with pytest.raises(bg.BatchedCallError) as err:
        bg.compute(h)
    message = str(err.value)
    assert "gave (3, 4) float32 on cpu when it was recorded" in message
    assert "x.nansum()" in message
    assert "batching rule" not in message and "VmapKey" not in message


def test_a_batched_call_s_error_ending_in_a_full_stop_is_not_followed_by_another() -> None:
    def checked(x: torch.Tensor) -> torch.Tensor:
        if float(x.sum()) > 10:
            raise ValueError("too big.")
        return x * 2

    site = bg.batched_func(checked)
    with bg.BatchingPolicy(rules={checked: bg.UnbatchedKey}):
        hs = [site(bg.batched_value(torch.full((2,), v))) for v in (1.0, 20.0)]
    with pytest.raises(bg.BatchedCallError) as caught:
        bg.compute(hs)
    assert "too big.. " not in str(caught.value)  # before: "ValueError: too big.. Run alone"
    assert "ValueError: too big. Run alone, the call of example 1" in str(caught.value)
