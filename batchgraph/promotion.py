"""Type promotion of 0-d inputs when per-example calls are stacked.

Type promotion ranks a 0-d tensor below tensors with dimensions: ``x * c`` with ``x``
float32 of shape (3,) and ``c`` a float64 0-d tensor is float32. Stacked, ``c`` has a
dimension, and the batch would come out float64 (and a comparison would be made in
float64). ``scalar_tensor_casts`` says which 0-d inputs an elementwise call casts
first so that the batch promotes as each example did.

In float16 and bfloat16 a few CPU kernels (``mul``, the divisions) read a 0-d second
operand in float32 from its own dtype, not rounded to the computation dtype first:
``wide_scalar_input`` names it, and the batched call computes in float32 and rounds
once, as the kernel does.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgraph.specs import CallSignature, InputSlot

__all__ = [
    "gradient_reads_wide", "reads_wide", "run_each_alone", "run_reading_wide",
    "run_with_wide_gradient", "scalar_tensor_casts", "scalar_tensor_moves",
    "wide_gradient_input", "wide_scalar_input",
]

# Calls that compute in floats whatever integer inputs they get (true division). Their
# integer inputs are converted to float as they are: cast to the other inputs' integer
# dtype first, a 0-d input would wrap (-3 as uint8 is 253) where eagerly it does not.
_TO_FLOAT: frozenset[Any] = frozenset({
    torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__, operator.truediv,
})

# Calls whose CPU kernel, computing in float16 or bfloat16, reads its second operand
# where it is one value (a 0-d tensor) in float32 from that operand's own dtype
# (BinaryOpsKernel.cpp: mul_kernel and div_{true,trunc,floor}_kernel take
# iter.original_scalar_value<opmath_t>(2)): x_f16 * float32 c is float(x) * c rounded
# once. Other kernels (add, where, pow, the same calls with the 0-d operand first) read
# it rounded to the computation dtype, as the cast to it does.
_READ_WIDE: frozenset[Any] = frozenset({
    torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply, torch.Tensor.__mul__,
    operator.mul, torch.div, torch.divide, torch.true_divide, torch.Tensor.div,
    torch.Tensor.divide, torch.Tensor.true_divide, torch.Tensor.__truediv__,
    operator.truediv, torch.floor_divide, torch.Tensor.floor_divide,
    torch.Tensor.__floordiv__, operator.floordiv,
})
_REDUCED = (torch.float16, torch.bfloat16)
# The products and true divisions among them: their gradients (_ReadWide).
_PRODUCTS: frozenset[Any] = frozenset({
    torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply, torch.Tensor.__mul__,
    operator.mul,
})
_TRUE_DIVISIONS: frozenset[Any] = frozenset({
    torch.div, torch.divide, torch.true_divide, torch.Tensor.div, torch.Tensor.divide,
    torch.Tensor.true_divide, torch.Tensor.__truediv__, operator.truediv,
})
# 0-d dtypes whose every value float16 and bfloat16 hold: read wide or not, the same.
_EXACT_IN_REDUCED = (torch.bool, torch.uint8, torch.int8)

_KINDS = {bool: 0, int: 1, float: 2, complex: 3}


def _category(dtype: torch.dtype) -> int:
    if dtype is torch.bool:
        return 0
    if dtype.is_complex:
        return 3
    return 2 if dtype.is_floating_point else 1


def scalar_tensor_casts(fn: Any, call: CallSignature) -> list[torch.dtype | None] | None:
    """Per input of an elementwise call, the dtype to cast a 0-d input to before the
    batched call (None: as it is), or None when nothing needs a cast.

    Where the 0-d input's kind (bool, int, float, complex) is not above the other
    tensors', eager code computes in their dtype anyway, so casting it first changes
    nothing but the promotion; except in a true division of integers, which computes
    in floats (the cast would wrap the value, and vmap-free promotion of the stacked
    integers already gives the eager float dtype). A complex 0-d input above float
    tensors makes eagerly the complex counterpart of their dtype (float16 and a
    complex64 0-d tensor give complex32), not the wider of the two. Left alone:
    ``where``'s condition, and calls where a Python number lifts the kind (an int
    tensor plus 2.5 computes in floats).

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> x = TensorSpec((3,), torch.float32, torch.device("cpu"))
        >>> c = TensorSpec((), torch.float64, torch.device("cpu"))
        >>> scalar_tensor_casts(torch.mul, CallSignature((InputSlot(0), InputSlot(1)), (),
        ...                                              (x, c), None))
        [None, torch.float32]
    """
    specs = call.input_specs
    skip = set()
    if fn is torch.where and call.args and type(call.args[0]) is InputSlot:
        skip.add(call.args[0].slot)
    ranked = [s.dtype for i, s in enumerate(specs) if s is not None and s.shape and i not in skip]
    if not ranked:
        return None
    common = ranked[0]
    for dtype in ranked[1:]:
        common = torch.promote_types(common, dtype)
    # 0-d tensors of a higher kind lift the computation, as torch's rule for 0-d
    # operands has it: clamp(uint8_x, min=float64 0-d, max=int8 0-d) computes in
    # float64 (max -6 is -6.0; cast to uint8 first it read 250); float tensors with a
    # complex 0-d one compute in their complex counterpart (float16 -> complex32).
    zero = [s.dtype for i, s in enumerate(specs)
            if s is not None and not s.shape and i not in skip]
    if zero:
        top = zero[0]
        for dtype in zero[1:]:
            top = torch.promote_types(top, dtype)
        if _category(top) > _category(common):
            common = (common.to_complex() if _category(top) == 3 and _category(common) == 2
                      else torch.promote_types(common, top))
    lifted = max((_KINDS.get(type(a), 0) for a in (*call.args, *(v for _, v in call.kwargs))),
                 default=0)
    if lifted > _category(common):  # the computation dtype is not ``common``
        return None
    if (_category(common) < 2 and fn in _TO_FLOAT
            and call.static_arg(2, "rounding_mode", None) is None):
        return None  # computed in floats: no integer cast
    casts: list[torch.dtype | None] = [None] * len(specs)
    for i, s in enumerate(specs):
        if s is None or s.shape or i in skip or s.dtype == common:
            continue
        kind = _category(s.dtype)
        if kind <= _category(common):
            casts[i] = common
        elif kind == 3 and _category(common) == 2:
            casts[i] = common.to_complex()
    return casts if any(d is not None for d in casts) else None


def scalar_tensor_moves(call: CallSignature) -> list[torch.device | None] | None:
    """Per input of an elementwise call, the device to move a 0-d CPU input to before
    the batched call (None: where it is), or None when nothing moves.

    Eagerly a 0-d CPU tensor goes with tensors on any device (``x_cuda *
    torch.tensor(0.5)``, a scale made inline): torch reads it as a number. Stacked it
    has a dimension, and the batched call would fail with "Expected all tensors to be
    on the same device". It moves to the device of the inputs with dimensions, where
    eager code computes with it.

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> x = TensorSpec((3,), torch.float32, torch.device("meta"))
        >>> c = TensorSpec((), torch.float32, torch.device("cpu"))
        >>> scalar_tensor_moves(CallSignature((InputSlot(0), InputSlot(1)), (), (x, c), None))
        [None, device(type='meta')]
    """
    specs = call.input_specs
    devices = {s.device for s in specs if s is not None and s.shape}
    if len(devices) != 1:
        return None
    (device,) = devices
    if device.type == "cpu":
        return None
    moves: list[torch.device | None] = [
        device if s is not None and not s.shape and s.device.type == "cpu" else None
        for s in specs
    ]
    return moves if any(d is not None for d in moves) else None


def wide_scalar_input(fn: Any, call: CallSignature,
                      casts: list[torch.dtype | None] | None) -> int | None:
    """The input of an elementwise call that eager code reads in float32 where
    ``casts`` rounds it to float16 or bfloat16, or None.

    On the CPU ``x * c``, ``x / c`` and ``x // c`` of a float16 or bfloat16 ``x`` read
    a 0-d ``c`` of another dtype (float32, float64, int64) as a float32 number: cast
    to ``x``'s dtype first, it would be rounded (1 ulp off in the result). The batched
    call casts it to float32 instead, computes in float32 as the kernel does, and
    rounds the result to the eager dtype once. Only where every input is on the CPU:
    the CUDA kernels read 0-d operands otherwise (CPU ones wide, either side; CUDA
    ones rounded), and keep the cast.

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> x = TensorSpec((3,), torch.float16, torch.device("cpu"))
        >>> c = TensorSpec((), torch.float32, torch.device("cpu"))
        >>> call = CallSignature((InputSlot(0), InputSlot(1)), (), (x, c), None)
        >>> wide_scalar_input(torch.mul, call, scalar_tensor_casts(torch.mul, call))
        1
        >>> call = CallSignature((InputSlot(1), InputSlot(0)), (), (x, c), None)
        >>> print(wide_scalar_input(torch.mul, call, scalar_tensor_casts(torch.mul, call)))
        None
    """
    if casts is None or fn not in _READ_WIDE:
        return None
    other = call.static_arg(1, "other", None)
    if type(other) is not InputSlot or casts[other.slot] not in _REDUCED:
        return None
    if any(s is None or s.device.type != "cpu" for s in call.input_specs):
        return None
    return other.slot


def wide_gradient_input(fn: Any, call: CallSignature,
                        casts: list[torch.dtype | None] | None) -> int | None:
    """The 0-d first operand of a product ``c * x`` (``x`` float16 or bfloat16 with
    dimensions, ``c`` cast to its dtype by ``casts``), or None.

    Eager code reads ``c`` rounded to ``x``'s dtype in ``c * x`` itself, but ``x``'s
    gradient is ``grad * c``, where ``c`` is the second operand and read in float32
    (``wide_scalar_input``): rounded first, as the batch's cast did, it was 1 ulp off
    (``3 * c`` for ``c = 1.37`` in bfloat16: 4.09375 where eagerly 4.125).

    Example:
        >>> from batchgraph.specs import TensorSpec as Spec
        >>> specs = (Spec((3,), torch.bfloat16, torch.device("cpu")),
        ...          Spec((), torch.float32, torch.device("cpu")))     # x, c
        >>> c_times_x = CallSignature((InputSlot(1), InputSlot(0)), (), specs, None)
        >>> wide_gradient_input(torch.mul, c_times_x, scalar_tensor_casts(torch.mul, c_times_x))
        1
    """
    if casts is None or fn not in _PRODUCTS:
        return None
    first, other = call.static_arg(0, "input", None), call.static_arg(1, "other", None)
    if type(first) is not InputSlot or type(other) is not InputSlot or (
            casts[first.slot] not in _REDUCED or casts[other.slot] is not None):
        return None
    specs = call.input_specs
    x = specs[other.slot]
    if x is None or not x.shape or x.dtype != casts[first.slot] or any(
            s is None or s.device.type != "cpu" for s in specs):
        return None
    return first.slot


# Their gradients read a 0-d operand as the batch's cast does (a sum of the gradient,
# times alpha; a mask), or there is none: nothing eager computes wider.
_SUMS: frozenset[Any] = frozenset({
    torch.add, torch.sub, torch.subtract, torch.rsub, torch.Tensor.add, torch.Tensor.sub,
    torch.Tensor.subtract, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.Tensor.__sub__, torch.Tensor.__rsub__, operator.add, operator.sub,
    torch.where, torch.Tensor.where, torch.clamp, torch.clip, torch.Tensor.clamp,
    torch.Tensor.clip, torch.maximum, torch.minimum, torch.fmax, torch.fmin,
    torch.Tensor.maximum, torch.Tensor.minimum, torch.Tensor.to, torch.Tensor.type_as,
    torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge, torch.Tensor.__eq__,
    torch.Tensor.__ne__, torch.Tensor.__lt__, torch.Tensor.__le__, torch.Tensor.__gt__,
    torch.Tensor.__ge__, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge,
})


def gradient_reads_wide(fn: Any, casts: list[torch.dtype | None] | None,
                        call: CallSignature) -> bool:
    """Whether ``casts`` rounds a 0-d float32 or float64 input to float16 or bfloat16
    for a call whose eager backward may read it unrounded (``x.abs() ** c``'s gradient
    ``c * x ** (c - 1)``, ``torch.xlogy(c, x)``, ``torch.atan2(x, c)``: 1 ulp off in
    bfloat16, silently), other than those run wide (``wide_scalar_input``,
    ``wide_gradient_input``) and sums. Such calls needing a gradient run each example
    alone (``run_each_alone``); their values are eager's either way.

    Example:
        >>> from batchgraph.specs import TensorSpec as Spec
        >>> specs = (Spec((3,), torch.bfloat16, torch.device("cpu")),
        ...          Spec((), torch.float32, torch.device("cpu")))     # x, c
        >>> x_pow_c = CallSignature((InputSlot(0), InputSlot(1)), (), specs, None)
        >>> gradient_reads_wide(torch.pow, scalar_tensor_casts(torch.pow, x_pow_c), x_pow_c)
        True
        >>> gradient_reads_wide(torch.add, scalar_tensor_casts(torch.add, x_pow_c), x_pow_c)
        False
    """
    if casts is None or fn in _SUMS or fn in _READ_WIDE:
        return False
    specs = call.input_specs
    return any(d in _REDUCED and s is not None and s.dtype in (torch.float32, torch.float64)
               for d, s in zip(casts, specs))


def run_each_alone(call: CallSignature, fn: Any, inputs: Sequence[torch.Tensor],
                   size: int) -> Any:
    """``call`` run on each example's inputs (rows of the stacked ``inputs``), as
    eagerly, and the results stacked (see ``gradient_reads_wide``)."""
    apply: Callable[..., Any] = call.apply
    return torch.stack([apply(fn, [x[i] for x in inputs]) for i in range(size)])


class _WideGradient(torch.autograd.Function):
    """``c * x`` with ``c`` (stacked 0-d) read rounded to ``x``'s dtype, as eagerly, and
    the gradients eager backward gives: ``grad * c`` for ``x`` with ``c`` read in
    float32, ``grad * x`` in ``x``'s dtype for ``c``, summed to its shape and cast to
    its dtype (as ``_ReadWide``'s, by differentiable operations)."""

    @staticmethod
    def forward(ctx: Any, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(c, x)
        return c.to(x.dtype) * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        c, x = ctx.saved_tensors
        grad_c = grad_x = None
        if ctx.needs_input_grad[0]:
            grad_c = (grad * x).sum_to_size(c.shape).to(c.dtype)
        if ctx.needs_input_grad[1]:
            grad_x = _wide(grad, c, False).to(x.dtype)
        return grad_c, grad_x


def run_with_wide_gradient(call: CallSignature, fn: Any, inputs: Sequence[torch.Tensor],
                           first: int) -> torch.Tensor:
    """Run ``c * x`` (``inputs[first]`` is ``c``, not cast yet; see
    ``wide_gradient_input``) with eager's value and gradients.

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> x = TensorSpec((1,), torch.bfloat16, torch.device("cpu"))
        >>> c = TensorSpec((), torch.float32, torch.device("cpu"))
        >>> call = CallSignature((InputSlot(1), InputSlot(0)), (), (x, c), None)
        >>> xs = torch.tensor([[3.0]], dtype=torch.bfloat16, requires_grad=True)
        >>> out = run_with_wide_gradient(call, torch.mul, [xs, torch.tensor([[1.37]])], 1)
        >>> torch.autograd.grad(out.sum(), xs)[0]   # as (1.37 * x[0]).sum() gives it
        tensor([[1.3672]], dtype=torch.bfloat16)
    """
    other = call.static_arg(1, "other", None)
    assert type(other) is InputSlot
    c, x = inputs[first], inputs[other.slot]
    if torch.is_grad_enabled() and (c.requires_grad or x.requires_grad):
        out: torch.Tensor = _WideGradient.apply(c, x)  # type: ignore[no-untyped-call]
        return out
    cast = list(inputs)
    cast[first] = c.to(x.dtype)
    return call.apply(fn, cast)  # type: ignore[no-any-return]


class _ValueOfFirst(torch.autograd.Function):
    """The first tensor's value; the gradient goes to both (one call run as two graphs)."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


class _ReadWide(torch.autograd.Function):
    """``x * c`` or ``x / c`` with the stacked 0-d ``c`` read in float32 and the
    result rounded once to ``x``'s dtype, with the gradients eager backward gives
    (derivatives.yaml: mul, div) computed by differentiable operations on ``x`` and
    ``c`` themselves, so that a gradient of gradients (``create_graph=True``) sees how
    each depends on both, as eagerly.

    ``x``'s gradient reads ``c`` wide too (``grad * c``, ``grad / c``: float16 by a
    0-d float32); ``c``'s multiplies in ``x``'s dtype (``grad * x``; for a quotient
    ``-grad * ((x / c) / c)``, its divisions read wide), summed to ``c``'s shape in
    that dtype and then cast to ``c``'s, as the engine does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, c: torch.Tensor, divide: bool) -> torch.Tensor:
        ctx.save_for_backward(x, c)
        ctx.divide = divide
        return _wide(x, c, divide)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, c = ctx.saved_tensors
        grad_x = grad_c = None
        if ctx.needs_input_grad[0]:
            grad_x = _wide(grad, c, ctx.divide).to(x.dtype)
        if ctx.needs_input_grad[1]:
            by = -_wide(_wide(x, c, True), c, True) if ctx.divide else x
            grad_c = (grad * by).sum_to_size(c.shape).to(c.dtype)
        return grad_x, grad_c, None


def _wide(x: torch.Tensor, c: torch.Tensor, divide: bool) -> torch.Tensor:
    """``x * c`` or ``x / c`` computed in float32 and rounded once to ``x``'s dtype."""
    wide, c_wide = x.to(torch.float32), c.to(torch.float32)
    return (wide / c_wide if divide else wide * c_wide).to(x.dtype)


def run_reading_wide(call: CallSignature, fn: Any, inputs: Sequence[torch.Tensor],
                     wide: int, dtype: torch.dtype) -> torch.Tensor:
    """Run ``call`` with ``inputs[wide]`` (a stacked 0-d operand, see
    ``wide_scalar_input``) read in float32 and the result rounded once to ``dtype``.

    Eager backward reads the operand so too for the other inputs' gradients (``grad *
    c``), but the operand's own gradient multiplies in ``dtype`` (``grad * x``, both
    float16): where it needs one, ``_ReadWide`` gives both as eagerly.

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> x = TensorSpec((1,), torch.float16, torch.device("cpu"))
        >>> c = TensorSpec((), torch.float32, torch.device("cpu"))
        >>> call = CallSignature((InputSlot(0), InputSlot(1)), (), (x, c), None)
        >>> xs, cs = torch.tensor([[7.0]]).half(), torch.tensor([1 / 3])
        >>> run_reading_wide(call, torch.mul, [xs, cs.view(1, 1)], 1, torch.float16)[0]
        tensor([2.3340], dtype=torch.float16)
        >>> torch.mul(xs[0], cs[0]), torch.mul(xs[0], cs[0].half())   # eager; rounded first
        (tensor([2.3340], dtype=torch.float16), tensor([2.3320], dtype=torch.float16))
    """
    apply: Callable[..., Any] = call.apply
    scalar = inputs[wide]
    wide_inputs = list(inputs)
    wide_inputs[wide] = scalar.to(torch.float32)
    if not (scalar.requires_grad and torch.is_grad_enabled()):
        return apply(fn, wide_inputs).to(dtype)  # type: ignore[no-any-return]
    first = call.static_arg(0, "input", None)
    if (type(first) is InputSlot and call.static_arg(2, "rounding_mode", None) is None
            and (fn in _TRUE_DIVISIONS or fn in _PRODUCTS)):
        return _ReadWide.apply(  # type: ignore[no-any-return,no-untyped-call]
            inputs[first.slot], scalar, fn in _TRUE_DIVISIONS)
    # A division rounding its quotient: no gradient but zeros, to either operand.
    wide_inputs[wide] = wide_inputs[wide].detach()
    value = apply(fn, wide_inputs).to(dtype)
    low_inputs = [x.detach() for x in inputs]
    low_inputs[wide] = scalar.to(dtype)
    twin = apply(fn, low_inputs)
    out: torch.Tensor = _ValueOfFirst.apply(value, twin)  # type: ignore[no-untyped-call]
    return out


def reads_wide(fn: Any, args: Sequence[Any], kwargs: dict[str, Any] | None) -> bool:
    """Whether eager ``fn(*args, **kwargs)`` reads a 0-d second operand in float32
    where the computation is in float16 or bfloat16 (see ``wide_scalar_input``).
    vmap's batching rules cast it to the computation dtype first: such a call in a
    function of the user's runs one example at a time (``batchgraph.dtype_trace``).

    Example:
        >>> x = torch.ones(3, dtype=torch.float16)
        >>> reads_wide(torch.mul, (x, torch.tensor(1 / 3)), None)
        True
        >>> reads_wide(torch.mul, (torch.tensor(1 / 3), x), None)   # in x's gradient
        True
        >>> reads_wide(torch.add, (torch.tensor(1 / 3), x), None)
        False
    """
    if not args:
        return False
    if fn in _READ_WIDE:
        first = args[0]
        other = args[1] if len(args) > 1 else (kwargs or {}).get("other")
        # c * x reads c rounded, but x's gradient (grad * c) reads it wide: vmap's,
        # where c is the example's, read it rounded (wide_gradient_input). (With or
        # without grad: a call signature's probe is kept for both modes.)
        return _wide_pair(first, other) or (fn in _PRODUCTS and _wide_pair(other, first))
    if fn in _SUMS:
        return False
    # Other calls' gradients may read the example's 0-d float32 operand unrounded
    # (torch.atan2(x, c), torch.xlogy(c, x): see gradient_reads_wide); vmap's, where it
    # is the example's (batched), read it rounded.
    tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
    return any(c.dtype in (torch.float32, torch.float64) and _wide_pair(t, c)
               and torch._C._functorch.is_batchedtensor(c) for t in tensors for c in tensors)


def _wide_pair(first: Any, other: Any) -> bool:
    """Whether ``first`` is a float16 or bfloat16 tensor with dimensions on the CPU and
    ``other`` a 0-d CPU tensor of a dtype it does not hold every value of."""
    return (isinstance(first, torch.Tensor) and isinstance(other, torch.Tensor)
            and first.dim() > 0 and other.dim() == 0 and first.dtype in _REDUCED
            and other.dtype != first.dtype and other.dtype not in _EXACT_IN_REDUCED
            and not other.is_complex()
            and first.device.type == "cpu" and other.device.type == "cpu")
