"""Random per-example tensor programs over a wide catalog of tensor operations.

Each operation takes the value ``a`` it is applied to, a second value ``b`` and a
small int ``c`` (used to pick a dimension), and returns a tensor. It runs unchanged
on tensors (eagerly) and on handles (recorded), so a program is the same Python code
both ways: the test compares what batching makes of it with the eager run.

``applies(a)`` says whether an operation fits ``a``'s shape; it reads only what a
handle answers before it is computed (``shape``, ``ndim``, ``numel()``), and the
program skips operations that do not fit, in both runs alike.

The catalog covers every built-in batching rule: elementwise ops with broadcasting
and Python scalars, full reductions, ops taking a ``dim`` (positive and negative, on
0-d values too), static indexing, indexing by tensors (0-d and 1-d, from handles),
results with several outputs (``max(dim)``, ``topk``), modules, and the ``VmapKey``
fallback for the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import batchgraph as bg

Op = Callable[[Any, Any, int], Any]
Applies = Callable[[Any], bool]

SHAPES = [(), (3,), (4,), (1, 4), (2, 4), (2, 3, 4)]


def dim_of(a: Any, c: int) -> int:
    """A valid dim of ``a`` picked by ``c``, negative ones included (0-d: 0 or -1)."""
    rank = max(a.ndim, 1)
    return c % (2 * rank) - rank


def new_dim_of(a: Any, c: int) -> int:
    """A valid position for a new dimension of ``a`` (unsqueeze, stack)."""
    return c % (2 * a.ndim + 2) - a.ndim - 1


def broadcasts(a: Any, b: Any) -> bool:
    try:
        torch.broadcast_shapes(tuple(a.shape), tuple(b.shape))
    except RuntimeError:
        return False
    return True


def _always(a: Any) -> bool:
    return True


def _ranked(a: Any) -> bool:
    return bool(a.ndim > 0)


def _nonempty(a: Any) -> bool:
    return bool(a.numel() > 0)


def _ranked_nonempty(a: Any) -> bool:
    return bool(a.ndim > 0 and a.numel() > 0)


def _matrix(a: Any) -> bool:
    return bool(a.ndim >= 2)


def _rows(a: Any) -> bool:
    """Indexable along dim 0."""
    return bool(a.ndim > 0 and a.shape[0] > 0)


def _features(a: Any) -> bool:
    """A trailing dimension of 4 (what the modules take)."""
    return bool(a.ndim > 0 and a.shape[-1] == 4)


def _row_order(a: Any) -> Any:
    """A permutation of ``a``'s rows computed from its values (a long tensor)."""
    return a.reshape(a.shape[0], -1).sum(-1).argsort()


