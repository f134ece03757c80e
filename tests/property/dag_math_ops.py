"""More operations for ``dag_programs``: order statistics, gathers and scatters along a
dimension, einsum with another value, linear algebra and FFT (float64 or complex128).

Each takes ``(a, b, c)`` as the operations there do and returns None where it does not
fit; linear algebra runs on a well-conditioned matrix made from ``a`` (``a a^T + n I``),
so that values and gradients are comparable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Op = Callable[[Any, Any, int], Any]


def _float(a: Any) -> Any:
    return (a.real if a.is_complex() else a).double()


def _order(a: Any, b: Any, c: int) -> Any:
    """Order statistics along a dimension (values or indices)."""
    if a.ndim == 0 or a.shape[-1] == 0:
        return None
    x, kind = _float(a), c % 6
    if kind == 0:
        return x.kthvalue(1 + c // 6 % a.shape[-1], -1).values
    if kind == 1:
        return x.median(-1).indices
    if kind == 2:
        return x.topk(min(2, a.shape[-1]), -1, largest=c % 2 == 0).indices
    if kind == 3:
        return torch.cummin(x, -1).indices
    if kind == 4:
        return x.sort(-1, stable=True).indices
    return x.logcumsumexp(-1)


def _along(a: Any, b: Any, c: int) -> Any:
    """gather, scatter and friends along the last dimension, with indices from ``b``."""
    if a.ndim == 0 or a.shape[-1] == 0:
        return None
    order = _float(b).reshape(-1).argsort() % a.shape[-1]  # from another value
    index = order[: a.shape[-1]].expand(*a.shape[:-1], -1)[..., : min(2, a.shape[-1])]
    x, kind = _float(a), c % 5
    if kind == 0:
        return x.gather(-1, index)
    if kind == 1:
        return x.scatter(-1, index, x[..., : index.shape[-1]] * 2)
    if kind == 2:
        return x.scatter_add(-1, index, x[..., : index.shape[-1]])
    if kind == 3:
        return x.scatter_reduce(-1, index, x[..., : index.shape[-1]], "amax", include_self=False)
    return torch.take_along_dim(x, index, -1)


def _einsum(a: Any, b: Any, c: int) -> Any:
    """einsum of two values, contracting their last dimensions where they agree."""
    x = _float(a)
    if x.ndim == 0 or b.ndim == 0 or b.shape[-1] != x.shape[-1]:
        return torch.einsum("...->", x) if c % 2 else None
    y = _float(b)
    if c % 2:
        return torch.einsum("...i,...i->...", x, y) if x.shape == y.shape else None
    return torch.einsum("...i,ji->...j", x, y) if y.ndim == 2 else torch.einsum("...i,i->...", x, y)


def _spd(a: Any) -> Any:
    """A symmetric positive definite matrix made from ``a`` (None: ``a`` has no
    matrix to make one from)."""
    x = _float(a)
    if x.ndim == 0 or x.shape[-1] == 0:
        return None
    m = x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x[:, None]
    n = m.shape[0]
    return m @ m.transpose(0, 1) + n * torch.eye(n, dtype=torch.float64)


def _linalg(a: Any, b: Any, c: int) -> Any:
    m = _spd(a)
    if m is None:
        return None
    rhs = torch.ones(m.shape[0], dtype=torch.float64)
    kind = c % 8
    if kind == 0:
        return torch.linalg.solve(m, rhs)
    if kind == 1:
        return torch.linalg.inv(m)
    if kind == 2:
        return torch.linalg.det(m)
    if kind == 3:
        return torch.linalg.slogdet(m).logabsdet
    if kind == 4:
        return torch.linalg.eigh(m).eigenvalues
    if kind == 5:
        return torch.linalg.cholesky(m)
    if kind == 6:
        return torch.linalg.norm(m, dim=-1) + torch.linalg.matrix_norm(m)
    return torch.linalg.qr(m).R.diagonal().abs()


def _fft(a: Any, b: Any, c: int) -> Any:
    if a.ndim == 0 or a.shape[-1] == 0:
        return None
    kind = c % 4
    if kind == 0:
        return torch.fft.fft(a if a.is_complex() else _float(a))
    if kind == 1:
        return torch.fft.rfft(_float(a)).abs()
    if kind == 2:
        return torch.fft.irfft(torch.fft.rfft(_float(a)), n=a.shape[-1])
    return torch.fft.fftshift(_float(a), dim=-1)


MATH_OPS: dict[str, Op] = {
    "order": _order,
    "along": _along,
    "einsum": _einsum,
    "linalg": _linalg,
    "fft": _fft,
}
