"""``BatchKey``: which calls batch together, and how a group of them runs.

Calls whose keys are equal run as one call. A key is built once per distinct call
signature (callable, per-example input specs, static arguments) and cached, so its
cost is not paid per example.

How a group runs is the key's ``run``. The executor hands it the inputs of all the
calls of the group, position by position:

* ``combine = "stack"``: input ``j`` arrives as one tensor of shape ``(B, *spec_j)``,
  gathered from earlier batched outputs by views or one ``index_select``/``cat`` (never
  by stacking per-example tensors). ``run`` returns the batched result (a tensor or a
  tuple of tensors, each with leading dimension ``B``).
* ``combine = "list"``: input ``j`` arrives as a list of ``B`` per-example tensors, and
  ``run`` returns a list of ``B`` per-example results. This is for rules that need to
  see the examples separately (padding variable-length sequences, say).

Built-in keys, from fastest to most general: ``StackKey`` (callables that already take
a leading batch dimension), ``ElementwiseKey`` (broadcasting ops, with per-example
broadcasting kept), ``DimArgKey`` (ops with a ``dim`` argument), ``IndexKey``
(``h[...]``), ``VmapKey`` (anything, through ``torch.func.vmap``), and
``UnbatchedKey`` (one call at a time, for what cannot batch).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import torch

from batchgraph.promotion import (
    gradient_reads_wide,
    run_each_alone,
    run_reading_wide,
    run_with_wide_gradient,
    scalar_tensor_casts,
    scalar_tensor_moves,
    wide_gradient_input,
    wide_scalar_input,
)
from batchgraph.specs import CallSignature, InputSlot, TensorSpec, flatten_output

__all__ = [
    "BatchKey",
    "ConstantKey",
    "DimArgKey",
    "ElementwiseKey",
    "IndexKey",
    "ReductionKey",
    "StackKey",
    "UnbatchedKey",
    "VmapKey",
    "callable_name",
]


def callable_name(fn: Any) -> str:
    """A short human name for a callable: ``Linear(in=4, out=8)`` or ``torch.add``."""
    if isinstance(fn, torch.nn.Module):
        extra = fn.extra_repr()
        return f"{type(fn).__name__}({extra})" if extra else type(fn).__name__
    module = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    # Names a user can write: torch.tanh's qualname is _VariableFunctionsClass.tanh,
    # a tensor method's TensorBase.add (error messages advise rules={<name>: ...}).
    for prefix, shown in (("_VariableFunctionsClass.", "torch."), ("TensorBase.", "Tensor.")):
        if qual.startswith(prefix):
            return shown + qual[len(prefix):]
    if module.startswith("torch") and "." not in qual:
        return f"torch.{qual}"
    return f"{module}.{qual}" if module and module != "builtins" else qual


class BatchKey:
    """Base class of batching rules. Equal keys batch together.

    Subclass it for a callable that needs its own rule, and name the class in the
    module's ``batch_key`` attribute or register it with
    ``BatchingPolicy(rules={ModuleType: MyKey})``. Override ``identity`` to say what
    must match (the default: the callable and the whole call signature) and ``run``
    to say how a group runs.

    Attributes:
        fn: the callable (an ``nn.Module`` or a function).
        call: the call's ``CallSignature`` (static arguments and per-example specs).
        combine: ``"stack"`` or ``"list"`` (see the module docstring).
        batchable: False for keys whose calls run one at a time.
        deterministic: False when two identical calls may give different results
            (dropout): such calls are never merged by deduplication.
        in_order: True for calls that run one at a time in the order they were
            recorded (a forward keeping state of its own: ``batchgraph.ordering``).

    Example:
        >>> class SumKey(BatchKey):          # per-example x.sum() via a batched sum
        ...     def run(self, fn, inputs, size):
        ...         return inputs[0].flatten(1).sum(1)
    """

    combine: ClassVar[str] = "stack"
    batchable: ClassVar[bool] = True
    in_order = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Anything but "list" is read as "stack": a misspelt "lists" would hand run()
        # stacked tensors and fail only at the first batch, far from the typo.
        if cls.combine not in ("stack", "list"):
            raise TypeError(
                f"{cls.__name__}.combine is {cls.combine!r}; it must be 'stack' (run gets "
                "each input stacked) or 'list' (run gets lists of per-example tensors)"
            )

    def __init__(self, fn: Callable[..., Any], call: CallSignature, *, deterministic: bool = True):
        self.fn = fn
        self.call = call
        self.deterministic = deterministic
        identity = self.identity()
        try:
            self._hash = hash((type(self), identity))
        except TypeError as err:  # a list inside, say: name the method to fix
            raise TypeError(
                f"{type(self).__name__}.identity() returned {identity!r:.200}, which is not "
                f"hashable ({err}): keys are compared and hashed to batch calls, so return "
                "a tuple of hashable values (tuple(...) for a list)"
            ) from err

    def identity(self) -> Hashable:
        """What must be equal for two calls to batch: callable and full signature."""
        return (id(self.fn), self.call.statics)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (
            type(other) is type(self)
            and isinstance(other, BatchKey)
            and self._hash == other._hash
            and self.fn is other.fn
            and self.identity() == other.identity()
        )

    def __hash__(self) -> int:
        return self._hash

    @property
    def label(self) -> str:
        """How errors and stats name this key."""
        return f"{type(self).__name__}[{callable_name(self.fn)}]"

    def __repr__(self) -> str:
        return self.label

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        """Run ``size`` calls at once. See the module docstring for the contract."""
        return self.call.apply(fn, inputs)


class StackKey(BatchKey):
    """For callables that take a leading batch dimension (``nn.Linear``, ``LSTMCell``).

    The batched call is the per-example call with every tensor input stacked.

    Example:
        >>> import batchgraph as bg, torch
        >>> lin = bg.batched_func(torch.nn.Linear(3, 2))
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [lin(torch.full((3,), float(i))) for i in range(4)]
        >>> [tuple(t.shape) for t in bg.compute(hs)], p.stats.launches
        ([(2,), (2,), (2,), (2,)], 1)
    """


class ElementwiseKey(BatchKey):
    """Broadcasting elementwise ops (``torch.add``, ``torch.tanh``, ``h * 2``).

    Per-example broadcasting aligns shapes from the right; after stacking, an input
    of lower rank would broadcast against the batch dimension instead. So inputs of
    lower rank are viewed as ``(B, 1, ..., 1, *shape)`` first.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as p:   # (2, 3) + (3,) per example, as eagerly
        ...     hs = [bg.batched_value(torch.ones(2, 3)) + bg.batched_value(torch.arange(3.0))
        ...           for _ in range(2)]
        >>> bg.compute(hs)[0]
        tensor([[1., 2., 3.],
                [1., 2., 3.]])
    """

    def __init__(self, fn: Callable[..., Any], call: CallSignature, *, deterministic: bool = True):
        super().__init__(fn, call, deterministic=deterministic)
        ranks = [len(s.shape) for s in call.input_specs if s is not None]
        # A conversion does not broadcast (``x.to(other)`` takes only other's dtype and
        # device): padding x to other's rank would give it other's rank.
        top = 0 if fn in _CONVERSIONS else max(ranks, default=0)
        # One entry per input: the per-example shape padded on the left, or None.
        self._views: list[tuple[int, ...] | None] = [
            None if s is None or len(s.shape) >= top else (1,) * (top - len(s.shape)) + s.shape
            for s in call.input_specs
        ]
        # 0-d inputs promote and go with any device as numbers do (a conversion, top
        # 0, takes its argument's dtype and device: nothing to change).
        self._casts = casts = scalar_tensor_casts(fn, call) if top else None
        self._moves = scalar_tensor_moves(call) if top else None
        # A 0-d operand that eager code reads in float32 (x_f16 * c on the CPU): not
        # cast here; read wide, with the result rounded once to its cast's dtype.
        self._wide = wide_scalar_input(fn, call, casts)
        self._rounds_to: torch.dtype | None = None
        if casts is not None and self._wide is not None:
            self._rounds_to, casts[self._wide] = casts[self._wide], None
        # c * x: c read rounded, but x's gradient (grad * c) reads it in float32.
        self._wide_grad = wide_gradient_input(fn, call, casts)
        if casts is not None and self._wide_grad is not None:
            casts[self._wide_grad] = None
        self._alone_for_grad = gradient_reads_wide(fn, casts, call)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        if self._alone_for_grad and torch.is_grad_enabled() and any(
                x.requires_grad for x in inputs):
            return run_each_alone(self.call, fn, inputs, size)
        moves = self._moves
        if moves is not None:
            inputs = [x if d is None else x.to(d) for x, d in zip(inputs, moves)]
        casts = self._casts
        if casts is not None:
            inputs = [x if d is None else x.to(d) for x, d in zip(inputs, casts)]
        views = self._views
        if any(v is not None for v in views):
            inputs = [x if v is None else x.view(size, *v) for x, v in zip(inputs, views)]
        if self._rounds_to is not None and self._wide is not None:
            return run_reading_wide(self.call, fn, inputs, self._wide, self._rounds_to)
        if self._wide_grad is not None:
            return run_with_wide_gradient(self.call, fn, inputs, self._wide_grad)
        return self.call.apply(fn, inputs)


class DimArgKey(BatchKey):
    """Ops whose ``dim`` argument counts per-example dimensions (``cat``, ``softmax``).

    A non-negative ``dim`` is shifted by one for the batch dimension; negative ones
    already count from the end and stay. Built only when ``dim`` is an int.

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy() as p:   # softmax over each example's own dim 0
        ...     hs = [torch.softmax(bg.batched_value(torch.zeros(4)), 0) for _ in range(3)]
        >>> bg.compute(hs)[2], p.stats.launches
        (tensor([0.2500, 0.2500, 0.2500, 0.2500]), 1)
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        call: CallSignature,
        *,
        dim_position: int = 1,
        deterministic: bool = True,
    ):
        super().__init__(fn, call, deterministic=deterministic)
        dim = call.static_arg(dim_position, "dim", 0)
        self._batched_call = call.with_arg(dim_position, "dim", dim + 1 if dim >= 0 else dim)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return self._batched_call.apply(fn, inputs)