class Modules(nn.Module):
    """The modules the catalog calls (float64), initialized from ``seed`` alone.

    Built at a test module's import, they drew from torch's global generator, which
    each process seeds at random: a fuzzer's failure (a value 1 ulp off, found for
    some runs) did not reproduce in the next process. The global generator is left
    as it was."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._build()

    def _build(self) -> None:
        self.lin = nn.Linear(4, 4)
        self.cell = nn.GRUCell(4, 4)
        self.softmax = nn.Softmax(dim=-1)
        self.conv = nn.Conv1d(4, 3, 2)  # (C=4, L) per example
        self.pool = nn.MaxPool1d(2)
        self.norm = nn.LayerNorm(4)
        self.prelu = nn.PReLU(4)  # per channel: dim 1 of a batch, dim 0 of an example
        self.bilinear = nn.Bilinear(4, 4, 2)
        self.batchnorm = nn.BatchNorm1d(4).eval()
        self.embed = nn.Embedding(10, 3, padding_idx=0)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)


def _augmented(a: Any, b: Any, c: int) -> Any:
    """Augmented assignment changes the value in place: the name bound before sees it.
    (Its operands are both values or both handles: ``b`` may be the other kind.)"""
    z = a * 1.5
    kept = [z]
    z += a.sum()
    z *= 0.5 + c
    z -= a
    return kept[0] + z


def _set_items(a: Any, b: Any, c: int) -> Any:
    """Item assignment changes the value in place, as augmented assignment does (a
    row, a broadcast column from another value, a boolean mask)."""
    y = a * 1
    kept = [y]
    y[0] = 0.25 * c
    y[..., -1:] = a[..., :1] * 2
    y[a > 0.5] = -0.5
    return kept[0] + y


# Called as it is (not through batched_func): on a handle it records through
# __torch_function__ (F.relu(h, inplace=True)), on a value read by an await it runs.
_RELU_IN_PLACE = nn.ReLU(inplace=True)


def _in_place_calls(a: Any, b: Any, c: int) -> Any:
    """In-place calls (methods, torch functions, an in-place layer) change the value
    itself, as augmented assignment does: the name bound before sees them."""
    y = a * 1
    kept = [y]
    y.mul_(c - 0.5).add_(a, alpha=0.5)
    same = _RELU_IN_PLACE(y)  # last: autograd saves its result (eagerly too)
    z = a * 1
    torch.sigmoid_(z)
    return kept[0] + same * 2 + z


def _views_then_change(a: Any, b: Any, c: int) -> Any:
    """A value read through views before it changes in place: the views give the old
    values, the change the new ones (y[i] = y[i] + v, y += y[j] * k)."""
    y = a * 1
    before = y[..., :1] * 2
    y[..., 0] = y[..., 0] + 0.5 * c
    y += y[..., -1:] * 0.25
    return y + before


def catalog(m: Modules) -> dict[str, tuple[Applies, Op]]:
    """Name -> (applies, op). ``m``'s modules are called through ``batched_func``
    sites made here, which run eagerly when no policy records."""
    lin, cell, softmax = bg.batched_func(m.lin), bg.batched_func(m.cell), bg.batched_func(m.softmax)
    conv, pool, norm = bg.batched_func(m.conv), bg.batched_func(m.pool), bg.batched_func(m.norm)
    prelu, bilinear = bg.batched_func(m.prelu), bg.batched_func(m.bilinear)
    batchnorm, embed = bg.batched_func(m.batchnorm), bg.batched_func(m.embed)
    attention = bg.batched_func(m.attention)
    ops: dict[str, tuple[Applies, Op]] = {
        # Elementwise, with broadcasting and Python scalars on either side.
        "tanh": (_always, lambda a, b, c: torch.tanh(a)),
        "sigmoid": (_always, lambda a, b, c: a.sigmoid() * 2),
        "exp_neg": (_always, lambda a, b, c: torch.exp(-a.abs())),
        "pow": (_always, lambda a, b, c: a**2 + 2**a),
        "rsub": (_always, lambda a, b, c: 1 - a / 3),
        "clamp": (_always, lambda a, b, c: a.clamp(-0.5, 0.5) + a.clamp(min=0)),
        "where": (_always, lambda a, b, c: torch.where(a > 0, a, b.mean() if b.numel() else 0.0)),
        "mul_b": (_always, lambda a, b, c: a * b if broadcasts(a, b) else a * 0.5),
        "maximum_b": (_always, lambda a, b, c: torch.maximum(a, b) if broadcasts(a, b) else a),
        "add_bsum": (_always, lambda a, b, c: a + b.sum()),
        "masks": (_always, lambda a, b, c: (((a > 0) & (a < 1)) | ~(a > -0.5) ^ (a > 2)).double() + (+a)),
        "compare": (_always, lambda a, b, c: (a == 0.5).double() + (a != a.sum()).double() * a),
        "int_ops": (_always, lambda a, b, c: (((a * 10).long() // 3) % 4 + 7 // ((a * 3).long().abs() + 1)).double() + a),
        # Float32 round trips, the gradient kept in float64: merged casts sum their
        # float32 gradients before casting back, eager code after (1e-7 apart).
        "casts": (_always, lambda a, b, c: a + (a.to(torch.float32).to(a.dtype) + a.float().double() - 2 * a).detach()),
        # 0-d tensors rank below tensors with dimensions in type promotion (computed
        # in float32 when eager, the gradient kept in float64 as for "casts").
        "promote_0d": (_always, lambda a, b, c: a + (
            (a.float() * torch.tensor(1.5, dtype=torch.float64)).double()
            + (a.sum() * torch.ones(2, dtype=torch.float32)).double().sum()
            + torch.where(a.float() > torch.tensor(0.1, dtype=torch.float64), 1.0, 0.0) - a
        ).detach()),
        "detach": (_always, lambda a, b, c: a.detach() * a),
        "relu_gelu": (_always, lambda a, b, c: F.relu(a) + F.gelu(a)),
        "lerp_addcmul": (_always, lambda a, b, c: torch.lerp(a, torch.zeros_like(a), 0.3) + torch.addcmul(a, a, a, value=0.5)),
        "new_ones": (_always, lambda a, b, c: a.new_ones(a.shape) - a),
        "dropout_eval": (_always, lambda a, b, c: F.dropout(a, 0.5, training=False)),
        "augmented": (_always, _augmented),
        "set_items": (_rows, _set_items),
        "in_place_calls": (_always, _in_place_calls),
        "views_then_change": (_ranked_nonempty, _views_then_change),
        # Full reductions.
        "sum": (_always, lambda a, b, c: a.sum()),
        "mean": (_nonempty, lambda a, b, c: a.mean()),
        "amax": (_nonempty, lambda a, b, c: a.amax()),
        "prod": (_always, lambda a, b, c: a.prod()),
        "norm": (_always, lambda a, b, c: (a * a).sum().sqrt() + a.norm()),
        "argmax_take": (_nonempty, lambda a, b, c: a.reshape(-1)[a.reshape(-1).argmax()] * a),
        # Ops with a dim (0-d values take 0 and -1 too).
        "sum_dim": (_always, lambda a, b, c: a.sum(dim_of(a, c), keepdim=c % 2 == 0)),
        "mean_dim": (_nonempty, lambda a, b, c: torch.mean(a, dim=dim_of(a, c))),
        "amax_dim": (_nonempty, lambda a, b, c: torch.amax(a, dim=dim_of(a, c))),
        "argmin_dim": (_nonempty, lambda a, b, c: a.argmin(dim_of(a, c)).double() + a.sum()),
        "logsumexp": (_always, lambda a, b, c: torch.logsumexp(a, dim_of(a, c))),
        "softmax": (_always, lambda a, b, c: torch.softmax(a, dim_of(a, c))),
        "log_softmax": (_always, lambda a, b, c: F.log_softmax(a, dim=dim_of(a, c))),
        "softmax_dtype": (_always, lambda a, b, c: torch.softmax(a, -1, dtype=torch.float64)),
        "cumsum": (_always, lambda a, b, c: a.cumsum(dim_of(a, c))),
        "cat": (_ranked, lambda a, b, c: torch.cat([a, a * 2], dim=dim_of(a, c))),
        "stack": (_always, lambda a, b, c: torch.stack([a, torch.tanh(a)], dim=new_dim_of(a, c))),
        "max_dim": (_nonempty, lambda a, b, c: a.max(dim=dim_of(a, c)).values),
        "max_fields": (_ranked_nonempty, lambda a, b, c: a.max(-1).indices.double() + a.max(-1).values),
        "sort": (_ranked, lambda a, b, c: a.sort(dim=dim_of(a, c)).values),
        "topk": (_nonempty, lambda a, b, c: a.reshape(-1).topk(min(2, a.numel())).values),
        "std": (lambda a: bool(a.numel() > 1), lambda a, b, c: a.std() + a),
        # Static indexing.
        "index0": (_rows, lambda a, b, c: a[0]),
        "index_last": (_rows, lambda a, b, c: a[-1]),
        "slice": (_ranked, lambda a, b, c: a[..., 1:]),
        "none": (_always, lambda a, b, c: a[None]),
        "index_tuple": (_matrix, lambda a, b, c: a[-1, ..., None]),
        "select": (_rows, lambda a, b, c: a.select(0, -1)),
        "narrow": (lambda a: bool(a.ndim > 0 and a.shape[-1] > 0), lambda a, b, c: a.narrow(-1, 0, 1)),
        # Indexing by tensors computed from values (handles when recorded).
        "index_by_0d": (_rows, lambda a, b, c: a[_row_order(a)[0]]),
        "index_by_1d": (_rows, lambda a, b, c: a[_row_order(a)[:1]]),
        "index_select": (_rows, lambda a, b, c: a.index_select(0, _row_order(a))),
        "gather": (_ranked_nonempty, lambda a, b, c: torch.gather(a, -1, a.argsort(-1))),
        "masked_fill": (_always, lambda a, b, c: a.masked_fill(a > 0, 0.25)),
        # Shapes and layouts.
        "unsqueeze": (_always, lambda a, b, c: a.unsqueeze(new_dim_of(a, c))),
        "flatten": (_always, lambda a, b, c: a.reshape(-1) + a.flatten()),
        "view": (_ranked, lambda a, b, c: a.contiguous().view(-1, 1) + 0),
        "reshape_size": (_ranked_nonempty, lambda a, b, c: a.reshape(a.size(-1), -1)),
        "squeeze": (_always, lambda a, b, c: a.squeeze()),
        "transpose": (_matrix, lambda a, b, c: a.transpose(0, -1) * 1.5),
        "mT": (_matrix, lambda a, b, c: a.mT),
        "permute": (_ranked, lambda a, b, c: a.permute(*reversed(range(a.ndim)))),
        "movedim": (_matrix, lambda a, b, c: a.movedim(0, -1)),
        "flip_roll": (_ranked, lambda a, b, c: a.flip(0) + a.roll(1, 0)),
        "expand": (_always, lambda a, b, c: a.unsqueeze(0).expand(2, *a.shape) * 1.0),
        "repeat": (_ranked, lambda a, b, c: a.repeat(2, *[1] * (a.ndim - 1))),
        "pad": (_ranked, lambda a, b, c: F.pad(a, (1, 2))),
        "chunk": (lambda a: bool(a.ndim > 0 and a.shape[-1] >= 2), lambda a, b, c: a.chunk(2, -1)[0]),
        "split": (lambda a: bool(a.ndim > 0 and a.shape[0] >= 2), lambda a, b, c: torch.split(a, 1)[1]),
        "unbind": (_rows, lambda a, b, c: a.unbind(0)[-1]),
        "tril": (_matrix, lambda a, b, c: a.tril()),
        "diag_outer": (lambda a: bool(a.ndim == 1), lambda a, b, c: torch.diag(a) + torch.outer(a, a)),
        # Products and modules.
        "matmul": (_matrix, lambda a, b, c: a @ a.transpose(-1, -2)),
        "einsum": (_ranked, lambda a, b, c: torch.einsum("...i->...", a) + torch.einsum("...i,...i->...", a, a)),
        "layer_norm": (lambda a: bool(a.ndim > 0 and a.shape[-1] > 1), lambda a, b, c: F.layer_norm(a, a.shape[-1:])),
        "normalize": (_ranked, lambda a, b, c: F.normalize(a, dim=-1)),
        "linear": (_features, lambda a, b, c: lin(a)),
        "gru_cell": (lambda a: bool(a.ndim == 1 and a.shape[0] == 4), lambda a, b, c: cell(a, torch.tanh(a))),
        "softmax_module": (_always, lambda a, b, c: softmax(a)),
        "conv_pool": (lambda a: bool(a.ndim == 2 and a.shape[0] == 4 and a.shape[1] >= 3),
                      lambda a, b, c: pool(conv(a))),
        "layer_norm_module": (_features, lambda a, b, c: norm(a)),
        "prelu": (lambda a: bool(a.ndim == 2 and a.shape[1] == 4), lambda a, b, c: prelu(a)),
        "bilinear": (_features, lambda a, b, c: bilinear(a, torch.tanh(a))),
        "batchnorm_eval": (lambda a: bool(a.ndim == 1 and a.shape[0] == 4) or bool(a.ndim == 2 and a.shape[0] == 4),
                           lambda a, b, c: batchnorm(a.unsqueeze(0)).squeeze(0)),
        "embed_tokens": (_nonempty, lambda a, b, c: embed((a.abs() * 3).long().clamp(max=9)).sum(-1) * a),
        "attention": (lambda a: bool(a.ndim == 2 and a.shape[-1] == 4),
                      lambda a, b, c: attention(a, a, a, need_weights=False)[0]),
        "cross_entropy": (lambda a: bool(a.ndim in (1, 2) and a.shape[-1] == 4), lambda a, b, c: F.cross_entropy(a, a.argmax(-1))),
        "losses": (_always, lambda a, b, c: F.mse_loss(a, torch.zeros_like(a)) + F.smooth_l1_loss(a, a * 0.5)
                   + F.binary_cross_entropy_with_logits(a, (a > 0).double())),
        "cosine": (_ranked, lambda a, b, c: F.cosine_similarity(a, a + 1, dim=-1)),
        "one_hot_static": (_nonempty, lambda a, b, c: F.one_hot((a.abs() * 2).long().clamp(max=4), 5).double() + a.unsqueeze(-1)),
        "interpolate": (lambda a: bool(a.ndim == 2), lambda a, b, c: F.interpolate(a.unsqueeze(0), scale_factor=2.0).squeeze(0)),
        "index_put": (_rows, lambda a, b, c: a.index_put((torch.tensor([0]),), torch.tensor(7.0, dtype=a.dtype))),
    }
    return ops


def run_program(ops: dict[str, tuple[Applies, Op]], x: Any,
                program: list[tuple[str, int, int, int]]) -> list[Any]:
    """Every value the program makes from ``x`` (``x`` first). Each step is
    ``(op, which a, which b, c)``, the picks taken modulo the values made so far."""
    values = [x]
    for name, pick_a, pick_b, c in program:
        applies, op = ops[name]
        a = values[pick_a % len(values)]
        if applies(a):
            values.append(op(a, values[pick_b % len(values)], c))
    return values


async def run_program_awaiting(ops: dict[str, tuple[Applies, Op]], x: Any,
                               program: list[tuple[str, int, int, int]],
                               awaits: list[bool]) -> list[Any]:
    """``run_program`` as a coroutine example that reads some of its values as it
    goes (``awaits[k % len(awaits)]`` for the k-th step): later steps then mix the
    tensors read with handles, as decoders do. ``x`` enters as ``batched_value(x)``
    (itself when run eagerly)."""
    values = [bg.batched_value(x)]
    for k, (name, pick_a, pick_b, c) in enumerate(program):
        applies, op = ops[name]
        a = values[pick_a % len(values)]
        if applies(a):
            value = op(a, values[pick_b % len(values)], c)
            if awaits[k % len(awaits)]:
                value = await bg.value(value)
            values.append(value)
    return values
