"""``assert_batched_matches_eager``: the check users put in their own test suites.

It runs a per-example function eagerly, one example at a time (the reference), and
again under a ``BatchingPolicy``, then compares every output tensor (values, shape,
dtype, device and whether it requires grad) and every gradient: of the parameters of
``fn``'s module (or, for a plain function or lambda, of the modules and tensors it
closes over, as ``batchgraph.captured`` finds them), and of the examples' own tensors
that require grad. The gradients come from a loss that weights each output element by
a fixed pseudo-random number, so a batched run that mixes up examples or rows cannot
pass by accident (a plain ``sum`` would hide permutations).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgraph.captured import captured_tensors
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
        raise ValueError(
            "no floating-point output to differentiate, so gradients cannot be compared; "
            "pass check_gradients=False for a function that returns only integers or bools"
        )
    return total


def _parameters(fn: Callable[..., Any], module: nn.Module | None) -> list[tuple[str, Any]]:
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"module= must be an nn.Module, got {type(module).__name__}")
    owner = module if module is not None else getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return [(n, p) for n, p in owner.named_parameters() if p.requires_grad]
    # A plain function or a lambda (``lambda t: model.logits(t)``): the parameters of
    # the modules and the tensors it closes over or names. Without them its gradients
    # would go unchecked, and a rule that cuts autograd would pass.
    found = [t for t in captured_tensors(fn) if t.requires_grad and t.is_leaf]
    return [(f"captured tensor {i} of shape {tuple(t.shape)}", t) for i, t in enumerate(found)]


def _input_leaves(examples: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    # The examples' own tensors that require grad: their gradients are compared too.
    flat: list[tuple[str, torch.Tensor]] = []
    for i, example in enumerate(examples):
        _flatten(example, f"example {i}: input", flat)
    return [(path, t) for path, t in flat if t.requires_grad and t.is_leaf]


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}, requires_grad={t.requires_grad}"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    both_nan = torch.isnan(a) & torch.isnan(b)  # NaN where eager has NaN is a match
    return float(torch.where(both_nan, 0.0, (a - b).abs()).max().item())


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
        examples: the inputs, one per call of ``fn``; their tensors that require grad
            have their gradients compared too.
        module: whose parameter gradients to compare; defaults to ``fn.__self__``, and
            for a plain function to the modules and tensors it closes over or names.
        rtol, atol: tolerances (use ~1e-10 in float64).
        check_gradients: also compare parameter gradients.
        **policy_options: passed to ``BatchingPolicy`` (e.g. ``scheduler="depth"``).

    Returns:
        A ``BatchedCheckReport``.

    Raises:
        AssertionError: naming the first example, output path or parameter that differs,
            with the largest difference (or the shapes, dtypes, devices and
            ``requires_grad`` that differ). NaN where the eager output has NaN matches.

    Warns:
        UserWarning: when ``fn`` recorded no call under the policy (it ran eagerly there
            too, so nothing batched was checked).

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
    seen = {id(p) for _, p in params}
    params += [(path, t) for path, t in _input_leaves(examples) if id(t) not in seen]

    eager = [fn(x) for x in examples]
    eager_flat: list[tuple[str, torch.Tensor]] = []
    for i, value in enumerate(eager):
        _flatten(value, f"example {i}: output", eager_flat)
    with BatchingPolicy(**policy_options) as policy:
        handles = [fn(x) for x in examples]
    batched = policy.compute(handles)
    if examples and not policy.graph.calls_recorded:
        warnings.warn(
            f"{getattr(fn, '__qualname__', fn)!r} recorded no call under the BatchingPolicy: "
            "it ran eagerly there too, so this check compared eager with eager. Calls "
            "record on handles: wrap the examples' tensors with bg.batched_value, or call "
            "submodules of a bg.BatchedModule",
            stacklevel=2,
        )
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
        if (eo.shape, eo.dtype, eo.device, eo.requires_grad) != (
            bo.shape, bo.dtype, bo.device, bo.requires_grad
        ):
            raise AssertionError(f"{path}: eager {_describe(eo)}, batched {_describe(bo)}")
        diff = _max_diff(eo, bo)
        max_out = max(max_out, diff)
        if not torch.allclose(bo.detach(), eo.detach(), rtol=rtol, atol=atol, equal_nan=True):
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
            diff = _max_diff(e, b)
            max_grad = max(max_grad, diff)
            compared += 1
            if not torch.allclose(b, e, rtol=rtol, atol=atol, equal_nan=True):
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
