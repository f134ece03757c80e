"""Plain attributes of modules (``drop.p``, ``norm.eps``, ``conv.padding``, a
``self.temperature``) set between recording calls and computing them.

Eagerly each call uses the values of its time; a batched call reads them when it
computes. Calls whose attributes were set since they were recorded are refused
(``bg.ModuleAttributeChangedError``); calls recorded after the change use the new
values, with the spec of the new values (``conv.padding`` changes the output shape).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import batchgraph as bg


class Scaled(nn.Module):
    """A module of the user's reading a number of its own in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / self.temperature


class Counting(nn.Module):
    """A module whose forward changes a number of its own (not a setting)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


class Model(bg.BatchedModule):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer


def _attention() -> nn.Module:
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(4, 2, dropout=0.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    return Attend()


# (name, layer, per-example input shape, attribute path, the value set after recording)
CASES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str, Any]] = [
    ("dropout_p", lambda: nn.Dropout(0.0), (4,), "p", 1.0),
    ("layernorm_eps", lambda: nn.LayerNorm(4), (4,), "eps", 10.0),
    ("conv_padding", lambda: nn.Conv1d(1, 2, 3, padding=1), (1, 6), "padding", (0,)),
    ("attention_dropout", _attention, (3, 4), "mha.dropout", 1.0),
    ("temperature", Scaled, (4,), "temperature", 4.0),
]


def _set(module: nn.Module, path: str, value: Any) -> None:
    *owners, name = path.split(".")
    for owner in owners:
        module = getattr(module, owner)
    setattr(module, name, value)


def _get(module: nn.Module, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _inputs(shape: tuple[int, ...], n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g, requires_grad=True) for _ in range(n)]


@pytest.mark.parametrize("name, make, shape, path, new", CASES, ids=[c[0] for c in CASES])
def test_an_attribute_set_after_recording_is_refused_and_set_back_computes_as_eagerly(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], path: str, new: Any,
) -> None:
    model = Model(make())
    xs = _inputs(shape)
    eager = [model.layer(x) for x in xs]
    old = _get(model.layer, path)
    with bg.BatchingPolicy():
        handles = [model.layer(x) for x in xs]
    _set(model.layer, path, new)
    with pytest.raises(bg.ModuleAttributeChangedError, match=path.split(".")[-1]):
        bg.compute(handles)
    _set(model.layer, path, old)
    out = bg.compute(handles)
    for e, o in zip(eager, out):
        torch.testing.assert_close(o, e)
    grads = torch.autograd.grad(torch.stack(out).sum(), xs)
    eager_grads = torch.autograd.grad(torch.stack(eager).sum(), xs)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("name, make, shape, path, new", CASES, ids=[c[0] for c in CASES])
def test_calls_recorded_after_a_change_compute_with_the_new_value(
    name: str, make: Callable[[], nn.Module], shape: tuple[int, ...], path: str, new: Any,
) -> None:
    # The site caches the first value's spec and key: the second batch must not reuse
    # them (conv.padding changes the output shape).
    model = Model(make())
    xs = _inputs(shape)
    with bg.BatchingPolicy():
        first = [model.layer(x) for x in xs]
    bg.compute(first)
    _set(model.layer, path, new)
    eager = [model.layer(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [model.layer(x) for x in xs]
    assert handles[0].shape == eager[0].shape
    for e, o in zip(eager, bg.compute(handles)):
        torch.testing.assert_close(o, e)


def test_an_attribute_set_between_two_recorded_calls_refuses_both() -> None:
    model = Model(Scaled())
    layer = model.layer  # the module itself: inside the block model.layer is its stub
    xs = _inputs((4,), 2)
    with bg.BatchingPolicy():
        h0 = model.layer(xs[0])
        layer.temperature = 2.0
        h1 = model.layer(xs[1])
    with pytest.raises(bg.ModuleAttributeChangedError, match=r"temperature: 1\.0 -> 2\.0"):
        bg.compute([h0, h1])


def test_a_function_reading_a_module_attribute_is_refused_after_a_change() -> None:
    layer = Scaled()
    score = bg.batched_func(lambda x: layer(x).sum())
    xs = _inputs((4,))
    eager = [score(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [score(x) for x in xs]
    layer.temperature = 3.0
    with pytest.raises(bg.ModuleAttributeChangedError, match="of modules read by"):
        bg.compute(handles)
    layer.temperature = 1.0
    torch.testing.assert_close(torch.stack(bg.compute(handles)), torch.stack(eager))


def test_state_a_forward_changes_itself_is_not_taken_for_a_setting() -> None:
    model = Model(Counting())
    xs = _inputs((4,))
    eager = [model.layer(x) for x in xs]
    with bg.BatchingPolicy():
        first = model.layer(xs[0])
        deeper = [model.layer(model.layer(x)) for x in xs[1:]]
    # The compute of `first` changes `calls`; the calls still pending are not refused.
    torch.testing.assert_close(bg.compute(first), eager[0])
    out = bg.compute(deeper)
    for x, o in zip(xs[1:], out):
        torch.testing.assert_close(o, model.layer(model.layer(x)))


@settings(max_examples=25, deadline=None)
@given(then=st.floats(0.25, 4.0), now=st.floats(0.25, 4.0), as_int=st.booleans())
def test_a_temperature_set_after_recording_is_refused_unless_equal(
    then: float, now: float, as_int: bool,
) -> None:
    model = Model(Scaled())
    model.layer.temperature = then
    xs = _inputs((4,), 2)
    eager = [model.layer(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [model.layer(x) for x in xs]
    # An int of the same value still counts as set (1 and 1.0 scale an integer
    # tensor differently).
    model.layer.temperature = round(now) if as_int else now
    if model.layer.temperature == then and not as_int:
        for e, o in zip(eager, bg.compute(handles)):
            torch.testing.assert_close(o, e)
    else:
        with pytest.raises(bg.ModuleAttributeChangedError, match="temperature"):
            bg.compute(handles)


def test_a_setting_set_through_a_submodule_read_inside_the_block_reaches_the_module() -> None:
    # Inside the block model.layer reads as its recording stub: setting through it
    # failed ("'ModuleStub' object has no attribute 'temperature'").
    model = Model(Scaled())
    xs = _inputs((4,), 2)
    with bg.BatchingPolicy():
        model.layer.temperature = 2.0
        handles = [model.layer(x) for x in xs]
    assert model.layer.temperature == 2.0
    for x, value in zip(xs, bg.compute(handles)):
        torch.testing.assert_close(value, model.layer(x))
    with bg.BatchingPolicy():
        first = model.layer(xs[0])
        model.layer.temperature = 3.0
        second = model.layer(xs[1])
    with pytest.raises(bg.ModuleAttributeChangedError, match=r"temperature: 2\.0 -> 3\.0"):
        bg.compute([first, second])


class Noting(nn.Module):
    """A forward setting a number of its own only when it really runs (not on the
    fake tensors a new signature's shape inference uses)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.largest = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch._subclasses.FakeTensor):
            self.largest = max(self.largest, x.shape[0] + 0.5)
        return self.lin(x)


def test_state_a_forward_sets_only_in_real_runs_is_not_taken_for_a_setting() -> None:
    model = Model(Noting())
    xs = _inputs((4,), 3)
    with bg.BatchingPolicy():
        first = model.layer(xs[0])
        later = [model.layer(model.layer(x)) for x in xs[1:]]
    bg.compute(first)  # sets `largest`, which the pending calls were noted without
    for x, value in zip(xs[1:], bg.compute(later)):
        torch.testing.assert_close(value, model.layer(model.layer(x)))


class Root(bg.BatchedModule):
    """A method over the whole model, reading a number of the root's own (whose
    __dict__ holds recording stubs while a policy records)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
                                     for _ in range(3)])
        self.scale = 2.0

    @bg.batched_func
    def step(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * self.scale


@pytest.mark.parametrize("where", ["root", "deep"])
def test_a_method_over_the_model_sees_settings_set_at_any_depth(where: str) -> None:
    model = Root()
    xs = _inputs((4,), 2)
    for _ in range(2):  # the second batch reads the looks cached by the first
        with bg.BatchingPolicy():
            handles = [model.step(x) for x in xs]
        for x, value in zip(xs, bg.compute(handles)):
            torch.testing.assert_close(value, model.step(x))
    with bg.BatchingPolicy():
        handles = [model.step(x) for x in xs]
    if where == "root":
        model.scale = 3.0
    else:
        model.blocks[2][1].eps = 1.0
    name = "scale" if where == "root" else r"blocks\.2\.1\.eps"
    with pytest.raises(bg.ModuleAttributeChangedError, match=name):
        bg.compute(handles)


# NumPy's scalars are numbers as settings (self.scale = np.sqrt(d), a temperature from
# np.linspace): np.float64 is a float subclass, np.float32 and np.int64 are not floats
# at all; none was watched, so every call computed with the new value, silently.
NUMPY_SCALARS: list[Callable[[float], Any]] = [
    np.float64, np.float32, np.float16, np.int64, np.int32, lambda v: np.bool_(v > 1.5),
]


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(range(len(NUMPY_SCALARS))), then=st.floats(0.5, 4.0),
       now=st.floats(0.5, 4.0))
def test_a_numpy_scalar_setting_set_after_recording_is_refused_unless_equal(
    kind: int, then: float, now: float,
) -> None:
    make = NUMPY_SCALARS[kind]
    model = Model(Scaled())
    model.layer.temperature = make(then) + 1  # a bool_ + 1 is an int: never zero
    xs = _inputs((4,), 2)
    eager = [model.layer(x) for x in xs]
    with bg.BatchingPolicy():
        handles = [model.layer(x) for x in xs]
    old = model.layer.temperature
    model.layer.temperature = make(now) + 1
    if model.layer.temperature == old:
        for e, o in zip(eager, bg.compute(handles)):
            torch.testing.assert_close(o, e)
    else:
        with pytest.raises(bg.ModuleAttributeChangedError, match="temperature"):
            bg.compute(handles)


def test_a_numpy_nan_setting_is_not_taken_for_a_change() -> None:
    # NaN equals nothing, itself included: tagged apart, as a float's is.
    model = Model(Scaled())
    model.layer.nan_setting = np.float32("nan")
    xs = _inputs((4,), 2)
    with bg.BatchingPolicy():
        handles = [model.layer(x) for x in xs]
    model.layer.nan_setting = np.float32("nan")
    for x, value in zip(xs, bg.compute(handles)):
        torch.testing.assert_close(value, model.layer(x))


class Named(nn.Module):
    """A module of the user's whose settings are named as a call site's own slots."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.name, self.held, self.cache, self.last = "enc", 1.0, 0.0, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * self.held + self.cache
        return out if self.name == "enc" else out * self.last


@pytest.mark.parametrize("name, value", [
    ("held", 2.0), ("cache", 0.5), ("name", "enc"), ("last", 3),
])
def test_a_setting_named_as_a_site_slot_set_through_the_stub_reaches_the_module(
    name: str, value: Any,
) -> None:
    # Set through the stub, these went to its own slots: the module kept its value
    # (the calls computed with the old one, silently) and the site's cache broke.
    model = Model(Named())
    model.layer.name = "dec"  # so that `last` is read
    xs = _inputs((4,), 2)
    with bg.BatchingPolicy():
        setattr(model.layer, name, value)
        handles = [model.layer(x) for x in xs]
    assert getattr(model.layer, name) == value
    eager = [model.layer(x) for x in xs]
    for e, o in zip(eager, bg.compute(handles)):
        torch.testing.assert_close(o, e)
    with bg.BatchingPolicy():  # the site still records (a second signature too)
        again = [model.layer(x) for x in xs] + [model.layer(torch.ones(2, 4))]
    for e, o in zip(eager, bg.compute(again)):
        torch.testing.assert_close(o, e)


class Masked(nn.Module):
    """A tensor kept as a plain attribute (not a buffer), and a forward keeping its
    output (state of its own, not a setting)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask = torch.ones(4)
        self.last_out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * self.mask
        self.last_out = out
        return out


def test_a_plain_tensor_attribute_rebound_after_recording_is_refused() -> None:
    # Rebinding it was not seen: every call computed with the new mask, silently.
    model = Model(Masked())
    xs = _inputs((4,), 3)
    eager = [model.layer(x) for x in xs]
    mask = model.layer.mask
    with bg.BatchingPolicy():
        first = model.layer(xs[0])
        later = [model.layer(x) for x in xs[1:]]
    torch.testing.assert_close(bg.compute(first), eager[0])  # sets last_out: no setting
    model.layer.mask = torch.zeros(4)
    with pytest.raises(bg.ModuleAttributeChangedError, match=r"mask: tensor\(4,\) float32"):
        bg.compute(later)
    model.layer.mask = mask  # the very tensor again
    for e, o in zip(eager[1:], bg.compute(later)):
        torch.testing.assert_close(o, e)


def test_a_mask_rebound_per_batch_to_a_like_tensor_keeps_the_cached_signatures() -> None:
    # Which tensor it is counts for the calls pending (above), not for the signatures
    # cached: resolved anew per batch, each cost a run on fake tensors (~15 ms).
    model = Model(Masked())
    site = model.layer  # outside the block: the module, whose site is its stub
    xs = [torch.randn(n, 4) for n in range(1, 4)]
    entries = []
    for step in range(3):
        model.layer.mask = torch.rand(4, generator=torch.Generator().manual_seed(step))
        with bg.BatchingPolicy():
            handles = [model.layer(x) for x in xs]
        for x, value in zip(xs, bg.compute(handles)):
            torch.testing.assert_close(value, site(x))
        entries.append({id(e) for e in bg.sites.module_site(site)._bg_cache.values()})
    assert entries[0] == entries[1] == entries[2]
    model.layer.mask = torch.ones(5)  # another shape: resolved anew (a shape error here)
    with bg.BatchingPolicy(), pytest.raises(bg.ShapeMismatchError):
        model.layer(xs[0])


@pytest.mark.parametrize("deeper_first", [True, False])
def test_calls_of_two_signatures_around_a_change_are_refused_whichever_runs_first(
    deeper_first: bool,
) -> None:
    # The check ran once per module, at its first step: where the schedule ran the
    # calls of a signature recorded after the change first (shallower), those recorded
    # before were not checked and computed with the new value, silently.
    model = Model(Scaled())
    a, b = torch.randn(4), torch.randn(2, 4)
    policy = bg.BatchingPolicy()
    with policy:
        before = model.layer(bg.batched_value(a) * 1 if deeper_first else a)
    model.layer.temperature = 2.0
    with policy:
        after = model.layer(b)
    with pytest.raises(bg.ModuleAttributeChangedError, match=r"temperature: 1\.0 -> 2\.0"):
        policy.compute([before, after])


def test_a_temperature_annealed_per_batch_keeps_the_cached_signatures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A float setting changed between batches (annealed) is checked with a run on
    # fake tensors, not resolved anew with every signature of the module (the vmap
    # check each: about 10x the batch's time with 20 shapes).
    resolved: list[str] = []
    original = bg.recording.CallSite._bg_resolve

    def counting(self: bg.recording.CallSite, *args: Any) -> Any:
        resolved.append(self._bg_name)
        return original(self, *args)

    monkeypatch.setattr(bg.recording.CallSite, "_bg_resolve", counting)
    model = Model(Scaled())
    eager = model.layer
    xs = [torch.randn(n, 4) for n in range(1, 4)]
    for step in range(4):
        model.layer.temperature = 1.0 / (1 + step)
        with bg.BatchingPolicy():
            handles = [model.layer(x) for x in xs]
        for x, value in zip(xs, bg.compute(handles)):
            torch.testing.assert_close(value, eager(x), rtol=0, atol=0)
    assert len(resolved) == len(xs)  # once per shape, not per shape per batch


class _Keep(nn.Module):
    """Keeps a fraction of the last dimension: a float setting that shapes the output."""

    def __init__(self) -> None:
        super().__init__()
        self.keep = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., : int(x.shape[-1] * self.keep)] * 2


def test_a_float_setting_that_changes_the_shape_resolves_anew() -> None:
    model = Model(_Keep())
    eager = model.layer
    x = torch.randn(8)
    for keep in (0.5, 0.75, 0.5):
        model.layer.keep = keep
        with bg.BatchingPolicy():
            h = model.layer(x)
            assert h.shape == (int(8 * keep),)  # as eagerly
        torch.testing.assert_close(bg.compute(h), eager(x), rtol=0, atol=0)
