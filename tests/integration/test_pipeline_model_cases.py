"""Models and uses that once broke one schedule or another, each against one device:
inputs that require grad, layers frozen or unfrozen between steps, stages starting with
an in-place op."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from batchgraph.pipeline import SCHEDULE_NAMES, Pipeline, StageError
from tests.pipeline_models import assert_grads_equal, complex_loss, complex_model, mlp, reference

_SCHEDULES = [s for s in SCHEDULE_NAMES if s != "interleaved-1f1b"]


@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_inputs_that_require_grad_get_their_gradient(schedule: str) -> None:
    # Input-gradient training (saliency, adversarial examples): x.grad as one device
    # gives it, also with the split backward (stage 0 once dropped its dL/dx there).
    model = mlp(layers=4)
    x0 = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    x = x0.clone().requires_grad_(True)
    nn.MSELoss()(model(x), y).backward()
    want = x.grad
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Pipeline(
            model, stages=2, microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(), timeout=30
        ) as pipe:
            pipe.train_step(x, y)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want, rtol=1e-10, atol=1e-10)
    # Stage 0 once read .grad of its (non-leaf) microbatch slices of x.
    assert not [w for w in caught if "non-leaf" in str(w.message)]


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_inputs_computed_by_the_callers_graph_get_their_gradient(schedule: str) -> None:
    # Inputs from a layer run before the pipeline (an embedding outside it): every
    # microbatch's stage-0 backward ran on into that layer's graph, through the one
    # node that split the batch, and the second failed the step ("Trying to backward
    # through the graph a second time").
    torch.manual_seed(0)
    embed = nn.Embedding(10, 5, dtype=torch.float64)
    model = mlp(layers=4)
    ids = torch.randint(0, 10, (6,))
    y = torch.randn(6, 3, dtype=torch.float64)
    want_loss, want = reference(nn.Sequential(embed, model), ids, y, nn.MSELoss())
    with Pipeline(
        model, stages=2, microbatches=3, schedule=schedule, loss_fn=nn.MSELoss(),
        chunks=2 if schedule == "interleaved-1f1b" else 1, cost="uniform", timeout=30,
    ) as pipe:  # fmt: skip
        for _ in range(2):  # accumulates like two backward calls
            loss = pipe.train_step(embed(ids), y)
    torch.testing.assert_close(loss, want_loss)
    assert_grads_equal(nn.Sequential(embed, model), [None if g is None else 2 * g for g in want])


def _change_between_steps(
    schedule: str, model: nn.Sequential, change: Callable[[list[nn.Module]], None]
) -> None:
    """Two steps on three stages of ``model``, ``change(stages)`` between them; the second
    step's loss and gradients equal one device's on the changed model."""
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    with Pipeline(
        [model[:4], model[4:8], model[8:]],
        microbatches=3,
        schedule=schedule,
        loss_fn=nn.MSELoss(),
        timeout=30,
    ) as pipe:
        pipe.train_step(x, y)
        change(pipe.stage_modules)
        model.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y)
        got = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    want = nn.MSELoss()(model(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-10)
    for i, (g, p) in enumerate(zip(got, model.parameters())):
        assert (g is None) == (p.grad is None), f"parameter {i}: grad presence differs"
        if g is not None:
            torch.testing.assert_close(g, p.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("unfreeze", [True, False])
def test_layer_frozen_or_unfrozen_between_steps(schedule: str, unfreeze: bool) -> None:
    # Gradual unfreezing, fine-tuning: the trainable set of a middle stage changes between
    # steps (the split backward once kept the units it found at the first step).
    model = mlp(layers=6)
    target = model[4]  # a Linear in the middle stage of three
    target.requires_grad_(not unfreeze)
    _change_between_steps(schedule, model, lambda stages: target.requires_grad_(unfreeze))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("what", ["weight", "layer"])
def test_parameter_replaced_between_steps(schedule: str, what: str) -> None:
    # Re-initializing a layer, loading a checkpoint by assignment: zb-h1 kept asking for
    # the old parameter objects (stale() looked at requires_grad flags only), so the new
    # weight got no gradient.
    model = mlp(layers=6)

    def replace(stages: list[nn.Module]) -> None:
        middle = stages[1]
        assert isinstance(middle, nn.Sequential)
        if what == "weight":
            middle[0].weight = nn.Parameter(torch.randn(6, 6, dtype=torch.float64))
        else:  # the stage is a slice of model: a new layer goes into both
            middle[0] = model[4] = nn.Linear(6, 6).double()

    _change_between_steps(schedule, model, replace)
    assert all(p.grad is not None for p in model.parameters())


class _AddInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0).add_(1.0)


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_stages_starting_with_an_in_place_op(schedule: str) -> None:
    # A cut right before ReLU(inplace=True) (what cost="uniform" picks for such a
    # Sequential): the stage's input was a leaf that requires grad, which autograd does
    # not let an in-place op change.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 6),
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 6)),
        nn.Sequential(_AddInPlace(), nn.Linear(6, 6)),
        nn.Sequential(nn.ReLU(inplace=True), nn.Linear(6, 3)),
    ).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    nn.MSELoss()(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with Pipeline(
        list(model),
        microbatches=3,
        schedule=schedule,
        loss_fn=nn.MSELoss(),
        chunks=2 if schedule == "interleaved-1f1b" else 1,
        timeout=30,
    ) as pipe:
        pipe.train_step(x, y)
        with torch.no_grad():
            torch.testing.assert_close(pipe.forward(x), model(x), rtol=1e-10, atol=1e-10)
    for p, g in zip(model.parameters(), want):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)


class _LayerScale(nn.Module):
    """timm's LayerScale(inplace=True): parameters of its own, and its input changed in place."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, dim, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.gamma)


