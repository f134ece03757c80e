"""assert_batched_matches_eager compares every kind of result a user's model returns:
dataclasses, plain values, complex tensors, outputs without autograd graph, and the
results of coroutine (``async def``) examples run by ``bg.run_all``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg
from batchgraph.testing import assert_batched_matches_eager


class FlippedKey(bg.StackKey):
    """A broken rule: example i gets example B-1-i's result."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        return super().run(fn, inputs, size).flip(0)


@dataclasses.dataclass
class Encoded:
    hidden: Any
    length: int


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)

    def encode(self, x: torch.Tensor) -> Encoded:
        return Encoded(torch.tanh(self.lin(x)), 3)

    def frozen(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.lin(x)

    def spectrum(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(self.lin(x).reshape(2, 2))

    async def pick(self, x: torch.Tensor) -> tuple[Any, int]:
        h = self.lin(x)
        best = int(await bg.value(h.argmax()))  # a decision on a computed value
        return h * best, best


def _model() -> Model:
    torch.manual_seed(0)
    return Model().double()


def _examples(n: int = 5) -> list[torch.Tensor]:
    return [torch.randn(3, dtype=torch.float64) for _ in range(n)]


def test_dataclass_outputs_are_compared() -> None:
    # Before, a dataclass result had no leaf: nothing was compared, and with
    # check_gradients=False a rule that swaps examples passed.
    model = _model()
    report = assert_batched_matches_eager(model.encode, _examples(), rtol=0, atol=1e-12)
    assert (report.outputs_compared, report.gradients_compared) == (10, 2)
    with pytest.raises(AssertionError, match=r"example 0: output\.hidden differs"):
        assert_batched_matches_eager(
            model.encode, _examples(), check_gradients=False, rules={nn.Linear: FlippedKey}
        )


def test_outputs_without_autograd_graph_compare_no_gradient() -> None:
    # Before: "RuntimeError: element 0 of tensors does not require grad" from autograd.
    report = assert_batched_matches_eager(_model().frozen, _examples(), rtol=0, atol=1e-12)
    assert (report.outputs_compared, report.gradients_compared) == (5, 0)


def test_complex_outputs_have_their_gradients_compared() -> None:
    # Before: "no floating-point output to differentiate ... returns only integers".
    model = _model()
    report = assert_batched_matches_eager(model.spectrum, _examples(), rtol=0, atol=1e-12)
    assert report.gradients_compared == 2


def test_coroutine_examples_run_through_run_all() -> None:
    # Before, a coroutine function's results were coroutine objects: nothing compared.
    model = _model()
    report = assert_batched_matches_eager(model.pick, _examples(), rtol=0, atol=1e-12)
    assert (report.outputs_compared, report.gradients_compared) == (10, 2)
    assert report.stats is not None


def test_coroutine_examples_batched_wrongly_fail() -> None:
    model = _model()
    with pytest.raises(AssertionError, match=r"example 0: output\[[01]\] differs"):
        assert_batched_matches_eager(model.pick, _examples(), rules={nn.Linear: FlippedKey})


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
)
def test_plain_values_are_compared(eager_tokens: list[int], other_tokens: list[int]) -> None:
    # A decoder's result is the tokens it chose: a batched run that chose others fails,
    # naming where the two first part (another token, or another length).
    calls = iter([eager_tokens, other_tokens])
    scale = bg.batched_func(torch.mul)

    def decode(x: torch.Tensor) -> tuple[Any, list[int]]:
        return scale(x, 2.0), next(calls)

    x = torch.randn(3)
    if eager_tokens == other_tokens:
        assert assert_batched_matches_eager(decode, [x]).outputs_compared == (
            1 + len(eager_tokens)
        )
        return
    with pytest.raises(AssertionError, match=r"example 0: output\[1\]") as caught:
        assert_batched_matches_eager(decode, [x])
    message = str(caught.value)
    assert "differs" in message or "structure" in message


def test_plain_numbers_match_within_the_tolerances_and_nan_matches_nan() -> None:
    values = iter([(1.0, float("nan")), (1.0 + 1e-9, float("nan"))])
    tanh = bg.batched_func(torch.tanh)

    def fn(x: torch.Tensor) -> tuple[Any, float, float]:
        close, nan = next(values)
        return tanh(x), close, nan

    report = assert_batched_matches_eager(fn, [torch.randn(2)], check_gradients=False)
    assert report.outputs_compared == 3


def test_a_function_that_is_a_coroutine_for_some_examples_is_refused() -> None:
    async def later(x: torch.Tensor) -> torch.Tensor:
        return x

    def mixed(x: torch.Tensor) -> Any:
        return later(x) if x.dim() else x

    with pytest.raises(TypeError, match=r"returned a coroutine for example 1 but not for example 0"):
        assert_batched_matches_eager(mixed, [torch.tensor(1.0), torch.ones(2)])


def test_a_coroutine_that_awaits_something_else_is_refused() -> None:
    class Later:
        def __await__(self):  # type: ignore[no-untyped-def]
            yield None

    async def sleepy(x: torch.Tensor) -> torch.Tensor:
        await Later()
        return x

    with pytest.raises(TypeError, match=r"example 0: the coroutine suspended when run eagerly"):
        assert_batched_matches_eager(sleepy, [torch.randn(2)])


def test_no_examples_warns_that_nothing_was_compared() -> None:
    # Before, an empty list (an exhausted generator) passed silently, comparing nothing.
    model = _model()
    with pytest.warns(UserWarning, match=r"got no examples, so it compared nothing"):
        report = assert_batched_matches_eager(model.encode, iter([]))
    assert report.outputs_compared == 0


class DoubledGradientKey(bg.StackKey):
    """A broken rule: right values, twice the gradient."""

    def run(self, fn, inputs, size):  # type: ignore[no-untyped-def]
        out = super().run(fn, inputs, size)
        return out * 2 - out.detach()


class Service:
    """A user's object holding the model: its methods are neither the module's nor
    closures over it."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def run(self, x: torch.Tensor) -> Encoded:
        return self.model.encode(x)

    def __call__(self, x: torch.Tensor) -> Encoded:
        return self.model.encode(x)


@pytest.mark.parametrize("how", ["method", "callable object"])
def test_gradients_of_a_model_read_through_an_object_are_compared(how: str) -> None:
    # Before, no gradient was compared for these (gradients_compared == 0), so a rule
    # that doubled every gradient passed.
    service = Service(_model())
    fn = service.run if how == "method" else service
    report = assert_batched_matches_eager(fn, _examples(), rtol=0, atol=1e-12)
    assert report.gradients_compared == 2
    with pytest.raises(AssertionError, match=r"gradient of parameter model\.lin\.weight differs"):
        assert_batched_matches_eager(fn, _examples(), rules={nn.Linear: DoubledGradientKey})
