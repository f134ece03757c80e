"""Random per-example programs that are DAGs over values of mixed dtypes.

Where ``tensor_programs`` applies a catalog of operations to one float64 value at a
time, these programs start from three inputs per example (a floating or complex value,
a value of any dtype, an int64 index vector), reuse every value made so far as either
operand, and combine them with plain tensors shared by all examples, Python scalars
and 0-d tensors of every dtype: type promotion (bool, int64, float32, float64, complex128),
broadcasting between per-example values and shared ones, in-place changes of
recorded values (``add_``, ``copy_``, ``masked_fill_``, ``index_put_``, ``h[i] = v``),
view chains, advanced indexing, scatter and gather, sorting and scans, products, a
module's parameters, and data-dependent shapes, computed as soon as they are made so
that later steps take them as inputs in a later compute of the same policy.

An operation takes ``(a, b, c)``: two values picked from those made so far and a small
int choosing the variant; it returns a value, or None where it does not fit (read from
what a handle answers before it is computed: shape, dtype). It runs unchanged on
tensors and on handles. A step that fails eagerly (``int.add_(float)``, shapes that do
not broadcast) is left out of both runs (``run_eagerly`` reports which).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import batchgraph as bg
from tests.property.dag_math_ops import MATH_OPS
from tests.property.tensor_programs import broadcasts

Op = Callable[[Any, Any, int], Any]
Step = tuple[str, int, int, int]

D = torch.float64
# The dtypes values are cast to (float64 twice as often: the checks are exact there).
DTYPES = [D, D, torch.float32, torch.int64, torch.bool, torch.complex128]

# Plain tensors every example shares, and 0-d tensors and Python scalars of every kind.
PLAIN: dict[str, torch.Tensor] = {
    "v4": torch.linspace(-1, 1, 4, dtype=D),
    "m34": torch.linspace(-2, 2, 12, dtype=D).reshape(3, 4),
    "i4": torch.tensor([3, -1, 0, 2]),
    "b4": torch.tensor([True, False, True, True]),
    "f4": torch.linspace(0.5, 2, 4),
    "z": torch.tensor(1.5, dtype=D),
    "zi": torch.tensor(3),
    "zb": torch.tensor(True),
    "z32": torch.tensor(0.25),
    "zc": torch.tensor(1 + 2j, dtype=torch.complex64),
}
SCALARS: list[Any] = [2, -1, 0.5, True, 1.5j, *PLAIN.values()]

# A module whose parameters the gradients are compared for (float64).
LINEAR = nn.Linear(4, 4).double()
_LINEAR = bg.batched_func(LINEAR)


def _is_value(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, bg.ResultHandle))


def _real(a: Any) -> Any:
    if not _is_value(a):
        return a.real if isinstance(a, complex) else a
    return a.real if a.is_complex() else a


def _dim(a: Any, c: int) -> int:
    rank = max(a.ndim, 1)
    return c % (2 * rank) - rank


def _operand(a: Any, b: Any, c: int) -> Any:
    """The second operand: the other value (summed where it does not broadcast), a
    scalar or 0-d tensor, or a plain tensor (None where it does not broadcast)."""
    kind = c % 3
    if kind == 0:
        return b if broadcasts(a, b) else b.sum()
    if kind == 1:
        return SCALARS[(c // 3) % len(SCALARS)]
    plain = list(PLAIN.values())[(c // 3) % len(PLAIN)]
    return plain if broadcasts(a, plain) else None


def _binary(fn: Callable[[Any, Any], Any]) -> Op:
    def op(a: Any, b: Any, c: int) -> Any:
        other = _operand(a, b, c)
        if other is None:
            return None
        # Either side (a scalar stays on the right: torch functions take a tensor first).
        return fn(other, a) if (c // 5) % 2 and _is_value(other) else fn(a, other)
    return op


def _cast(a: Any, b: Any, c: int) -> Any:
    dtype = DTYPES[c % len(DTYPES)]
    return (a if dtype.is_complex else _real(a)).to(dtype)


def _unary(a: Any, b: Any, c: int) -> Any:
    kind = c % 7
    if kind == 0:
        return ~a if a.dtype == torch.bool else -a
    if kind == 1:
        return a.abs()
    if kind == 2:
        return torch.sign(_real(a))
    if kind == 3:
        return torch.sigmoid(_real(a).double())
    if kind == 4:
        return a.abs().double().sqrt() if not a.is_complex() else a.sqrt()
    if kind == 5:
        return torch.round(_real(a).double() * 2)
    return torch.tanh(a if a.is_floating_point() else a.double())


def _reduce(a: Any, b: Any, c: int) -> Any:
    a, kind, dim = _real(a), c % 5, _dim(a, c // 5)
    if kind == 0:
        return a.sum()
    if kind == 1:
        return a.sum(dim, keepdim=c % 2 == 0)
    if kind == 2:
        return a.double().mean(dim) if a.numel() else None
    if kind == 3:
        return a.double().amax(dim) if a.numel() else None
    return torch.logsumexp(a.double(), dim)


def _view(a: Any, b: Any, c: int) -> Any:
    kind = c % 12
    if a.ndim == 0:
        return a.unsqueeze(0) if kind % 2 else a.reshape(1)
    last = a.shape[-1]
    views: dict[int, Callable[[], Any]] = {
        0: lambda: a.unsqueeze(_dim(a, c // 12)),
        1: lambda: a.reshape(-1),
        2: lambda: a.t() if a.ndim == 2 else a.flip(0),
        3: lambda: a.transpose(0, -1),
        4: lambda: a.narrow(-1, 0, max(last - 1, 0)),
        5: lambda: a.select(0, -1) if a.shape[0] else None,
        6: lambda: a.expand(2, *a.shape),
        7: lambda: a.unbind(-1)[0] if last else None,
        8: lambda: a.diagonal() if a.ndim >= 2 else a[..., ::2],
        9: lambda: a.permute(*reversed(range(a.ndim))),
        10: lambda: a.split(1, dim=-1)[-1] if last else None,
        11: lambda: a.movedim(0, -1)[..., 1:],
    }
    return views[kind]()


def _index(a: Any, b: Any, c: int) -> Any:
    """Indexing by an index made from another value (a handle when recorded)."""
    if a.ndim == 0 or a.shape[0] == 0 or b.numel() == 0:
        return None
    index = (b if b.dtype == torch.int64 else _real(b).double().abs().floor().long()) % a.shape[0]
    flat, kind = index.reshape(-1), c % 6
    if kind == 0:
        return a[index]
    if kind == 1:
        return a.index_select(0, flat)
    if kind == 2:
        return a[flat[0]]
    if kind == 3:
        return torch.take_along_dim(a, flat, 0) if a.ndim == 1 else None
    if kind == 4:
        if a.dtype == torch.bool or flat.shape[0] > a.shape[0]:
            return None
        return a.index_add(0, flat, a[: flat.shape[0]])
    return a.scatter(0, flat, a[: flat.shape[0]]) if a.ndim == 1 and flat.shape[0] <= a.shape[0] else None


def _combine(a: Any, b: Any, c: int) -> Any:
    """cat and stack of values and plain tensors."""
    plain = PLAIN["m34"]
    kind = c % 3
    if kind == 0 and a.shape == b.shape and a.dtype == b.dtype:
        return torch.stack([a, b, a], dim=c % (a.ndim + 1))
    if kind == 1 and a.ndim == 2 and a.shape[1:] == plain.shape[1:]:
        return torch.cat([plain, a, plain])
    if a.ndim and b.ndim == a.ndim and a.shape[1:] == b.shape[1:]:
        return torch.cat([a, b])
    return torch.stack([a, a * 1])


def _change(z: Any, b: Any, c: int) -> Any:
    """``z`` changed in place by an in-place method, augmented or item assignment."""
    v = b if broadcasts(z, b) and torch.broadcast_shapes(z.shape, b.shape) == z.shape else b.sum()
    if not (z.is_floating_point() or z.is_complex()):
        # Eagerly an int tensor changed by a value that requires grad gets a grad_fn
        # (which torch allows nowhere else), and so do the floats made from it.
        v = v.detach()
    kind = c % 10
    if kind == 0:
        z.add_(v)
    elif kind == 1:
        z.mul_(v)
    elif kind == 2:
        z.clamp_(-1, 1)
    elif kind == 3:
        z.masked_fill_(_real(z) > 0, 2)
    elif kind == 4:
        z.copy_(v)
    elif kind == 5:
        z.index_put_((torch.tensor([0]),), torch.tensor(5).to(z.dtype)) if z.ndim else z.fill_(3)
    elif kind == 6:
        z += v
    elif kind == 7:
        z[...] = v
    elif kind == 8:
        z[_real(z) > 0] = 7
    elif z.ndim:
        z[0] = v.sum() if v.ndim else v
    return z


def _in_place(a: Any, b: Any, c: int) -> Any:
    """A copy of ``a`` changed in place (``a * 1`` or ``a.clone()``)."""
    return _change(a.clone() if c % 2 else a * 1, b, c // 2)


def _scan(a: Any, b: Any, c: int) -> Any:
    a, kind, dim = _real(a), c % 6, _dim(a, c // 6)
    if kind == 0:
        return a.cumsum(dim)
    if kind == 1:
        return a.double().cumprod(dim)
    if kind == 2:
        return a.sort(dim, descending=c % 2 == 0).values
    if kind == 3:
        return a.argsort(dim, stable=True)
    if kind == 4:
        return a.double().topk(1, dim).values if a.ndim and a.shape[dim] else None
    return torch.cummax(a, dim).values


def _product(a: Any, b: Any, c: int) -> Any:
    """matmul, einsum and a module (float64, trailing dimension 4)."""
    if a.ndim == 0 or a.dtype == torch.bool:
        return None
    kind = c % 3
    if kind == 0 and b.ndim and b.ndim <= 2 and b.shape[0] == a.shape[-1] and b.dtype == a.dtype:
        return a @ b
    if kind == 1 and a.shape[-1] == 4 and a.dtype == D:
        return _LINEAR(a)
    if a.shape[-1] != 4:
        return None
    plain = PLAIN["m34"].to(a.dtype)
    return torch.einsum("...j,kj->...k", a, plain) if c % 2 else a @ PLAIN["v4"].to(a.dtype)


def _data_dependent(a: Any, b: Any, c: int) -> Any:
    kind = c % 3
    if kind == 0:
        return a[_real(a) > 0] if a.dtype != torch.bool else a.nonzero()
    if kind == 1:
        return a.nonzero()
    return torch.masked_select(a, _real(a).double().abs() > 0.5)


def _copy(a: Any, b: Any, c: int) -> Any:
    """A copy of ``a``: the step ``computed`` computes it as soon as it is made."""
    return a.clone() if c % 3 else a * 1


OPS: dict[str, Op] = {
    "add": _binary(lambda x, y: x + y),
    "sub": _binary(lambda x, y: x - y),
    "mul": _binary(lambda x, y: x * y),
    "div": _binary(lambda x, y: x / y),
    "maximum": _binary(lambda x, y: torch.maximum(
        _real(x), _real(y if _is_value(y) else torch.as_tensor(y)))),
    "where": _binary(lambda x, y: torch.where(_real(x) > 0, x, y)),
    "lt": _binary(lambda x, y: _real(x) < _real(y)),
    "and": _binary(lambda x, y: (x != 0) & (y != 0)),
    "floordiv": _binary(lambda x, y: torch.floor_divide(_real(x), 3)),
    "remainder": _binary(lambda x, y: torch.remainder(_real(x), 2)),
    "atan2": _binary(lambda x, y: torch.atan2(_real(x).double(), _real(y).double()
                                              if _is_value(y) else torch.tensor(1.0, dtype=D))),
    "cast": _cast,
    "unary": _unary,
    "reduce": _reduce,
    "view": _view,
    "index": _index,
    "combine": _combine,
    "in_place": _in_place,
    "scan": _scan,
    "product": _product,
    "data_dependent": _data_dependent,
    "computed": _copy,
    **MATH_OPS,
}
# Values made by these are views of their input (a changed view would change it):
# no in-place change is made to either afterwards.
_VIEWS = frozenset({"view"})
# Indexing's kinds that index by a 0-d integer tensor where one is drawn (a[flat[0]],
# a[index] with a 0-d index): eagerly a select, a view of its input too.
_INDEX_VIEWS = frozenset({0, 2})
# Values these make are their own (no view of another): changed in place as they are.
_OWN = frozenset({"add", "sub", "mul", "div", "where", "unary", "in_place"})


# Steps whose values are computed as soon as they are made, when recorded.
_NOW = frozenset({"data_dependent", "computed"})


class Run:
    """One example's run of a program: its values, and which of them may change in
    place (made by an op in ``_OWN``, with no view taken of them since).

    A step is ``make`` (its value, or None where it does not fit) then ``keep``; in
    between, a recorded run computes the values of the steps in ``_NOW`` (with
    ``bg.compute``, or ``await bg.value`` in a coroutine example).
    """

    def __init__(self, inputs: list[Any]) -> None:
        self.values = list(inputs)
        self.own = [False] * len(inputs)

    def make(self, step: Step, recorded: bool) -> Any:
        name, pick_a, pick_b, c = step
        ia = pick_a % len(self.values)
        a, b = self.values[ia], self.values[pick_b % len(self.values)]
        if recorded and name == "in_place" and isinstance(a, torch.Tensor):
            # A tensor handed out by a compute: its copy is changed with recorded
            # values, which a plain tensor may not be (see the README).
            a = bg.batched_value(a)
        if name == "in_place" and c % 4 == 3:
            # The value itself, where it may change (the name bound to it sees it).
            return _change(a, b, c // 4) if self.own[ia] else None
        return OPS[name](a, b, c)

    def keep(self, step: Step, value: Any, recorded: bool, done: Any = None) -> None:
        """Keep ``value``, made by ``step``; ``done`` is what computing it gave."""
        name, pick_a, _, c = step
        if recorded:
            if name == "data_dependent":
                # A per-example value again for the steps after it.
                value = bg.batched_value(done)
            elif name == "computed":
                # Later steps read the tensor handed out (a constant with history), or
                # the handle, whose calls read the stored rows.
                value = done if c % 2 else value
            elif isinstance(value, torch.Tensor):
                # Made from plain tensors alone: a per-example value of its own too,
                # which later steps may change in place with recorded values (a plain
                # tensor may not change so: see the README).
                value = bg.batched_value(value).clone()
        if name in _VIEWS or (name == "index" and c % 6 in _INDEX_VIEWS):
            self.own[pick_a % len(self.values)] = False
        self.values.append(value)
        self.own.append(name in _OWN)


def run_eagerly(program: list[Step], inputs: list[torch.Tensor]) -> tuple[list[Any], set[int]]:
    """The values a program makes eagerly, and the steps that failed (left out)."""
    run, failed = Run(inputs), set()
    for k, step in enumerate(program):
        try:
            value = run.make(step, recorded=False)
        except (RuntimeError, TypeError, IndexError, ValueError):
            failed.add(k)
            continue
        if value is not None:
            run.keep(step, value, recorded=False)
    return run.values, failed


def _now(value: Any, compute: Callable[[Any], Any]) -> Any:
    return value if isinstance(value, torch.Tensor) else compute(value)


def run_recorded(program: list[Step], inputs: list[Any], leave_out: set[int]) -> list[Any]:
    """The same program on handles, ``leave_out`` left out; data-dependent values are
    computed as they are made (``bg.compute``, inside the open policy)."""
    run = Run(inputs)
    for k, step in enumerate(program):
        if k not in leave_out and (value := run.make(step, recorded=True)) is not None:
            done = _now(value, bg.compute) if step[0] in _NOW else None
            run.keep(step, value, recorded=True, done=done)
    return run.values


async def run_awaiting(program: list[Step], inputs: list[torch.Tensor],
                       leave_out: set[int]) -> list[Any]:
    """``run_recorded`` as a coroutine example (for ``bg.run_all``): the inputs enter
    as ``batched_value``, and values are read with ``await bg.value``."""
    run = Run([bg.batched_value(t) for t in inputs])
    for k, step in enumerate(program):
        if k not in leave_out and (value := run.make(step, recorded=True)) is not None:
            done = None
            if step[0] in _NOW:
                done = value if isinstance(value, torch.Tensor) else await bg.value(value)
            run.keep(step, value, recorded=True, done=done)
    return run.values
