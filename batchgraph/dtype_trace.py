"""Whether ``torch.func.vmap`` computes a call in the dtypes its eager run computes in.

vmap keeps each example's shapes (``batchgraph.vmap_probe.probe_vmap`` checks them) but not
always its dtypes, in two ways that give other values without an error:

* Some batching rules ignore the promotion rank of a 0-d input: ``torch.addcmul(a, b,
  c)`` with ``a`` float32 of shape (3,) and ``c`` a float64 0-d tensor is float32
  eagerly; vmapped, ``c`` has a batch dimension and the op computes in float64. A
  cast at the end gives the eager dtype back, but not the eager values, and a call
  on the result inside the same function (``> 0.1``) sees the float64 ones.
* Autocast acts below vmap: it casts the ops a batching rule calls, not the op the
  example called. ``torch.mv`` (not on autocast's list: float32 eagerly) is batched
  as a matrix product, which autocast runs in bfloat16; ``torch.addmv`` even comes
  back float32, its product computed in bfloat16.

``vmap_traced`` runs a call on fake tensors per example and vmapped, and compares, for
each torch function the call's own code makes, the dtypes of its results and, under
autocast, the floating dtypes its kernels computed in. A call that differs runs one
example at a time, as eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from batchgraph.autocasting import autocast_enabled
from batchgraph.promotion import reads_wide

__all__ = ["DtypeTrace", "vmap_traced"]

# One entry per torch function the traced code called: the function, its results'
# dtypes, and the floating dtypes its kernels read or wrote (under autocast only).
Entry = tuple[Any, tuple[torch.dtype, ...], frozenset[torch.dtype]]


class DtypeTrace(TorchFunctionMode):
    """Notes the dtypes of each torch function the code run under it calls.

    Only the calls the code makes itself are noted (``F.linear`` in a module's
    ``forward``, not the ops ``F.linear`` calls): those are what eager code and its
    vmapped run have in common. Under vmap the tensors the code sees are each example's,
    so their dtypes compare with the eager run's directly.

    Example:
        >>> x = torch.ones(2, dtype=torch.int64)
        >>> with DtypeTrace() as trace:
        ...     y = (x * 2.5).sum()
        >>> [(f.__name__, dtypes) for f, dtypes, _ in trace.entries]
        [('mul', (torch.float32,)), ('sum', (torch.float32,))]
    """

    def __init__(self, kernels: bool = False) -> None:
        super().__init__()
        self.entries: list[Entry] = []
        self.kernels = kernels
        # The floating dtypes the kernels of the call being run used, if noted.
        self.current: set[torch.dtype] | None = None
        # Whether a call mixed a 0-d integer tensor with tensors of other integer
        # dtypes and computed in another (a comparison, a true division): see
        # _mixes_integers.
        self.mixed_integers = False
        # Whether a call read a 0-d operand in float32 beside float16 tensors
        # (x_f16 * c): vmap rounds it to float16 first (promotion.reads_wide).
        self.read_wide = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        seen: set[torch.dtype] = set()
        self.current = seen if self.kernels else None
        try:
            # This mode is off while its handler runs: the calls func makes within
            # are not entries of their own, their kernels count as func's.
            out = func(*args, **(kwargs or {}))
        finally:
            self.current = None
        dtypes = tuple(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if not self.mixed_integers and _mixes_integers((args, kwargs), dtypes):
            self.mixed_integers = True
        if not self.read_wide and reads_wide(func, args, kwargs):
            self.read_wide = True
        if dtypes or seen:
            self.entries.append((func, dtypes, frozenset(seen)))
        return out


def _integral(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _mixes_integers(arguments: Any, results: tuple[torch.dtype, ...]) -> bool:
    """Whether a call takes a 0-d integer tensor beside tensors with dimensions of
    another integer dtype, and gives a result that is not an integer (``x < c``,
    ``x / c``, ``torch.atan2(x, c)``).

    Eagerly such a call computes as promotion ranks the 0-d tensor: a comparison of a
    uint8 ``x`` with ``c = torch.tensor(-3)`` compares with 253, a division converts
    -3 to float as it is. vmap's batching rules give the same dtypes but not these
    values (they compare with -3, divide by 253), which no dtype tells.
    """
    if any(_integral(d) for d in results) and all(_integral(d) for d in results):
        return False
    zero: set[torch.dtype] = set()
    ranked: set[torch.dtype] = set()
    for t in tree_leaves(arguments):
        if isinstance(t, torch.Tensor) and _integral(t.dtype):
            (ranked if t.dim() else zero).add(t.dtype)
    return bool(zero) and bool(ranked) and len(zero | ranked) > 1


class _KernelDtypes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds the floating dtypes of each kernel's tensors to ``trace.current``. A
    dispatch mode runs below autocast and vmap: it sees the casts autocast made and
    the ops a batching rule called."""

    def __init__(self, trace: DtypeTrace) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.trace = trace

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        seen = self.trace.current
        if seen is not None:
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen.add(t.dtype)
        return out