class ReductionKey(BatchKey):
    """A full reduction (``x.sum()``, ``x.argmax()``): each example's row, flattened.

    Per example the op reduces every element to a 0-d result; batched it reduces
    dimension 1 of the ``(B, -1)`` view, one value per example. Built only for calls
    with the tensor as their one argument (a ``dim`` goes to ``DimArgKey``).

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     hs = [bg.batched_value(torch.tensor([[1, 5], [7, 2]]) * i).argmax()
        ...           for i in (1, -1)]
        >>> bg.compute(hs)   # indices into each example's flattened values
        [tensor(2), tensor(0)]
    """

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return fn(inputs[0].reshape(size, -1), dim=1)


class IndexKey(BatchKey):
    """``h[idx]`` with a static index (ints, slices, ``None``, ``...``).

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     hs = [bg.batched_value(torch.arange(6.0).view(2, 3) + i)[:, 1] for i in (0, 10)]
        >>> bg.compute(hs)
        [tensor([1., 4.]), tensor([11., 14.])]
    """

    def __init__(self, fn: Callable[..., Any], call: CallSignature, *, deterministic: bool = True):
        super().__init__(fn, call, deterministic=deterministic)
        index = call.args[1]
        parts = index if type(index) is tuple else (index,)
        self._index = (slice(None), *parts)

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        return inputs[0][self._index]