@pytest.mark.parametrize("schedule", _SCHEDULES)
@pytest.mark.parametrize("cut", [2, 3, 4])
def test_layer_with_parameters_changing_its_input_in_place(schedule: str, cut: int) -> None:
    # Under zb-h1 every unit (a layer with parameters) ran on a leaf of its input, which
    # torch does not let an in-place op change: x.mul_(gamma) failed anywhere in a stage.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), _LayerScale(6), nn.Tanh(),
        nn.Linear(6, 6), _LayerScale(6), nn.Linear(6, 3),
    ).double()  # fmt: skip
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 3, dtype=torch.float64)
    loss = nn.MSELoss()(model(x), y)
    loss.backward()
    want = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    with Pipeline(
        [model[:cut], model[cut:]], microbatches=3, schedule=schedule, loss_fn=nn.MSELoss()
    ) as pipe:
        for _ in range(2):  # the first call of a LayerScale runs again, the second not
            torch.testing.assert_close(pipe.train_step(x, y), loss.detach())
        with torch.no_grad():
            torch.testing.assert_close(pipe.forward(x), model(x), rtol=1e-10, atol=1e-10)
    for p, g in zip(model.parameters(), want):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, 2 * g, rtol=1e-10, atol=1e-10)


class _ScaledNorm(_LayerScale):
    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.norm = nn.BatchNorm1d(dim).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x).mul_(self.gamma)  # changes its own output: fine


