"""A pipeline inside a pipeline's stage, run as a script (``python -m``) by
test_pipeline_nested: a hang there leaves the generator lock held, so it runs in a
process of its own, which the test can time out and kill."""

from __future__ import annotations

import json
import sys

import torch
from torch import Tensor, nn

from batchgraph.pipeline import Pipeline
from tests.pipeline_models import SCHEDULES, chunks_for, reference


class Inner(nn.Module):
    """Code not torch.nn's: such a stage runs its first step holding the generator lock."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


class Outer(nn.Module):
    """Runs ``inner`` through a pipeline of its own (``piped``), or as it is."""

    def __init__(self, piped: bool, schedule: str) -> None:
        super().__init__()
        self.inner = nn.Sequential(Inner(), Inner())
        self.piped = piped
        self.schedule = schedule

    def forward(self, x: Tensor) -> Tensor:
        if not self.piped:
            with torch.no_grad():  # as the inner pipeline's forward hands it back
                return self.inner(x)
        with Pipeline(self.inner, stages=2, microbatches=2, schedule=self.schedule) as pipe:
            out = pipe.forward(x)
        assert isinstance(out, Tensor)
        return out


def _model(piped: bool, blocks: int, inner: str) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(blocks):
        mods += [Outer(piped, inner), nn.Linear(4, 4, dtype=torch.float64)]
    return nn.Sequential(*mods)


def main() -> None:
    """Each outer schedule's step with an inner pipeline, against one device: one line of
    JSON (the cases' differences from one device's loss and gradients)."""
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    found: dict[str, float] = {}
    for schedule in SCHEDULES:
        for inner in ("gpipe", "1f1b"):
            blocks = 2 * chunks_for(schedule)
            loss, grads = reference(_model(False, blocks, inner), x, y, nn.MSELoss())
            model = _model(True, blocks, inner)
            with Pipeline(model, stages=2, microbatches=2, schedule=schedule,
                          chunks=chunks_for(schedule), loss_fn=nn.MSELoss()) as pipe:
                for _ in range(2):  # the first step locked, the second as learned
                    model.zero_grad(set_to_none=True)
                    got = pipe.train_step(x, y)
            gaps = [float((got - loss).abs())]
            gaps += [float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), grads)
                     if p.grad is not None and g is not None]
            gaps += [0.0 if (p.grad is None) == (g is None) else 1.0
                     for p, g in zip(model.parameters(), grads)]
            found[f"{schedule}/{inner}"] = max(gaps)
    json.dump(found, sys.stdout)


if __name__ == "__main__":
    main()