def _traced(run: Callable[[], Any], trace: DtypeTrace) -> None:
    if trace.kernels:
        with _KernelDtypes(trace):
            run()
    else:
        run()


def vmap_traced(
    per_example: Callable[..., Any],
    examples: Sequence[torch.Tensor],
    batched: Sequence[torch.Tensor],
    undone: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[Any, bool]:
    """``per_example`` vmapped over ``batched`` (its output, as ``torch.func.vmap``
    gives it), and whether it computes there in the same dtypes as on ``examples``
    (one example's inputs): each torch function it calls gives results of the same
    dtypes, under autocast its kernels compute in the same floating dtypes, and no
    call mixes integer dtypes across a 0-d input or reads a 0-d one in float32 beside
    float16 tensors, where vmap computes otherwise (``_mixes_integers``,
    ``promotion.reads_wide``). Run on fake tensors by the caller; the example's run
    inside ``undone()`` (what it leaves in modules is undone before the vmapped run).

    Example:
        >>> x, c = torch.ones(3), torch.tensor(2.0, dtype=torch.float64)
        >>> vmap_traced(torch.mul, [x, c], [x.expand(2, 3), c.expand(2)])[1]
        True
        >>> out, same = vmap_traced(torch.addcmul, [x, x, c],
        ...                         [x.expand(2, 3), x.expand(2, 3), c.expand(2)])
        >>> out.dtype, same        # eagerly float32
        (torch.float64, False)
    """
    kernels = autocast_enabled()
    eager, vmapped = DtypeTrace(kernels), DtypeTrace(kernels)

    def run_eager() -> None:
        with undone(), eager:
            per_example(*examples)

    def traced_example(*xs: torch.Tensor) -> Any:
        # Entered inside the vmapped function: vmap's own calls around it are not the
        # example's.
        with vmapped:
            return per_example(*xs)

    try:
        _traced(run_eager, eager)
        compared = True
    except Exception:
        # No eager trace to compare with: a run on fake tensors that vmap makes but
        # one example cannot (``table[i]`` with a 0-d index is read on the host, where
        # vmap indexes with the batch). The vmapped run is taken as it is.
        compared = False
    box: list[Any] = []
    _traced(lambda: box.append(
        torch.func.vmap(traced_example, randomness="different")(*batched)), vmapped)
    if not compared:
        return box[0], True
    # (The vmapped run's reads tell an example's 0-d operand from a constant one.)
    same = (not eager.mixed_integers and not eager.read_wide and not vmapped.read_wide
            and _entries_match(eager.entries, vmapped.entries, kernels))
    return box[0], same


def _entries_match(eager: list[Entry], vmapped: list[Entry], autocast: bool) -> bool:
    """Whether the vmapped trace computes as the eager one did.

    Without autocast, dtypes must be equal. Under autocast vmap may compute in a finer
    dtype than eagerly (``prelu``'s batching rule, a ``Linear``'s bias added in float32
    after a bfloat16 product): the results differ by the eager rounding, and are cast
    to the eager dtype at the end, as before. What is refused is a coarser one: a
    result, or a kernel in a dtype the eager call did not use and coarser than the
    finest it did, which loses the precision eager code has.
    """
    if len(eager) != len(vmapped):
        return False
    for (f_eager, out_eager, kernels_eager), (f_vmap, out_vmap, kernels_vmap) in zip(
        eager, vmapped
    ):
        if f_eager is not f_vmap or len(out_eager) != len(out_vmap):
            return False
        for a, b in zip(out_eager, out_vmap):
            if a != b and not (autocast and _finer(b, a)):
                return False
        if autocast:
            finest = min((_eps(d) for d in kernels_eager), default=0.0)
            if any(_eps(d) > finest for d in kernels_vmap - kernels_eager):
                return False
    return True


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def _finer(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether floating dtype ``a`` is at least as precise as floating ``b``."""
    return a.is_floating_point and b.is_floating_point and _eps(a) <= _eps(b)