class _NormThenInPlace(_ScaledNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.norm(x)  # running statistics updated before the in-place change
        return x.mul_(self.gamma)


def test_layer_with_buffers_changing_its_input_in_place_is_named() -> None:
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    for layer, fails in ((_ScaledNorm(5), False), (_NormThenInPlace(5), True)):
        mods = [nn.Linear(5, 5).double(), nn.Sequential(nn.Tanh(), layer)]
        with Pipeline(mods, microbatches=2, schedule="zb-h1", loss_fn=nn.MSELoss()) as pipe:
            if not fails:
                pipe.train_step(x, y)
                continue
            with pytest.raises(StageError, match=r"_NormThenInPlace changes its input in place"):
                pipe.train_step(x, y)


def test_zb_h1_model_copies_while_open_and_is_restored_when_closed() -> None:
    # One Linear object used by two stages (weight reuse), and a deepcopy mid-training.
    torch.manual_seed(0)
    shared = nn.Linear(4, 4).double()
    mods = [
        nn.Linear(4, 4).double(),
        nn.Sequential(nn.Tanh(), shared),
        nn.Sequential(nn.Tanh(), shared, nn.Linear(4, 1).double()),
    ]
    model = nn.Sequential(*mods)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 1, dtype=torch.float64)
    with Pipeline(mods, microbatches=2, schedule="zb-h1", loss_fn=nn.MSELoss()) as pipe:
        pipe.train_step(x, y)
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
    assert all("forward" not in m.__dict__ for m in model.modules())
    copy.deepcopy(model)


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reentrant", [False, True])
def test_zb_h1_with_activation_checkpointing(reentrant: bool) -> None:
    # A reentrant checkpoint runs its own backward, which fails when autograd is asked for
    # some gradients only (I and W): torch's error came at the first I. Now it is named at
    # the first forward; the non-reentrant one works.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(5, 6).double(), nn.Tanh(), _Checkpointed(reentrant), nn.Linear(6, 3).double()
    )
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    _, want = reference(model, x, y, nn.MSELoss())
    with Pipeline(
        [model[:2], model[2:]], microbatches=3, schedule="zb-h1", loss_fn=nn.MSELoss()
    ) as pipe:
        if reentrant:
            with pytest.raises(StageError, match=r"1F0 .*use_reentrant=True, which the split"):
                pipe.train_step(x, y)
            return
        pipe.train_step(x, y)
    assert_grads_equal(model, want)


@pytest.mark.parametrize("schedule", _SCHEDULES)
def test_complex_outputs_get_their_gradient(schedule: str) -> None:
    # The loss's leaves on the last stage's outputs required grad only when floating:
    # where the loss is computed apart from the stage's graph (zb-h1's last stage), a
    # complex output got none, and the step left every .grad None without a word.
    model = complex_model()
    x = torch.randn(6, 5, dtype=torch.float64)
    y = torch.randn(6, 5, dtype=torch.float64)
    want_loss, want = reference(model, x, y, complex_loss)
    with Pipeline(model, stages=2, microbatches=3, schedule=schedule, loss_fn=complex_loss) as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss)
    assert_grads_equal(model, want)


class _CachedCos(nn.Module):
    """Caches a tensor per sequence length in plain attributes, as rotary embeddings do,
    and counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.length: int | None = None
        self.cos: torch.Tensor | None = None
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(h.shape[1])
        if self.length != h.shape[1]:
            t = torch.arange(h.shape[1], device=h.device, dtype=h.dtype)
            self.cos, self.length = t.cos().unsqueeze(-1), h.shape[1]
        assert self.cos is not None
        return h * self.cos


def test_layers_caching_tensors_in_attributes_are_not_poisoned_by_the_shape_check() -> None:
    # The stages' meta-device shape check ran their forwards: the cache kept a meta
    # tensor and the first real forward failed ("Tensor on device meta is not on the
    # expected device cpu"); the call count included the check's call.
    cached = [_CachedCos(), _CachedCos()]
    model = nn.Sequential(
        nn.Linear(5, 5, dtype=torch.float64), cached[0], nn.Linear(5, 5, dtype=torch.float64),
        cached[1], nn.Linear(5, 3, dtype=torch.float64),
    )  # fmt: skip
    x = torch.randn(6, 4, 5, dtype=torch.float64)
    y = torch.randn(6, 4, 3, dtype=torch.float64)
    want_loss, want = reference(model, x, y, nn.MSELoss())
    for layer in cached:  # as built: nothing cached, nothing counted
        layer.calls, layer.seen, layer.length, layer.cos = 0, [], None, None
    with Pipeline(model, stages=2, microbatches=3, loss_fn=nn.MSELoss(), cost="uniform") as pipe:
        loss = pipe.train_step(x, y)
    torch.testing.assert_close(loss, want_loss)
    assert_grads_equal(model, want)
    assert [layer.calls for layer in cached] == [3, 3]
    assert [layer.seen for layer in cached] == [[4, 4, 4], [4, 4, 4]]