class VmapKey(BatchKey):
    """Any per-example callable, batched with ``torch.func.vmap``.

    Correct for whatever ``vmap`` supports (per-example semantics by construction);
    random ops draw independent values per example (``randomness="different"``).

    Example:
        >>> import batchgraph as bg, torch
        >>> def trace_of(m):                 # no batching rule knows this function
        ...     return torch.trace(m)
        >>> trace = bg.batched_func(trace_of)
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [trace(torch.eye(3) * i) for i in (1.0, 2.0)]
        >>> bg.compute(hs), p.stats.launches
        ([tensor(3.), tensor(6.)], 1)
    """

    def __init__(self, fn: Callable[..., Any], call: CallSignature, *, deterministic: bool = True):
        super().__init__(fn, call, deterministic=deterministic)
        apply = call.apply

        def per_example(*xs: torch.Tensor) -> Any:
            out = apply(fn, xs)
            if isinstance(out, torch.Tensor):
                return out
            # vmap returns tensors only: a result holding None ((out, None) from
            # attention without weights) goes back as its tensors, in order, which is
            # all the executor reads of it.
            leaves: list[torch.Tensor] = []
            flatten_output(out, leaves)
            return tuple(leaves)

        self.per_example = per_example
        self._batched = torch.func.vmap(per_example, randomness="different")
        # Set once vmap has failed where the calls run alone: they then run one at a
        # time (``runs_alone``; the stats count them as unbatched).
        self.runs_alone = False

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        if self.runs_alone:
            return self._one_by_one(inputs, size)
        try:
            return self.run_vmapped(fn, inputs, size)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, IndexError) as err:
            if not inputs:
                raise
            # The probe on fake tensors (vmap_probe.probe_vmap) passed, but vmap refuses the
            # real tensors: some ops batch under fake tensors only (an assignment
            # through a boolean mask, `out[mask] = 0`, a RuntimeError; on examples
            # with no elements torch's vmap fails it with an IndexError about the
            # mask's shape). Each call still runs alone as it did eagerly; a call
            # failing alone too fails as the batch did.
            try:
                out = self._one_by_one(inputs, size)
            except Exception:
                raise err from None
            self.runs_alone = True
            return out

    def run_vmapped(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        """``run`` through vmap only (what the probe tries)."""
        if not inputs:  # nothing to map over: every call is the same static call
            out = self.call.apply(fn, ())
            return _expand(out, size)
        return self._batched(*inputs)

    def _one_by_one(self, inputs: Sequence[Any], size: int) -> Any:
        """The calls run one at a time, their outputs stacked as vmap stacks them."""
        outs = [self.per_example(*[x[i] for x in inputs]) for i in range(size)]
        if isinstance(outs[0], torch.Tensor):
            return torch.stack(outs)
        return tuple(torch.stack(column) for column in zip(*outs))


def _expand(out: Any, size: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out.unsqueeze(0).expand(size, *out.shape)
    if out is None:
        return None
    return tuple(_expand(o, size) for o in out)


class UnbatchedKey(BatchKey):
    """Runs the calls one at a time (the callable cannot batch). Stats count these.

    So do calls whose output is unknown until they run (a host read, a data-dependent
    shape), and calls recorded on such a result before it has run; calls recorded on
    it after a compute do batch (``batchgraph.signatures.computed_spec``).

    Example:
        >>> import batchgraph as bg, torch
        >>> def positive_sum(x):             # value-dependent Python: vmap cannot run it
        ...     return x.sum() if bool(x.sum() > 0) else -x.sum()
        >>> f = bg.batched_func(positive_sum)
        >>> with bg.BatchingPolicy() as p:
        ...     hs = [f(torch.full((2,), v)) for v in (1.0, -3.0)]
        >>> bg.compute(hs), p.stats.unbatched_calls, p.stats.launches
        ([tensor(2.), tensor(6.)], 2, 2)
    """

    combine: ClassVar[str] = "list"
    batchable: ClassVar[bool] = False

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        apply = self.call.apply
        return [apply(fn, [inp[i] for inp in inputs]) for i in range(size)]


_PYTHON_SCALARS = frozenset({bool, int, float})


class ConstantKey(BatchKey):
    """Per-example constants (``batched_value``): a group is stacked once."""

    def __init__(self, spec: TensorSpec):
        self.spec = spec
        super().__init__(torch.stack, CallSignature((InputSlot(0),), (), (spec,), ("const", spec)))

    def identity(self) -> Hashable:
        return self.spec

    @property
    def label(self) -> str:
        return f"constant{tuple(self.spec.shape)}"

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        values = inputs[0]
        if set(map(type, values)) <= _PYTHON_SCALARS:
            # Python scalars: one tensor construction for the whole group.
            return torch.tensor(values, dtype=self.spec.dtype, device=self.spec.device)
        return torch.stack([torch.as_tensor(v, device=self.spec.device) for v in values])


# Functions whose per-example semantics equal their batched semantics once inputs are
# rank-aligned (see ElementwiseKey).
ELEMENTWISE_FUNCTIONS: frozenset[Any] = frozenset(
    {
        torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.neg, torch.abs,
        torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.pow, torch.tanh, torch.sigmoid,
        torch.relu, torch.sin, torch.cos, torch.maximum, torch.minimum, torch.where,
        torch.clamp, torch.sign, torch.square, torch.reciprocal, torch.erf, torch.log1p,
        torch.expm1, torch.gt, torch.lt, torch.ge, torch.le, torch.eq, torch.ne,
        torch.logical_and, torch.logical_or, torch.logical_not, torch.remainder,
        torch.floor_divide, torch.bitwise_and, torch.bitwise_or, torch.bitwise_xor,
        torch.bitwise_not, torch.positive, torch.nn.functional.relu, torch.nn.functional.gelu,
        torch.nn.functional.silu, torch.nn.functional.elu, torch.nn.functional.leaky_relu,
        torch.nn.functional.softplus, torch.nn.functional.logsigmoid, torch.nn.functional.tanh,
        torch.nn.functional.sigmoid,
        torch.Tensor.add, torch.Tensor.sub, torch.Tensor.mul, torch.Tensor.div,
        torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__sub__, torch.Tensor.__rsub__,
        torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__,
        torch.Tensor.__rtruediv__, torch.Tensor.__neg__, torch.Tensor.__pow__,
        torch.Tensor.__rpow__, torch.Tensor.tanh, torch.Tensor.sigmoid, torch.Tensor.relu,
        torch.Tensor.exp, torch.Tensor.log, torch.Tensor.abs, torch.Tensor.neg,
        torch.Tensor.sqrt, torch.Tensor.pow, torch.Tensor.clamp, torch.Tensor.square,
        torch.Tensor.__abs__, torch.Tensor.sign, torch.Tensor.float, torch.Tensor.double,
        # Conversions act on each element too: a batch moves to the CPU in one copy.
        torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.long,
        torch.Tensor.int, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.bool,
        torch.Tensor.detach, torch.Tensor.clone,
        operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
    }
)

# Elementwise in the batching sense, but they take the dtype of an argument rather
# than promote with it.
_CONVERSIONS: frozenset[Any] = frozenset(
    {
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.double, torch.Tensor.long,
        torch.Tensor.int, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.bool,
        torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.detach, torch.Tensor.clone,
    }
)

# Reductions: with no argument but the tensor they reduce it whole (ReductionKey);
# with an int ``dim`` (position 1) it counts per-example dimensions (DimArgKey).
REDUCTION_FUNCTIONS: frozenset[Any] = frozenset(
    {
        torch.sum, torch.mean, torch.prod, torch.amax, torch.amin, torch.argmax,
        torch.argmin, torch.logsumexp, torch.Tensor.sum, torch.Tensor.mean,
        torch.Tensor.prod, torch.Tensor.amax, torch.Tensor.amin, torch.Tensor.argmax,
        torch.Tensor.argmin, torch.Tensor.logsumexp,
    }
)

# Functions with a ``dim`` argument at the given position that DimArgKey can shift.
DIM_FUNCTIONS: dict[Any, int] = {
    torch.cat: 1,
    torch.concat: 1,
    torch.concatenate: 1,
    torch.stack: 1,
    torch.softmax: 1,
    torch.log_softmax: 1,
    torch.nn.functional.softmax: 1,
    torch.nn.functional.log_softmax: 1,
    torch.Tensor.softmax: 1,
    torch.Tensor.log_softmax: 1,
    # Through vmap its backward doubled the gradient of ``src`` (torch 2.13).
    torch.select_scatter: 2,
    torch.Tensor.select_scatter: 2,
}

# Random functions: identical calls must not be merged by deduplication.
RANDOM_FUNCTIONS: frozenset[Any] = frozenset(
    {
        torch.dropout, torch.nn.functional.dropout, torch.rand_like, torch.randn_like,
        torch.bernoulli, torch.multinomial, torch.normal, torch.randint_like,
        torch.nn.functional.alpha_dropout, torch.nn.functional.gumbel_softmax,
    }
)
