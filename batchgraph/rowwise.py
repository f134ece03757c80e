"""An opt-in ``BatchKey`` for row-wise modules over sequences of any lengths.

Per example, code often applies a module to a whole sequence at once: a tag MLP over
a sentence's ``(T, 2H)`` LSTM outputs, ``nn.Embedding`` over its ``(T,)`` word ids. The
default keys include the full shape, so such calls batch only among examples of equal
length. When the module treats the rows of its inputs independently, all the calls can
run as one: the examples' inputs concatenated along dim 0, one call, the output split
back by the lengths. ``RowwiseKey`` does that; it is never chosen by default, because
only the user knows that a module does not mix rows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import torch

from batchgraph.errors import BatchedCallError, ShapeMismatchError
from batchgraph.inference import fake_apply
from batchgraph.keys import BatchKey, callable_name
from batchgraph.recording import not_recording
from batchgraph.rules import RandomDraws
from batchgraph.specs import (
    CallSignature,
    TensorSpec,
    flatten_output,
    rebuild_sequence,
    sequence_kind,
)

__all__ = ["RowwiseKey"]

# Identities (all but the lengths) whose rows were probed on fake tensors where
# recorded, and whose first batch was checked against runs of single examples (see
# RowwiseKey._check_rows): per callable, dropped with it; callables that cannot be
# weakly referenced (builtins, which live as long as the process) in a plain set.
_PROBED: weakref.WeakKeyDictionary[Any, set[Hashable]] = weakref.WeakKeyDictionary()
_CHECKED: weakref.WeakKeyDictionary[Any, set[Hashable]] = weakref.WeakKeyDictionary()
_STRONG: dict[str, set[Hashable]] = {"probed": set(), "checked": set()}


def _done(table: weakref.WeakKeyDictionary[Any, set[Hashable]], fn: Any,
          what: str) -> set[Hashable]:
    """The identities of ``fn`` that had ``what`` done (a set to add to)."""
    try:
        return table.setdefault(fn, set())
    except TypeError:  # not weakly referenceable: a builtin, never freed
        return _STRONG[what]

# How far the batched rows of one example may be from its call run alone, relative to
# the largest value, before the callable is taken to mix rows: batched matrix products
# may sum in another order, so not exact; a row-mixing callable is off by the values'
# own size.
_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}
_LOW_PRECISION_TOLERANCE = 3e-2


def _rows_only(sig: Any) -> Any:
    """``sig`` (a call's statics) with each tensor spec's leading length left out."""
    if type(sig) is TensorSpec:
        return ("rows of", sig.shape[1:], sig.dtype, sig.device)
    if type(sig) is tuple:
        return tuple(_rows_only(s) for s in sig)
    return sig


class RowwiseKey(BatchKey):
    """Runs calls on sequences of any lengths as one call over all their rows.

    For a callable that treats the rows of its inputs independently (``nn.Linear``,
    ``nn.Embedding``, ``nn.LayerNorm``, activations, an MLP of these): each example's
    tensor inputs are concatenated along dim 0 with every other example's, the callable
    runs once, and its output (each tensor of it, for a tuple) is split back by the
    examples' lengths. Calls batch when all but the leading lengths match: the
    callable, the static arguments, and each input's other dimensions, dtype and
    device.

    Never chosen by default: attach it with ``batch_key = bg.RowwiseKey`` on a module
    class, or ``BatchingPolicy(rules={nn.Linear: bg.RowwiseKey})``.

    **Only for callables whose every output row depends on the same row of the inputs
    alone.** One that mixes rows (attention over the sequence, a sum, mean or
    ``cumsum`` over dim 0, ``BatchNorm`` in training mode) would see all the examples'
    rows as one sequence and compute something else. The first batch of each signature
    (all but the lengths) that holds two examples with rows is checked against the
    first two run alone (without grad, outside the stats) and a mismatch fails with
    ``BatchedCallError``; that catches the usual misuse, not every one (a callable
    drawing random numbers is not checked). Set ``check_rows = False`` in a subclass
    to skip it.

    Rules, checked where a call is recorded (``ShapeMismatchError``): every tensor
    input has at least one dimension, and all of an example's tensor inputs have the
    same leading length (the rows; two ``(T, F)`` inputs of an elementwise module, say).
    A per-example ``(F,)`` vector beside ``(T, F)`` rows is refused: it has no rows.
    ``(T,)`` inputs are ``T`` rows of single values (word ids into ``nn.Embedding``).
    Static arguments must be equal (a ``length=T`` argument keeps lengths apart).
    Examples with no rows (``T == 0``) are fine where the callable takes 0 rows.
    Every output tensor must have the rows as its leading dimension: where the first
    call of a signature (all but the lengths) is recorded, it runs on fake tensors at
    its length and one row more, and one that then fails or returns other rows is
    refused (``ShapeMismatchError``).

    Example:
        >>> import batchgraph as bg, torch
        >>> emb = torch.nn.Embedding(10, 4)
        >>> lookup = bg.batched_func(emb)
        >>> with bg.BatchingPolicy(rules={torch.nn.Embedding: bg.RowwiseKey}) as p:
        ...     hs = [lookup(torch.arange(n)) for n in (3, 5, 0, 2)]
        >>> [tuple(h.shape) for h in bg.compute(hs)], p.stats.launches
        ([(3, 4), (5, 4), (0, 4), (2, 4)], 1)
    """

    combine: ClassVar[str] = "list"
    check_rows: ClassVar[bool] = True

    def __init__(self, fn: Callable[..., Any], call: CallSignature, *, deterministic: bool = True):
        specs = call.input_specs
        name = callable_name(fn)
        if not specs:
            raise ShapeMismatchError(
                f"RowwiseKey[{name}] batches the rows of a call's tensor inputs, and this "
                "call has none: register RowwiseKey only for callables given tensors."
            )
        for i, spec in enumerate(specs):
            if spec is not None and not spec.shape:
                raise ShapeMismatchError(
                    f"RowwiseKey[{name}]: tensor input {i} is 0-d, which has no rows to "
                    "concatenate with other examples'. Pass it as one row (x.view(1)), or "
                    "register RowwiseKey for the module instances that get rows only "
                    "(rules={model.embed: bg.RowwiseKey}): by default a 0-d id into "
                    "nn.Embedding batches by stacking."
                )
        lengths = {s.shape[0] for s in specs if s is not None}
        if len(lengths) > 1:
            shown = ", ".join(f"input {i}: {s.describe()}" for i, s in enumerate(specs) if s)
            raise ShapeMismatchError(
                f"RowwiseKey[{name}] needs every tensor input of a call to have the same "
                f"leading length (the example's rows), got {shown}. A per-example input "
                "without rows (a vector added to every row) cannot be concatenated row by "
                "row: repeat it to the rows first (v.expand(T, -1)), or leave this "
                "callable to the default keys."
            )
        # Kept: keys are compared by identity each time a call of them is recorded.
        self._identity = (id(fn), _rows_only(call.statics))
        super().__init__(fn, call, deterministic=deterministic)
        # Once per identity, not per length: a new length is a new signature, and
        # fake runs cost milliseconds (every sentence length of a corpus).
        probed = _done(_PROBED, fn, "probed")
        identity = self.identity()
        if identity in probed:
            return
        problem = _rows_problem(fn, call, lengths.pop())
        if problem is not None:
            raise ShapeMismatchError(
                f"RowwiseKey[{name}] runs a call on every example's rows at once, but "
                f"{problem}: it does not take its inputs' leading dimension as rows (a "
                "per-example (F,) vector into nn.Linear is F rows of single values to "
                "RowwiseKey), or it reduces or reshapes them. Leave this call to the "
                "default keys."
            )
        probed.add(identity)

    def identity(self) -> Hashable:
        # The callable and the whole signature but each input's leading length.
        return self._identity

    def run(self, fn: Callable[..., Any], inputs: Sequence[Any], size: int) -> Any:
        columns = [list(column) for column in inputs]
        lengths = [int(x.shape[0]) for x in columns[0]]
        joined = [c[0] if size == 1 else torch.cat(c) for c in columns]
        out = self.call.apply(fn, joined)
        results = _split(out, lengths, sum(lengths), self.label)
        if self.check_rows and size > 1 and self.deterministic:
            self._check_rows(fn, columns, lengths, results)
        return results

    def _check_rows(
        self, fn: Callable[..., Any], columns: list[list[torch.Tensor]], lengths: list[int],
        results: list[Any],
    ) -> None:
        """Once per identity, the first two examples with rows, run alone, against
        their rows of the batched call: a callable that mixes rows differs."""
        identity = self.identity()
        checked = _done(_CHECKED, fn, "checked")
        if identity in checked:
            return
        rows = [i for i, n in enumerate(lengths) if n > 0][:2]
        if len(rows) < 2:
            return  # nothing to tell: a later batch checks
        for i in rows:
            with torch.no_grad(), RandomDraws() as draws:
                alone = self.call.apply(fn, [c[i] for c in columns])
            if draws.seen:  # its own random numbers: no two runs agree
                checked.add(identity)
                return
            mine: list[torch.Tensor] = []
            theirs: list[torch.Tensor] = []
            flatten_output(results[i], mine)
            flatten_output(alone, theirs)
            for j, (got, want) in enumerate(zip(mine, theirs)):
                error = _difference(got.detach(), want)
                if error is not None:
                    raise BatchedCallError(
                        f"{self.label} computed example rows that differ from the call run "
                        f"alone (output {j} of the example at row {i}: {error}): the "
                        "callable mixes the rows of its inputs (attention, a sum or mean "
                        "over the sequence, BatchNorm in training mode), so all the "
                        "examples' rows, concatenated, are one sequence to it. RowwiseKey "
                        "is only for callables that treat rows independently: remove it "
                        "(the default keys batch examples of equal lengths)."
                    )
        checked.add(identity)


def _rows_problem(fn: Callable[..., Any], call: CallSignature, rows: int) -> str | None:
    """What goes wrong when the call gets one row more on fake tensors (once per
    signature, where it is recorded), or None: each output must have the rows, and
    only the rows may change (run at both lengths: one may match by chance)."""
    more = tuple(None if s is None else s._replace(shape=(rows + 1, *s.shape[1:]))
                 for s in call.input_specs)
    with not_recording():
        try:
            out = fake_apply(fn, call)
        except Exception:  # not on fake tensors at all: its recording tells
            return None
        try:
            out_more = fake_apply(fn, CallSignature(call.args, call.kwargs, more, call.statics))
        except Exception as err:
            return f"given {rows + 1} rows where the call has {rows}, it raised {err}"
    leaves: list[torch.Tensor] = []
    leaves_more: list[torch.Tensor] = []
    try:
        flatten_output(out, leaves)
        flatten_output(out_more, leaves_more)
    except TypeError:  # not tensors: its recording says so
        return None
    for j, (leaf, other) in enumerate(zip(leaves, leaves_more)):
        if leaf.dim() == 0 or leaf.shape[0] != rows or other.shape != (rows + 1, *leaf.shape[1:]):
            return (f"its output {j} has shape {tuple(leaf.shape)} for {rows} rows and "
                    f"{tuple(other.shape)} for {rows + 1}, not the rows leading")
    return None


def _difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How ``got`` differs from ``want`` beyond rounding, or None."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} where alone {tuple(want.shape)}"
    if not got.numel():
        return None
    if not (got.is_floating_point() or got.is_complex()):
        return None if torch.equal(got, want) else "values differ"
    diff = float((got - want.to(got.dtype)).abs().max())
    scale = float(want.abs().max())
    tol = _TOLERANCE.get(got.dtype, _LOW_PRECISION_TOLERANCE) * scale
    if diff <= tol or (diff != diff and scale != scale):  # NaN where alone NaN too
        return None
    return f"largest difference {diff:.3g}, largest value {scale:.3g}"


def _split(out: Any, lengths: list[int], total: int, label: str) -> list[Any]:
    """``out`` of the call on every example's rows, as one result per example."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or out.shape[0] != total:
            raise BatchedCallError(
                f"{label} returned a {tuple(out.shape)} tensor for {len(lengths)} examples' "
                f"{total} rows concatenated: RowwiseKey needs every output tensor to have "
                "the rows of its inputs as its leading dimension, one output row per input "
                "row. This callable reshapes or reduces over the rows (or takes a per-"
                "example input other than rows): remove RowwiseKey for it."
            )
        return list(torch.split(out, lengths))
    if out is None:
        return [None] * len(lengths)
    if isinstance(out, (tuple, list)):
        parts = [_split(o, lengths, total, label) for o in out]
        kind = sequence_kind(out) or tuple
        return [rebuild_sequence(kind, [p[i] for p in parts]) for i in range(len(lengths))]
    raise BatchedCallError(f"{label} returned {type(out).__name__}, not tensors")
