"""``assert_batched_matches_eager``: the check users put in their own test suites.

It runs a per-example function eagerly, one example at a time (the reference), and
again under a ``BatchingPolicy``, then compares every output tensor and every
parameter gradient. The gradients come from a loss that weights each output element
by a fixed pseudo-random number, so a batched run that mixes up examples or rows
cannot pass by accident (a plain ``sum`` would hide permutations).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgraph.policy import BatchingPolicy
from batchgraph.scheduling import ScheduleStats

__all__ = ["BatchedCheckReport", "assert_batched_matches_eager"]


@dataclass
class BatchedCheckReport:
    """What the check compared: sizes, largest differences, and the batched run's stats."""

    examples: int
    outputs_compared: int
    gradients_compared: int
    max_output_diff: float
    max_gradient_diff: float
    stats: ScheduleStats | None


def _flatten(value: Any, path: str, out: list[tuple[str, torch.Tensor]]) -> None:
    if isinstance(value, torch.Tensor):
        out.append((path, value))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{path}[{k!r}]", out)


def _weighted_loss(outputs: Sequence[tuple[str, torch.Tensor]]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    total: torch.Tensor | None = None
    for _, t in outputs:
        if not t.is_floating_point():
            continue
        weight = torch.rand(t.shape, generator=generator, dtype=t.dtype).to(t.device)
        term = (t * weight).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no floating-point output to differentiate")
    return total


def _parameters(fn: Callable[..., Any], module: nn.Module | None) -> list[tuple[str, Any]]:
    owner = module if module is not None else getattr(fn, "__self__", None)
    if owner is None:
        return []
    if not isinstance(owner, nn.Module):
        raise TypeError(f"module= must be an nn.Module, got {type(owner).__name__}")
    return [(n, p) for n, p in owner.named_parameters() if p.requires_grad]


def assert_batched_matches_eager(
    fn: Callable[[Any], Any],
    examples: Iterable[Any],
    *,
    module: nn.Module | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    check_gradients: bool = True,
    **policy_options: Any,
) -> BatchedCheckReport:
    """Check that batching ``fn`` over ``examples`` changes neither outputs nor gradients.

    Args:
        fn: per-example function (e.g. ``model.encode``); it must return tensors, or
            lists/tuples/dicts of them.
        examples: the inputs, one per call of ``fn``.
        module: whose parameter gradients to compare; defaults to ``fn.__self__``.
        rtol, atol: tolerances (use ~1e-10 in float64).
        check_gradients: also compare parameter gradients.
        **policy_options: passed to ``BatchingPolicy`` (e.g. ``scheduler="depth"``).

    Returns:
        A ``BatchedCheckReport``.

    Raises:
        AssertionError: naming the first example, output path or parameter that differs,
            with the largest difference.

    Example:
        >>> import batchgraph as bg, torch
        >>> from batchgraph.testing import assert_batched_matches_eager
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(3, 2)
        ...     def f(self, x):
        ...         return torch.tanh(self.lin(x))
        >>> report = assert_batched_matches_eager(M().f, [torch.randn(3) for _ in range(4)])
        >>> report.examples
        4
    """
    examples = list(examples)
    params = _parameters(fn, module)

    eager = [fn(x) for x in examples]
    eager_flat: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(eager):
        _flatten(value, f"example {i}: output", eager_flat)
    with BatchingPolicy(**policy_options) as policy:
        handles = [fn(x) for x in examples]
    batched = policy.compute(handles)
    batched_flat: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(batched):
        _flatten(value, f"example {i}: output", batched_flat)

    if [p for p, _ in eager_flat] != [p for p, _ in batched_flat]:
        raise AssertionError(
            "batched outputs do not have the eager structure: eager "
            f"{[p for p, _ in eager_flat][:5]} vs batched {[p for p, _ in batched_flat][:5]}"
        )
    max_out = 0.0
    for (path, eo), (_, bo) in zip(eager_flat, batched_flat):
        if eo.shape != bo.shape:
            raise AssertionError(f"{path}: eager shape {tuple(eo.shape)}, batched {tuple(bo.shape)}")
        diff = (eo.detach().double() - bo.detach().double()).abs().max().item() if eo.numel() else 0.0
        max_out = max(max_out, diff)
        if not torch.allclose(bo.detach(), eo.detach(), rtol=rtol, atol=atol):
            raise AssertionError(f"{path} differs: max abs diff {diff:.3g} (rtol={rtol}, atol={atol})")

    max_grad = 0.0
    compared = 0
    e: torch.Tensor | None
    b: torch.Tensor | None
    if check_gradients and params:
        tensors = [p for _, p in params]
        eager_grads = torch.autograd.grad(
            _weighted_loss(eager_flat), tensors, allow_unused=True
        )
        batched_loss = _weighted_loss(batched_flat)
        # A batched run cut off from autograd reaches no parameter at all.
        batched_grads = (
            torch.autograd.grad(batched_loss, tensors, allow_unused=True)
            if batched_loss.requires_grad
            else (None,) * len(tensors)
        )
        for (name, _), e, b in zip(params, eager_grads, batched_grads):
            if e is None and b is None:
                continue
            if e is None or b is None:
                raise AssertionError(
                    f"gradient of {name}: eager {'none' if e is None else 'set'}, "
                    f"batched {'none' if b is None else 'set'}"
                )
            diff = (e.double() - b.double()).abs().max().item()
            max_grad = max(max_grad, diff)
            compared += 1
            if not torch.allclose(b, e, rtol=rtol, atol=atol):
                raise AssertionError(
                    f"gradient of parameter {name} differs: max abs diff {diff:.3g} "
                    f"(rtol={rtol}, atol={atol})"
                )
    return BatchedCheckReport(
        examples=len(examples),
        outputs_compared=len(eager_flat),
        gradients_compared=compared,
        max_output_diff=max_out,
        max_gradient_diff=max_grad,
        stats=policy.stats,
    )
