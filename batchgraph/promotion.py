"""Type promotion of 0-d inputs when per-example calls are stacked.

Type promotion ranks a 0-d tensor below tensors with dimensions: ``x * c`` with ``x``
float32 of shape (3,) and ``c`` a float64 0-d tensor is float32. Stacked, ``c`` has a
dimension, and the batch would come out float64 (and a comparison would be made in
float64). ``scalar_tensor_casts`` says which 0-d inputs an elementwise call casts
first so that the batch promotes as each example did.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from batchgraph.specs import CallSignature, InputSlot

__all__ = ["scalar_tensor_casts", "scalar_tensor_moves"]

# Calls that compute in floats whatever integer inputs they get (true division). Their
# integer inputs are converted to float as they are: cast to the other inputs' integer
# dtype first, a 0-d input would wrap (-3 as uint8 is 253) where eagerly it does not.
_TO_FLOAT: frozenset[Any] = frozenset({
    torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__,
    torch.Tensor.__rtruediv__, operator.truediv,
})

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
