"""Runs on fake tensors keep the fakes of the real tensors they read (a module's
parameters and buffers) across runs: a tensor changed between runs (its shape, its
memory, requires_grad) is converted anew, nothing is kept alive, and at most
``FAKES_KEPT`` are kept."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from batchgraph import fake_mode as fm
from batchgraph.errors import ShapeMismatchError
from batchgraph.inference import fake_apply, infer_spec, on_fake_tensors
from batchgraph.specs import CallSignature, InputSlot, TensorSpec


def _call(*shapes: tuple[int, ...]) -> CallSignature:
    specs = tuple(TensorSpec(s, torch.float32, torch.device("cpu")) for s in shapes)
    return CallSignature(tuple(InputSlot(i) for i in range(len(shapes))), (), specs, None)


def _shape(fn: Any, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    spec = infer_spec(fn, "fn", _call(*shapes))[0]
    assert isinstance(spec, TensorSpec)
    return tuple(spec.shape)


def _kept() -> Any:
    converter = fm.fake_mode().fake_tensor_converter
    assert isinstance(converter, fm._KeptFakes)
    return converter.kept


class Scaled(nn.Module):
    scale: torch.Tensor
    proj: torch.Tensor

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(n))
        self.register_buffer("proj", torch.ones(n, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale) @ self.proj


def test_a_parameter_given_new_data_of_another_shape_is_seen_by_the_next_run() -> None:
    lin = nn.Linear(4, 3)
    assert _shape(lin, (4,)) == (3,)
    assert lin.weight in _kept()  # kept: the case below is the one that could go stale
    lin.weight.data = torch.randn(5, 4)
    lin.bias.data = torch.randn(5)
    assert _shape(lin, (4,)) == (5,) == tuple(lin(torch.ones(4)).shape)
    lin.weight.data = torch.randn(5, 6)
    assert _shape(lin, (6,)) == (5,)
    with pytest.raises(ShapeMismatchError):
        infer_spec(lin, "lin", _call((4,)))


def test_a_buffer_resized_or_transposed_in_place_is_seen_by_the_next_run() -> None:
    m = Scaled(3)
    assert _shape(m, (3,)) == (2,)
    m.scale.resize_(5).fill_(1.0)  # the same tensor and storage object, grown
    m.proj.resize_(5, 2).fill_(1.0)
    assert _shape(m, (5,)) == (2,) == tuple(m(torch.ones(5)).shape)
    with pytest.raises(ShapeMismatchError):
        infer_spec(m, "m", _call((3,)))
    m.proj.t_()  # (2, 5): x * scale of 5, matmul needs 2 rows
    with pytest.raises(ShapeMismatchError):
        infer_spec(m, "m", _call((5,)))
    m.proj.t_()
    assert _shape(m, (5,)) == (2,)


def test_requires_grad_changed_between_runs_is_seen() -> None:
    lin = nn.Linear(4, 3)
    assert fake_apply(lin, _call((4,))).requires_grad
    lin.requires_grad_(False)
    assert not fake_apply(lin, _call((4,))).requires_grad
    lin.requires_grad_(True)
    assert fake_apply(lin, _call((4,))).requires_grad


def test_values_changed_in_place_keep_the_fakes_of_an_unchanged_layout() -> None:
    # An optimizer step changes every parameter's values (and version) per batch: a
    # fake has no values, so the fakes stand.
    lin = nn.Linear(4, 3)
    _shape(lin, (4,))
    before = _kept()[lin.weight][1]
    with torch.no_grad():
        lin.weight.mul_(2.0)
    assert _shape(lin, (4,)) == (3,)
    assert _kept()[lin.weight][1] is before


def test_a_fake_changed_in_place_by_a_run_is_not_used_again() -> None:
    # F.embedding with max_norm renormalizes its weight within torch: on the fake.
    emb = nn.Embedding(10, 4, max_norm=1.0)
    call = CallSignature((InputSlot(0),), (), (TensorSpec((3,), torch.int64,
                                                          torch.device("cpu")),), None)
    version = emb.weight._version
    assert tuple(infer_spec(emb, "emb", call)[0].shape) == (3, 4)  # type: ignore[union-attr]
    first = _kept()[emb.weight][1]
    assert first._version != _kept()[emb.weight][2][-1]  # it moved, so it is stale
    assert tuple(infer_spec(emb, "emb", call)[0].shape) == (3, 4)  # type: ignore[union-attr]
    assert _kept()[emb.weight][1] is not first
    assert emb.weight._version == version  # the real weight as it was


def test_kept_fakes_do_not_keep_their_tensors_alive() -> None:
    lin = nn.Linear(4, 3)
    _shape(lin, (4,))
    weight, module = weakref.ref(lin.weight), weakref.ref(lin)
    assert lin.weight in _kept()
    count = fm.kept_fakes()
    del lin
    gc.collect()
    assert weight() is None and module() is None
    assert fm.kept_fakes() <= count - 2


def test_at_most_fakes_kept_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    earlier = [nn.Linear(4, 3) for _ in range(20)]  # kept under the bound then in force
    for lin in earlier:
        _shape(lin, (4,))
    assert fm.kept_fakes() >= 40
    monkeypatch.setattr(fm, "FAKES_KEPT", 8)
    layers = [nn.Linear(4, 3) for _ in range(20)]  # 40 tensors, all alive
    for lin in layers:
        assert _shape(lin, (4,)) == (3,)
        assert fm.kept_fakes() <= 8
    assert layers[-1].weight in _kept()  # the newest stay


def test_constants_made_by_runs_are_not_noted_for_good() -> None:
    # torch notes each constant its fake mode makes (lift_fresh_copy of a one-element
    # tensor, as under dynamo), to forget it if its memory is written: with a mode kept
    # across runs, one more per run, for good.
    converter = fm.fake_mode().fake_tensor_converter
    for _ in range(20):
        with on_fake_tensors():
            x = torch.empty(2) * torch.ops.aten.lift_fresh_copy(torch.tensor([2.0]))
        assert x.shape == (2,)
        assert len(converter.constant_storage_mapping) <= 1


def test_each_thread_has_its_own_mode_and_fakes() -> None:
    lin, seen, errors = nn.Linear(4, 3), [], []

    def run() -> None:
        try:
            for _ in range(20):
                seen.append((_shape(lin, (4,)), id(fm.fake_mode())))
        except Exception as err:  # pragma: no cover - the failure itself
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(seen) == 60
    assert {s for s, _ in seen} == {(3,)}
    assert len({mode for _, mode in seen}) == 3


_CHANGES = st.lists(st.tuples(st.sampled_from(["data", "resize", "grad", "values", "run"]),
                              st.integers(1, 5)), max_size=8)


@given(_CHANGES)
def test_fake_runs_give_the_eager_shape_and_grad_after_any_changes(
        changes: list[tuple[str, int]]) -> None:
    lin = nn.Linear(3, 2)
    for what, n in changes:
        with torch.no_grad():
            if what == "data":
                lin.weight.data = torch.randn(n, lin.weight.shape[1])
                lin.bias.data = torch.randn(n)
            elif what == "resize":
                grad = lin.weight.requires_grad  # torch resizes no tensor requiring grad
                lin.weight.requires_grad_(False).resize_(lin.weight.shape[0], n).normal_()
                lin.weight.requires_grad_(grad)
            elif what == "grad":
                lin.requires_grad_(n % 2 == 0)
            elif what == "values":
                lin.weight.add_(1.0)
        x = torch.randn(lin.weight.shape[1])
        eager = lin(x)
        out = fake_apply(lin, _call(tuple(x.shape)))
        assert (tuple(out.shape), out.dtype, out.requires_grad) == (
            tuple(eager.shape), eager.dtype, eager.requires_grad)

