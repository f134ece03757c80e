"""Checkpoints of a pipeline on threads: ``state_dict`` under the unsplit model's names.

A checkpoint saved from a pipeline trained for a few steps equals the state of the same
model trained on one device (float64), loads strictly into a fresh unsplit model and
gives its outputs; a single-device checkpoint loaded into a pipeline gives the outputs
and gradients of that model. Strict loading names the keys it refuses.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.pipeline_models import mlp, reference


class Traced(nn.Module):
    """Not an nn.Sequential (split by tracing), with nested names and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.enc(x) * self.scale))


def _build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "traced":
        return Traced().double()
    return mlp(layers=6)


def _pipe(kind: str, model: nn.Module, schedule: str, microbatches: int = 3) -> Pipeline:
    chunks = 2 if schedule == "interleaved-1f1b" else 1
    given = list(model) if kind == "list" else model  # a list of layers, split likewise
    return Pipeline(given, stages=2, microbatches=microbatches, schedule=schedule,
                    chunks=chunks, loss_fn=nn.MSELoss(), timeout=30)  # fmt: skip


def _batches(steps: int, n: int = 9) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(11)
    return [
        (torch.randn(n, 5, generator=gen, dtype=torch.float64),
         torch.randn(n, 3, generator=gen, dtype=torch.float64))
        for _ in range(steps)
    ]  # fmt: skip


def _train(model: nn.Module, step: Callable[[Tensor, Tensor], object], steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for x, y in _batches(steps):
        step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _single_step(model: nn.Module) -> Callable[[Tensor, Tensor], object]:
    return lambda x, y: nn.MSELoss()(model(x), y).backward()


SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]
# The traced model has too few operations for 4 (interleaved) stages.
CASES = [(k, s) for k in ("sequential", "list") for s in SCHEDULES] + [
    ("traced", s) for s in SCHEDULES[:3]
]


@pytest.mark.parametrize(("kind", "schedule"), CASES)
def test_checkpoint_of_pipelined_training_equals_single_device_training(
    kind: str, schedule: str
) -> None:
    piped, single = _build(kind, seed=1), _build(kind, seed=1)
    with _pipe(kind, piped, schedule) as pipe:
        _train(piped, pipe.train_step, steps=3)
        checkpoint = pipe.state_dict()
        x = _batches(1, n=7)[0][0]
        piped_out = pipe.forward(x)
    _train(single, _single_step(single), steps=3)
    want = single.state_dict()
    assert list(checkpoint) == list(want)  # the unsplit model's names, in its order
    for key, value in want.items():
        torch.testing.assert_close(checkpoint[key], value, rtol=1e-10, atol=1e-10, msg=key)
    fresh = _build(kind, seed=2)
    assert not torch.equal(next(fresh.parameters()), next(single.parameters()))
    assert fresh.load_state_dict(checkpoint).missing_keys == []  # strict: every key matched
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), piped_out, rtol=1e-10, atol=1e-10)


def test_gathering_on_threads_is_the_state_dict() -> None:
    model = mlp(layers=4)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        whole = pipe.gather_state_dict()
        assert whole is not None and whole.keys() == pipe.state_dict().keys()
        assert all(torch.equal(whole[k], v) for k, v in model.state_dict().items())


def _bn_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*layers, nn.BatchNorm1d(6), nn.Linear(6, 3)).double()


