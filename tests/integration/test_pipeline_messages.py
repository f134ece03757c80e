"""Pipeline errors say what was asked in the caller's terms and what to do.

Two used to mislead: an interleaved pipeline on too few layers reported
"cannot split 3 layers into 4 stages" for ``stages=2, chunks=2``; a model whose output
has no batch dimension failed ``forward`` with torch's "zero-dimensional tensor
cannot be concatenated".
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline, PipelineConfigError, merge_microbatches


def _layers(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])


class _TwoLinear(nn.Module):
    """Not an nn.Sequential: split by its traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(self.a(x))
        return out


@pytest.mark.parametrize("as_list", [False, True])
def test_interleaved_on_too_few_layers_counts_virtual_stages(as_list: bool) -> None:
    model = _layers(3)
    with pytest.raises(PipelineConfigError) as info:
        Pipeline(
            list(model) if as_list else model, stages=2, chunks=2, microbatches=2,
            schedule="interleaved-1f1b",
        )  # fmt: skip
    text = str(info.value)
    assert text.startswith(
        "cannot split 3 layers into 2 stages x 2 chunks per stage = 4 virtual stages"
    )
    # What to change: chunks=1 with at most 3 stages (and a one-stage-per-device
    # schedule), or a model with at least 4 layers.
    assert "chunks=1 with stages <= 3 (schedule '1f1b' instead of 'interleaved-1f1b')" in text
    assert "a model with at least 4 layers" in text


def test_interleaved_suggests_the_chunks_or_stages_that_fit() -> None:
    with pytest.raises(PipelineConfigError, match=r"Use chunks <= 2 with stages=2, or "):
        Pipeline(_layers(5), stages=2, chunks=3, microbatches=2, schedule="interleaved-1f1b")
    with pytest.raises(PipelineConfigError, match=r"Use stages <= 2 with chunks=2, or "):
        Pipeline(_layers(5), stages=3, chunks=2, microbatches=3, schedule="interleaved-1f1b")


def test_traced_graph_counts_operations() -> None:
    with pytest.raises(
        PipelineConfigError,
        match=r"cannot split 2 operations into 2 stages x 2 chunks per stage = 4 virtual "
        r"stages.*cut only between its operations",
    ):
        Pipeline(_TwoLinear(), stages=2, chunks=2, microbatches=2, schedule="interleaved-1f1b")


def test_one_chunk_per_stage_keeps_its_wording() -> None:
    with pytest.raises(
        PipelineConfigError, match=r"cannot split 3 layers into 4 stages \(stages=4\).*stages <= 3"
    ):
        Pipeline(_layers(3), stages=4, microbatches=2)


def test_chunks_with_a_one_stage_per_device_schedule_is_reported_first() -> None:
    """Not 'cannot split 3 layers into 4 stages': chunks=2 is the thing to fix."""
    with pytest.raises(PipelineConfigError, match=r"1f1b runs one stage per device.*chunks=2"):
        Pipeline(_layers(3), stages=2, chunks=2, microbatches=2)


class _Sum(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sum()


def test_forward_of_a_model_without_batch_dimension_names_the_stage() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), _Sum())
    x = torch.randn(4, 3)
    with (
        Pipeline(model, stages=2, microbatches=2, timeout=30) as pipe,
        pytest.raises(
            PipelineConfigError,
            match=r"the last stage \(stage 1, SequentialStage\) returned a 0-d tensor as output 0 "
            r"of microbatch 0: it has no batch dimension.*move the reduction into the loss",
        ),
    ):
        pipe.forward(x)
    # One microbatch has nothing to merge: one device's value.
    with Pipeline(model, stages=2, microbatches=1, timeout=30) as pipe:
        out = pipe.forward(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))


def test_merge_names_the_last_stage_by_default() -> None:
    """What the torch.distributed backend's last rank reports (it merges the same way)."""
    with pytest.raises(PipelineConfigError, match=r"^the last stage returned a 0-d tensor"):
        merge_microbatches([(torch.tensor(1.0),), (torch.tensor(2.0),)])


