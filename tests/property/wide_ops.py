"""Operations with drawn arguments, for the differential fuzzer of per-example programs.

Where ``tensor_programs`` fixes each operation's arguments (``torch.split(a, 1)[1]``,
``a.roll(1, 0)``), these draw them from ``c`` (an int up to 2**16): dims as tuples and
with ``keepdim``, split sizes as lists, ``flatten``'s range, ``squeeze(dim)``, ``roll``
over several dims or none (a flat roll), ``expand`` with ``-1``, stepped and mixed
slices, lists and index tensors next to slices, boolean masks from another value, two
per-example values of different shapes as operands (broadcasting, ``b / a``,
``a ** b``, ``clamp`` by a value), products of two values (``@`` of vectors and
matrices, ``einsum`` equations), and in-place changes by index tensors and masks.

Each op takes ``(a, b, c)`` (``b`` another value made so far) and returns a value, or
None where it does not fit ``a``'s shape; ops may raise where eagerly they raise
(shapes that do not broadcast), which the fuzzer checks batched code raises too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import batchgraph as bg
from tests.property.tensor_programs import Modules

Op = Callable[[Any, Any, int], Any]


def _pick(options: Sequence[Any], c: int) -> Any:
    return options[c % len(options)]


def _dim(a: Any, c: int) -> int:
    """A valid dim of ``a`` (negative ones too; 0-d values take 0 and -1)."""
    rank = max(a.ndim, 1)
    return int(c % (2 * rank) - rank)


def _dims(a: Any, c: int) -> tuple[int, ...]:
    """Distinct dims of a ranked ``a``, some negative (a bit of ``c`` per dim)."""
    chosen = tuple(d - a.ndim if (c >> (d + 4)) & 1 else d
                   for d in range(a.ndim) if (c >> d) & 1)
    return chosen or (-1,)


def _reduce(a: Any, b: Any, c: int) -> Any:
    """Reductions over a dim or a tuple of dims, with keepdim."""
    if a.ndim == 0 or a.numel() == 0:
        return None
    kind, c = c % 8, c // 8
    keep = bool(c % 2)
    dims = _dims(a, c // 2)
    dim = _dim(a, c // 2)
    if kind == 0:
        return a.sum(dims, keepdim=keep)
    if kind == 1:
        return torch.mean(a, dim=dims, keepdim=keep)
    if kind == 2:
        return a.amax(dims, keepdim=keep) + a.amin(dim)
    if kind == 3:
        return torch.logsumexp(a, dims, keepdim=keep)
    if kind == 4:
        out = a.max(dim, keepdim=keep)
        return out.values * 2 + out.indices
    if kind == 5:
        values, indices = torch.min(a, dim=dim, keepdim=keep)
        return values - indices.double()
    if kind == 6:
        return a.var(dim, keepdim=keep, correction=0) + a.std(dims, keepdim=keep, correction=0)
    return a.norm(dim=dims, keepdim=keep)


def _normalized(a: Any, b: Any, c: int) -> Any:
    """Softmax-like ops and scans along a drawn dim."""
    dim, kind = _dim(a, c // 5), c % 5
    if kind == 0:
        return a.softmax(dim) * a
    if kind == 1:
        return F.log_softmax(a, dim=dim)
    if kind == 2:
        return torch.cumsum(a, dim=dim) + a.cumprod(dim)
    if kind == 3:
        return a.logcumsumexp(dim)
    return torch.cummax(a, dim).indices.double() + a


def _reshape(a: Any, b: Any, c: int) -> Any:
    """reshape, view, flatten and unflatten to drawn shapes."""
    kind, c = c % 5, c // 5
    n = a.numel()
    if kind == 0:
        return a.reshape(-1) if a.ndim else a.reshape(1, 1)
    if kind == 1 and n and n % 2 == 0:
        # contiguous() first: values handed out are contiguous where eagerly they may
        # keep a transpose's strides (a.t() * 1.5), which view() reads.
        return a.contiguous().view(2, -1) if c % 2 else a.contiguous().view(-1, 2)
    if kind == 2 and a.ndim:
        start = c % a.ndim
        return a.flatten(start, _pick(range(start, a.ndim), c // a.ndim))
    if kind == 3 and a.ndim and a.shape[-1] % 2 == 0:
        return a.unflatten(-1, (2, -1))
    return a.reshape(*a.shape[:-1], 1, -1) if a.ndim else a.view(())


def _layout(a: Any, b: Any, c: int) -> Any:
    """permute, transpose, squeeze and unsqueeze with drawn dims."""
    kind, c = c % 5, c // 5
    if kind == 0 and a.ndim:
        order = sorted(range(a.ndim), key=lambda d: (c >> (2 * d)) % 4 * 10 + d)
        return a.permute(*order)
    if kind == 1 and a.ndim:
        return a.transpose(_dim(a, c), _dim(a, c // 7)) * 1.5
    if kind == 2:
        return a.unsqueeze(c % (2 * a.ndim + 2) - a.ndim - 1).squeeze(_dim(a, c // 3))
    if kind == 3:
        return a.unsqueeze(0).unsqueeze(-1).squeeze((0, -1)) if c % 2 else a.squeeze()
    return a.swapaxes(0, -1) if a.ndim else a.t()


def _pieces(a: Any, b: Any, c: int) -> Any:
    """split (an int or a list of sizes), chunk, tensor_split, unbind along a dim."""
    if a.ndim == 0:
        return None
    dim, kind, c = _dim(a, c % 16), (c // 16) % 4, c // 64
    size = a.shape[dim]
    if kind == 0:
        parts = torch.split(a, 1 + c % 3, dim)
    elif kind == 1 and size:
        first = c % (size + 1)
        parts = a.split([first, size - first], dim=dim)
    elif kind == 2:
        parts = a.chunk(1 + c % 3, dim)
    else:
        parts = a.tensor_split(1 + c % 3, dim=dim)
    return parts[(c // 3) % len(parts)] if parts else None


def _join(a: Any, b: Any, c: int) -> Any:
    """cat and stack with the other value where shapes agree (raise where not)."""
    kind = c % 3
    dim = _dim(a, c // 3)
    if kind == 0 and a.ndim:
        return torch.cat([a, b if b.ndim == a.ndim else a * 2], dim=dim)
    if kind == 1:
        return torch.stack((a, b), dim=c // 3 % (a.ndim + 1)) if a.shape == b.shape else None
    return torch.cat((a.unsqueeze(0), a.unsqueeze(0) + 1)).sum(0)


def _tile(a: Any, b: Any, c: int) -> Any:
    """expand (with -1), repeat, flip and roll with drawn arguments."""
    kind, c = c % 6, c // 6
    if kind == 0:
        return a.expand(2, *([-1] * a.ndim)) * 1.0
    if kind == 1:
        reps = [1 + (c >> (2 * d)) % 2 for d in range(a.ndim + c % 2)]
        return a.repeat(*reps) if reps else a.repeat(())
    if kind == 2 and a.ndim:
        return a.flip(_dims(a, c))
    if kind == 3 and a.ndim:
        dims = _dims(a, c)
        return a.roll(tuple(1 + d % 2 for d in range(len(dims))), dims)
    if kind == 4:
        return torch.roll(a, c % 5 - 2)  # flat: over all elements, then reshaped
    return a.expand_as(b) if a.ndim <= b.ndim else a.sum()


def _slice(a: Any, b: Any, c: int) -> Any:
    """Static indexing: steps, mixed with ints, Ellipsis and None."""
    if a.ndim == 0:
        return a[None, ..., None] if c % 2 else a[()]
    kind, c = c % 7, c // 7
    n = a.shape[0]
    if kind == 0:
        return a[:: 1 + c % 3]
    if kind == 1:
        return a[c % 3 - 1 :: 2]
    if kind == 2 and a.ndim >= 2:
        return a[1:, :: 1 + c % 2]
    if kind == 3 and n:
        return a[-1, ...] if a.ndim == 1 else a[..., -1][None]
    if kind == 4 and a.ndim >= 2 and n:
        return a[c % n, None, 1:]
    if kind == 5:
        return a[..., None, : max(a.shape[-1] - 1, 0)]
    return a.narrow(0, 0, n - n // 2)


def _fancy(a: Any, b: Any, c: int) -> Any:
    """Indexing by lists, index tensors (plain and made from ``b``) next to slices, and
    boolean masks."""
    if a.ndim == 0 or a.shape[0] == 0:
        return a[a > 0] if a.ndim == 0 else None
    n, kind, c = a.shape[0], c % 8, c // 8
    order = (b.reshape(-1).argsort() % n)[: 1 + c % 3] if b.numel() else torch.tensor([0])
    if kind == 0:
        return a[[0, -1]]
    if kind == 1:
        return a[order]
    if kind == 2 and a.ndim >= 2:
        return a[:, order % a.shape[1]] if a.shape[1] else None
    if kind == 3 and a.ndim >= 2:
        return a[order, 1:]
    if kind == 4 and a.ndim >= 2 and a.shape[1]:
        return a[order, order % a.shape[1]]
    if kind == 5:
        return a[torch.tensor([True] * (n - 1) + [False])]
    if kind == 6:
        return torch.gather(a, 0, (a.argsort(0) + c) % n)
    return a.index_select(-1, torch.tensor([0, 0]) % max(a.shape[-1], 1)) if a.shape[-1] else None


def _with_other(a: Any, b: Any, c: int) -> Any:
    """Binary ops of two per-example values (broadcasting; raise where they do not),
    Python scalars and 0-d tensors on either side. No abs() (or other kink) of a value
    that may be 0 exactly (a LayerNorm of a constant row): batched rounding may make it
    1e-17 instead, and the gradient there jumps (values agree, gradients do not)."""
    kind = c % 9
    if kind == 0:
        return a + b
    if kind == 1:
        return b / (a * a + 1)
    if kind == 2:
        return (a * a + 1) ** (b.tanh())
    if kind == 3:
        return torch.clamp(a, min=-(b * b) - 0.1, max=b * b + 0.1)
    if kind == 4:
        return torch.where(b > 0, a, 2.5)
    if kind == 5:
        return 2 / (1 + a * a) - torch.tensor(0.5, dtype=torch.float64) ** a
    if kind == 6:
        return torch.maximum(a, b) - torch.minimum(b, a)
    if kind == 7:
        return a.sub(b, alpha=0.5) * torch.tensor(3)
    return (a > b) * a + (a <= b).double() * 0.25


def _product(a: Any, b: Any, c: int) -> Any:
    """@ and matmul of two values (vectors, matrices, batches; raise where they do not
    fit), mm, mv, einsum equations with the other value."""
    kind = c % 6
    if kind == 0 and a.ndim and b.ndim:
        return a @ b
    if kind == 1 and a.ndim:
        return torch.matmul(a, a.transpose(-1, 0) if a.ndim > 1 else a)
    if kind == 2 and a.ndim == 2:
        return torch.mm(a.t(), a) + torch.mv(a, a[0]).sum()
    if kind == 3 and a.ndim and b.ndim:
        return torch.einsum("...i,j->...ij", a, b.reshape(-1))
    if kind == 4 and a.ndim >= 2:
        return torch.einsum("ij...->ji...", a) + torch.einsum("ii...->i...", a[:1, :1])
    return torch.einsum("i,i->", a.reshape(-1), a.reshape(-1)) if a.numel() else None


def _change(a: Any, b: Any, c: int) -> Any:
    """In-place changes of a copy of ``a``: by index tensors, masks made from ``b``,
    add_ with alpha, and an item assignment read back through the name kept. A tensor
    handed out enters as a per-example value (a plain tensor may not change in place
    with recorded values: see the README)."""
    y = bg.batched_value(a) * 1
    kept = [y]
    kind, c = c % 6, c // 6
    if kind == 0:
        y.add_(b.sum(), alpha=0.5)
    elif kind == 1 and a.ndim and a.shape[0]:
        y[torch.tensor([0, -1]) % a.shape[0]] = 1.5
    elif kind == 2:
        y[y.abs() > b.abs().mean()] = 0.0 if b.numel() else y.sum()
    elif kind == 3 and a.ndim and a.shape[-1] > 1:
        y[..., 1] = y[..., 0] * 2
    elif kind == 4:
        y.mul_(b.mean() if b.numel() else 2).clamp_(max=1.0)
    elif a.ndim:
        y.index_fill_(0, torch.tensor([0]) % max(a.shape[0], 1), c % 3) if a.shape[0] else y.zero_()
    return kept[0] - a


def _casts(a: Any, b: Any, c: int) -> Any:
    """Casts to float64 and back from float32 and ints; the float32 round trip's
    gradient stays out (merged casts sum their float32 gradients before casting back)."""
    kind = c % 4
    if kind == 0:
        return a.to(torch.float64) + a.double()
    if kind == 1:
        return a + (a.float().to(torch.float64) - a).detach()
    if kind == 2:
        return (a * 4).long().double() + (a > 0).int() + a.to(a.dtype)
    return a.type(torch.float64) * a.to(dtype=torch.float64, copy=True)


def module_ops(m: Modules) -> dict[str, Op]:
    """Ops calling ``m``'s modules through ``batched_func`` sites (eager when no policy
    records), on values of the shapes they take."""
    lin, cell, norm = bg.batched_func(m.lin), bg.batched_func(m.cell), bg.batched_func(m.norm)
    embed, conv = bg.batched_func(m.embed), bg.batched_func(m.conv)

    def features(a: Any, b: Any, c: int) -> Any:
        """A trailing dim of 4 made from ``a`` (a slice, or ``a`` padded)."""
        x = a.reshape(-1)[:4] if a.numel() >= 4 else F.pad(a.reshape(-1), (0, 4 - a.numel()))
        kind = c % 5
        if kind == 0:
            return lin(x) + lin(a).sum() if a.ndim and a.shape[-1] == 4 else lin(x)
        if kind == 1:
            return cell(x, torch.tanh(x))
        if kind == 2:
            return norm(x.expand(2, 4))
        if kind == 3:
            return embed((a.abs() * 3).long().clamp(max=9)).sum(-1) * a
        return conv(x.unsqueeze(-1).expand(4, 3))

    return {"module": features}


OPS: dict[str, Op] = {
    "reduce": _reduce,
    "normalized": _normalized,
    "reshape": _reshape,
    "layout": _layout,
    "pieces": _pieces,
    "join": _join,
    "tile": _tile,
    "slice": _slice,
    "fancy": _fancy,
    "with_other": _with_other,
    "product": _product,
    "change": _change,
    "casts": _casts,
}
