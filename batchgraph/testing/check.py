"""``assert_batched_matches_eager``: the check users put in their own test suites.

It runs a per-example function eagerly, one example at a time (the reference), and
again under a ``BatchingPolicy`` (an ``async def`` one: through ``bg.run_all``), then
compares every output tensor (values, shape, dtype, device and whether it requires
grad), every plain value in the results (``batchgraph.testing.leaves``) and every
gradient: of the parameters of ``fn``'s module (or, for a plain function or lambda, of
the modules and tensors it closes over, as ``batchgraph.captured`` finds them), of the
examples' own tensors that require grad, and of any other leaf tensor the eager
outputs' autograd graph reaches. The gradients come from a loss that weights each output element by
a fixed pseudo-random number, so a batched run that mixes up examples or rows cannot
pass by accident (a plain ``sum`` would hide permutations).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchgraph.captured import captured_tensors
from batchgraph.coroutines import run_all
from batchgraph.policy import BatchingPolicy
from batchgraph.scheduling import ScheduleStats
from batchgraph.testing.leaves import Leaf, first_difference, flatten, scalar_differs

__all__ = ["BatchedCheckReport", "assert_batched_matches_eager"]


@dataclass
class BatchedCheckReport:
    """What the check compared: sizes, largest differences, and the batched run's stats.

    Attributes:
        examples: how many examples ran.
        outputs_compared: output leaves compared (tensors and plain values).
        gradients_compared: parameters and example tensors whose gradients were compared.
        max_output_diff: the largest absolute difference among the output tensors.
        max_gradient_diff: the largest absolute difference among the gradients.
        stats: the batched run's last compute (for ``async def`` examples, the first
            lane's last step).
    """

    examples: int
    outputs_compared: int
    gradients_compared: int
    max_output_diff: float
    max_gradient_diff: float
    stats: ScheduleStats | None


def _weighted_loss(outputs: Sequence[Leaf]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    total: torch.Tensor | None = None
    for _, t in outputs:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        if t.is_complex():  # both parts weighted, so each carries a gradient
            t = torch.view_as_real(t.resolve_conj())
        weight = torch.rand(t.shape, generator=generator, dtype=t.dtype).to(t.device)
        term = (t * weight).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError(
            "no floating-point or complex tensor among the outputs to differentiate, so "
            "gradients cannot be compared; pass check_gradients=False for a function that "
            "returns only integer or bool tensors or plain Python values"
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


def _graph_leaves(
    fn: Callable[..., Any], outputs: Sequence[Leaf], known: set[int]
) -> list[tuple[str, torch.Tensor]]:
    """The tensors requiring grad that the eager outputs' autograd graph reaches and
    ``known`` (ids) does not hold: parameters of a model that ``fn`` reads through an
    object of its own (``wrapper.run`` calling ``self.model.encode``, a callable
    object), which neither ``fn.__self__`` nor what ``fn`` closes over shows. Named by
    their attribute path from that object where one holds them as a module's."""
    names: dict[int, str] = {}
    owner = getattr(fn, "__self__", fn)
    for attr, value in getattr(owner, "__dict__", {}).items():
        if isinstance(value, nn.Module):
            names.update({id(p): f"{attr}.{n}" for n, p in value.named_parameters()})
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[Any] = set()
    stack = [t.grad_fn for _, t in outputs if isinstance(t, torch.Tensor)]
    while stack:
        node = stack.pop()
        if node is None or node in seen:  # autograd's node objects are unique per node
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's gradient
        if isinstance(leaf, torch.Tensor) and id(leaf) not in known:
            known.add(id(leaf))
            found.append((names.get(id(leaf), f"tensor of shape {tuple(leaf.shape)} the "
                          "eager outputs depend on"), leaf))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _input_leaves(examples: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    # The examples' own tensors that require grad: their gradients are compared too.
    flat: list[Leaf] = []
    for i, example in enumerate(examples):
        flatten(example, f"example {i}: input", flat)
    return [
        (path, t) for path, t in flat
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
    ]


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}, requires_grad={t.requires_grad}"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    wide = torch.complex128 if a.is_complex() else torch.float64
    a, b = a.detach().to(wide), b.detach().to(wide)
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
        fn: per-example function (e.g. ``model.encode``), or an ``async def`` one whose
            examples await ``bg.value`` (run batched by ``bg.run_all``); it returns
            tensors and plain values (numbers, strings, None), or lists, tuples, dicts
            and dataclasses of them. Plain values are compared too (numbers within the
            tolerances).
        examples: the inputs, one per call of ``fn``; their tensors that require grad
            have their gradients compared too.
        module: whose parameter gradients to compare; defaults to ``fn.__self__``, and
            for a plain function to the modules and tensors it closes over or names;
            without ``module``, every other tensor requiring grad that the eager
            outputs depend on too (a model read through an object of yours).
        rtol, atol: tolerances (use ~1e-10 in float64).
        check_gradients: also compare parameter gradients.
        **policy_options: passed to ``BatchingPolicy`` (e.g. ``scheduler="depth"``;
            for coroutine examples, to each lane's policy).

    Returns:
        A ``BatchedCheckReport``.

    Raises:
        AssertionError: naming the first example, output path or parameter that differs,
            with the largest difference (or the shapes, dtypes, devices and
            ``requires_grad`` that differ). NaN where the eager output has NaN matches.
        TypeError: for ``fn`` that returns a coroutine for some examples only, or a
            coroutine example that awaits something other than ``bg.value``.
        ValueError: when gradients are to be compared but no output is a floating
            point or complex tensor (pass ``check_gradients=False``).

    Warns:
        UserWarning: when ``fn`` recorded no call under the policy (it ran eagerly there
            too, so nothing batched was checked), or when ``examples`` is empty.

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
        >>> report.examples, report.outputs_compared, report.gradients_compared
        (4, 4, 2)
        >>> report.stats.launches   # lin, then tanh, each once for the 4 examples
        2
    """
    examples = list(examples)
    params = _parameters(fn, module)
    seen = {id(p) for _, p in params}
    params += [(path, t) for path, t in _input_leaves(examples) if id(t) not in seen]

    if not examples:
        # An exhausted generator, or a strategy that may draw an empty list: the check
        # would pass having compared nothing.
        warnings.warn(
            "assert_batched_matches_eager got no examples, so it compared nothing; pass "
            "at least one (with hypothesis, st.lists(..., min_size=1))",
            stacklevel=2,
        )
    eager, batched, policies = _run_both(fn, examples, policy_options)
    if examples and not any(p.graph.calls_recorded for p in policies):
        warnings.warn(
            f"{getattr(fn, '__qualname__', fn)!r} recorded no call under the BatchingPolicy: "
            "it ran eagerly there too, so this check compared eager with eager. Calls "
            "record on handles: wrap the examples' tensors with bg.batched_value, or call "
            "submodules of a bg.BatchedModule",
            stacklevel=2,
        )
    eager_flat: list[Leaf] = []
    batched_flat: list[Leaf] = []
    for i, (e, b) in enumerate(zip(eager, batched)):
        flatten(e, f"example {i}: output", eager_flat)
        flatten(b, f"example {i}: output", batched_flat)
    if module is None:
        params += _graph_leaves(fn, eager_flat, {id(p) for _, p in params})
    where = first_difference(eager_flat, batched_flat)
    if where is not None:
        raise AssertionError(f"batched outputs do not have the eager structure: {where}")
    max_out = _compare_outputs(eager_flat, batched_flat, rtol, atol)
    compared, max_grad = (
        _compare_gradients(params, eager_flat, batched_flat, rtol, atol)
        if check_gradients and params and eager_flat
        else (0, 0.0)
    )
    return BatchedCheckReport(
        examples=len(examples),
        outputs_compared=len(eager_flat),
        gradients_compared=compared,
        max_output_diff=max_out,
        max_gradient_diff=max_grad,
        stats=policies[0].stats if policies else None,
    )


def _run_both(
    fn: Callable[[Any], Any], examples: list[Any], policy_options: dict[str, Any]
) -> tuple[list[Any], list[Any], list[BatchingPolicy]]:
    """``fn`` over ``examples`` eagerly and batched: the results of each, and the
    policies that recorded. A coroutine function (``async def`` examples) runs batched
    by ``run_all``, and eagerly to its end (each await finishes at once there)."""
    eager = [fn(x) for x in examples]
    coroutines = [inspect.iscoroutine(r) for r in eager]
    if not any(coroutines):
        with BatchingPolicy(**policy_options) as policy:
            handles = [fn(x) for x in examples]
        return eager, policy.compute(handles), [policy]
    if not all(coroutines):
        for r in eager:
            if inspect.iscoroutine(r):
                r.close()
        raise TypeError(
            f"{getattr(fn, '__qualname__', fn)!r} returned a coroutine for example "
            f"{coroutines.index(True)} but not for example {coroutines.index(False)}; "
            "the check runs either per-example functions or coroutine examples: make "
            "fn always an async def (or never)"
        )
    eager = [_run_eagerly(c, i) for i, c in enumerate(eager)]
    policies: list[BatchingPolicy] = []

    def make_policy() -> BatchingPolicy:
        policies.append(BatchingPolicy(**policy_options))
        return policies[-1]

    batched = run_all([fn(x) for x in examples], make_policy=make_policy)
    return eager, batched, policies


def _run_eagerly(coroutine: Coroutine[Any, Any, Any], index: int) -> Any:
    # Outside run_all an await of bg.value finishes at once: the coroutine runs to its
    # end in one send. One that suspends awaited something run_all refuses as well.
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise TypeError(
        f"example {index}: the coroutine suspended when run eagerly, so it awaited "
        "something other than bg.value(...) or a handle, which run_all cannot batch "
        "either; await only bg.value(...) in the examples checked"
    )


def _compare_outputs(eager: list[Leaf], batched: list[Leaf], rtol: float, atol: float) -> float:
    """Raise at the first output that differs; else return the largest difference."""
    max_out = 0.0
    for (path, eo), (_, bo) in zip(eager, batched):
        if not isinstance(eo, torch.Tensor) or not isinstance(bo, torch.Tensor):
            if isinstance(eo, torch.Tensor) or isinstance(bo, torch.Tensor) or scalar_differs(
                eo, bo, rtol, atol
            ):
                raise AssertionError(f"{path} differs: eager {eo!r}, batched {bo!r}")
            continue
        if (eo.shape, eo.dtype, eo.device, eo.requires_grad) != (
            bo.shape, bo.dtype, bo.device, bo.requires_grad
        ):
            raise AssertionError(f"{path}: eager {_describe(eo)}, batched {_describe(bo)}")
        diff = _max_diff(eo, bo)
        max_out = max(max_out, diff)
        if not torch.allclose(bo.detach(), eo.detach(), rtol=rtol, atol=atol, equal_nan=True):
            raise AssertionError(f"{path} differs: max abs diff {diff:.3g} (rtol={rtol}, atol={atol})")
    return max_out


def _compare_gradients(
    params: list[tuple[str, Any]],
    eager: list[Leaf],
    batched: list[Leaf],
    rtol: float,
    atol: float,
) -> tuple[int, float]:
    """Raise at the first gradient that differs under the weighted loss; else return
    how many were compared and the largest difference."""
    tensors = [p for _, p in params]
    grads: list[Sequence[torch.Tensor | None]] = []
    for flat in (eager, batched):
        loss = _weighted_loss(flat)
        # Outputs with no autograd graph (computed under no_grad, or a batched run cut
        # off from autograd) reach no parameter at all.
        grads.append(
            torch.autograd.grad(loss, tensors, allow_unused=True)
            if loss.requires_grad
            else (None,) * len(tensors)
        )
    max_grad = 0.0
    compared = 0
    for (name, _), e, b in zip(params, *grads):
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
    return compared, max_grad