def test_train_step_with_batchless_targets_names_them() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1), _Sum())
    with (
        Pipeline(model, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe,
        pytest.raises(
            PipelineConfigError,
            match=r"^targets: item 0 is a 0-d tensor \(shape \(\)\), which has no batch dimension",
        ),
    ):
        pipe.train_step(torch.randn(4, 3), torch.tensor(1.0))


def test_train_step_on_a_batchless_output_warns_once() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1), _Sum())
    x, y = torch.randn(4, 3), torch.randn(4)
    with Pipeline(
        model, stages=2, microbatches=2, loss_fn=lambda out, t: out, reduction="sum",
        timeout=30,
    ) as pipe:  # fmt: skip
        with pytest.warns(
            RuntimeWarning,
            match=r"the last stage \(stage 1, SequentialStage\) returned a 0-d tensor: it has no "
            r"batch dimension",
        ):
            loss = pipe.train_step(x, y)
        # Here the loss is the microbatch's own (a sum, weighted 1): one device's value.
        with torch.no_grad():
            torch.testing.assert_close(loss, model(x))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            pipe.train_step(x, y)  # once per pipeline


class _Argmax(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.argmax(-1)


def test_train_step_without_any_gradient_is_refused_as_backward_is() -> None:
    """One device's loss.backward() raises here; the step silently computed nothing."""
    x, y = torch.randn(4, 3), torch.randn(4)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), _Argmax())

    def loss_fn(out: Tensor, target: Tensor) -> Tensor:
        return (out.float() - target).square().mean()

    with pytest.raises(RuntimeError, match="does not require grad"):
        loss_fn(model(x), y).backward()
    for schedule in ["1f1b", "zb-h1"]:
        with (
            Pipeline(model, stages=2, microbatches=2, schedule=schedule, loss_fn=loss_fn,
                     timeout=30) as pipe,
            pytest.raises(
                PipelineConfigError,
                match=r"computed no gradient: .*the last stage, stage 1 \(SequentialStage\), "
                r"returned outputs without an autograd graph",
            ),
        ):  # fmt: skip
            pipe.train_step(x, y)
    # Every parameter frozen: refused before any work.
    frozen = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).requires_grad_(False)
    with Pipeline(frozen, stages=2, microbatches=2, loss_fn=nn.MSELoss(), timeout=30) as pipe:
        with pytest.raises(PipelineConfigError, match=r"nothing to compute gradients for"):
            pipe.train_step(x, y[:, None])
        # Inputs that require grad (an adversarial example's gradient) are something.
        xs = x.clone().requires_grad_(True)
        pipe.train_step(xs, y[:, None])
        assert xs.grad is not None


def test_hooks_on_the_whole_model_warn_that_they_will_not_run() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model.register_forward_hook(lambda mod, args, out: None)
    model.register_full_backward_hook(lambda mod, gin, gout: None)
    with pytest.warns(
        RuntimeWarning,
        match=r"the Sequential being split has forward hooks and backward hooks registered "
        r"on it, which will not run",
    ) as record:
        Pipeline(model, stages=2, microbatches=2).close()
    assert record[0].filename == __file__
    # Hooks on layers run (the stages call them), and a list has no whole model.
    layers = [nn.Linear(3, 3), nn.Linear(3, 1)]
    layers[0].register_forward_hook(lambda mod, args, out: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pipeline(layers, stages=2, microbatches=2).close()


def test_a_compiled_model_is_refused_with_what_to_do() -> None:
    """It failed with torch's 'Module [OptimizedModule] is missing the required "forward"
    function' from tracing."""
    compiled = torch.compile(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)), backend="eager")
    with pytest.raises(
        PipelineConfigError,
        match=r"the model is torch\.compile'd \(OptimizedModule of Sequential\).*"
        r"model\._orig_mod.*compile its layers",
    ):
        Pipeline(compiled, stages=2, microbatches=2)