@pytest.mark.parametrize(("make", "microbatches"), [(lambda s: mlp(layers=6), 3), (_bn_model, 1)])
def test_single_device_checkpoint_loaded_into_a_pipeline_gives_its_outputs_and_gradients(
    make: Callable[[int], nn.Module], microbatches: int
) -> None:
    # One microbatch with BatchNorm: its statistics then equal the whole batch's.
    torch.manual_seed(1)
    piped = make(1)
    torch.manual_seed(2)
    source = make(2)
    x, y = _batches(1)[0]
    with torch.no_grad():  # running statistics that differ from a fresh model's
        source.train()(x * 3 + 1)
    with Pipeline(piped, stages=3, microbatches=microbatches, loss_fn=nn.MSELoss()) as pipe:
        assert pipe.load_state_dict(source.state_dict()) == ([], [])
        want_loss, want_grads = reference(source, x, y, nn.MSELoss())
        loss = pipe.train_step(x, y)
        torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-10)
        for p, g in zip(piped.parameters(), want_grads, strict=True):
            torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)
        piped.eval()
        source.eval()
        with torch.no_grad():
            torch.testing.assert_close(pipe.forward(x), source(x), rtol=1e-10, atol=1e-10)


def test_strict_loading_names_missing_and_unexpected_keys_and_copies_nothing() -> None:
    model = mlp(layers=4)
    other = mlp(layers=4).state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        bad = {k: v for k, v in other.items() if k != "4.bias"} | {"head.weight": torch.ones(1)}
        with pytest.raises(RuntimeError) as caught:
            pipe.load_state_dict(bad)
        message = str(caught.value)
        assert "missing key(s): '4.bias'" in message
        assert "unexpected key(s), of no stage: 'head.weight'" in message
        assert "strict=False" in message
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
        skipped = pipe.load_state_dict(bad, strict=False)
        assert skipped.missing_keys == ["4.bias"] and skipped.unexpected_keys == ["head.weight"]
        assert torch.equal(model[0].weight, other["0.weight"])
        assert torch.equal(model[4].bias, before["4.bias"])  # missing: left as it was
        wrong = dict(other) | {"2.weight": torch.zeros(3, 3, dtype=torch.float64)}
        with pytest.raises(RuntimeError, match="size mismatch"):
            pipe.load_state_dict(wrong)


def test_a_size_mismatch_names_the_models_key_and_copies_nothing() -> None:
    # The last stage's own load_state_dict named its local key ("3.weight" for the
    # model's "6.weight"), after the first stage had already been overwritten.
    model = mlp(layers=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrong = mlp(layers=4).state_dict() | {"6.weight": torch.zeros(3, 5, dtype=torch.float64)}
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        assert not any(p is model[6].weight for p in pipe.stage_modules[0].parameters())
        with pytest.raises(RuntimeError, match=r"size mismatch for 6\.weight: .*\[3, 5\].*stage 1"):
            pipe.load_state_dict(wrong)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_tied_layer_is_saved_under_every_name_the_model_has() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), shared).double()
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        checkpoint = pipe.state_dict()
    assert list(checkpoint) == list(model.state_dict())
    assert torch.equal(checkpoint["0.weight"], checkpoint["4.weight"])
    fresh = nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), shared).double()
    fresh.load_state_dict(checkpoint)


def test_the_models_own_state_dict_stays_right_on_threads() -> None:
    # The threads backend trains the model's own parameters: nothing to guard.
    model = mlp(layers=4)
    with Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
        _train(model, pipe.train_step, steps=1)
        mine = pipe.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in model.state_dict().items())


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(2, 7),
    stages=st.integers(1, 3),
    chunks=st.sampled_from([1, 2]),
    as_list=st.booleans(),
)
def test_names_are_the_unsplit_models_for_any_split(
    layers: int, stages: int, chunks: int, as_list: bool
) -> None:
    model = mlp(layers=layers)
    if stages * chunks > len(model):
        return
    schedule = "interleaved-1f1b" if chunks == 2 else "gpipe"
    with Pipeline(list(model) if as_list else model, stages=stages, chunks=chunks,
                  microbatches=stages * chunks, schedule=schedule, loss_fn=nn.MSELoss()) as pipe:  # fmt: skip
        checkpoint = pipe.state_dict()
    want = model.state_dict()
    assert list(checkpoint) == list(want)
    assert all(checkpoint[k].data_ptr() == v.data_ptr() for k, v in want.items())
