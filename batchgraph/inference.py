"""Shape inference: a recorded call's output spec, found by running it once on fake
tensors of its per-example input specs (once per call signature).

Besides the spec, the run tells whether the call draws random numbers (such calls
are never merged) and the kind of sequence its result is (handles come back in it).
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.overrides import TorchFunctionMode

from batchgraph.autocasting import without_autocast_cache
from batchgraph.errors import NotATensorError, ShapeMismatchError
from batchgraph.fake_mode import (
    begin_run,
    changed_in_place,
    end_run,
    fake_mode,
    fakes_of,
    mixes_fakes,
)
from batchgraph.handle_operators import set_item
from batchgraph.keys import callable_name
from batchgraph.lifetimes import trim_fake_cache
from batchgraph.module_state import carries_state, state_kept
from batchgraph.python_random import note_if_drawn, rng_states
from batchgraph.result_kinds import ResultKind, result_kind
from batchgraph.rules import RandomDraws
from batchgraph.specs import (
    CallSignature,
    InputSlot,
    OutSpec,
    TensorSpec,
    spec_of,
    tuple_parts,
)

__all__ = ["fake_apply", "infer_spec", "on_fake_tensors", "warm_up", "warmed_up"]


class _HostRead(RuntimeError):
    """The function read a fake tensor's values on the host (``x.numpy()``,
    ``np.asarray(x)``): value-dependent Python, as ``x.item()`` is."""


# Errors meaning "the structure of the result cannot be known before running".
_UNKNOWABLE = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
    UnsupportedFakeTensorException,
    NotImplementedError,
    _HostRead,
)

# Tensor methods that hand a tensor's values to the host without an aten op (so
# FakeTensorMode has no DataDependentOutputException to raise, as it does for
# ``item()`` and ``tolist()``): on a fake tensor they fail with a RuntimeError that
# reads like any other, a shape error included.
_NUMPY, _ARRAY = torch.Tensor.numpy, torch.Tensor.__array__
# Tensor methods that call a Python function on each element's value: on a fake
# tensor ``apply_`` reads memory a fake has not (the process died of a segmentation
# fault) and ``map_``/``map2_`` fail with "not supported for tensor subclasses",
# which read as a shape error. Value-dependent Python, as ``item()`` is.
_PER_ELEMENT_PYTHON = frozenset({torch.Tensor.apply_, torch.Tensor.map_, torch.Tensor.map2_})
_DATA = vars(torch._C.TensorBase)["data"]  # its getter is the call a mode sees


# Python's in-place operators on tensors, besides the methods whose names end in "_".
_IN_PLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__setitem__",
})


class _FakeRunGuard(TorchFunctionMode):
    """What a run on fake tensors must not do to the real tensors a function holds.

    * Host reads of a fake tensor's values raise ``_HostRead``; a real tensor (a
      captured constant) is read as usual, outside the fake mode: inside it, torch
      makes a fake of the tensor on the way and reads that fake's memory (a warning
      now, undefined behaviour by torch's own account).
    * In-place changes of a real tensor are skipped: with no fake operand torch runs
      them for real, so a new call signature's shape inference counted a batch in a
      ``BatchNorm``'s ``num_batches_tracked`` (which, with ``momentum=None``, weighs
      its running statistics) or a module's call counter. A run on fakes only learns
      shapes, which an in-place change keeps.
    * Real tensors given to a call with fake operands (a module's parameters) are
      handed to it as their fakes kept in the mode (``fake_mode.fakes_of``), as its
      dispatch would convert them, so that the dispatch finds them in torch's cache.
    * The version counters of real tensors given to a call with fake operands stay:
      an in-place change inside it that the guard cannot see (``F.embedding`` with
      ``max_norm`` renormalizes its real weight by a call torch makes within) runs on
      a fake copy, leaving the values, but moved the counter: a new signature's
      inference then read as an in-place change of the module's parameters
      (``ParameterChangedError`` at compute) and could fail an earlier backward.
    * An in-place change through a view of a real tensor (``self.buf[:n].copy_(x)``,
      ``self.buf[0].add_(1)``, ``self.buf.data[0] = ...``) is noted as a change of that
      tensor: the view is a fake (or, for ``.data``, a real alias), whose change alone
      was seen as none, so a buffer written so and read back batched (silently).
    """

    def __init__(self, mode: FakeTensorMode) -> None:
        super().__init__()
        self.mode = mode
        # Fake views of real tensors, by their storage, and real aliases (.data), by
        # id: the real tensor they view (the views held, so the keys stay theirs).
        self.viewed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _real(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real tensor that ``t``, a real alias or a fake view of it, changes."""
        key = t.untyped_storage()._cdata if isinstance(t, FakeTensor) else id(t)
        found = self.viewed.get(key)
        return None if found is None else found[1]

    def _real_of(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, a real tensor, or the one it is an alias of (``.data``)."""
        real = self._real(t)
        return t if real is None else real

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))
        if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], FakeTensor):
            if func is _NUMPY or func is _ARRAY:
                with unset_fake_temporarily():
                    return func(*args, **kwargs)
            if in_place:
                changed_in_place(self._real_of(args[0]))  # state kept? see module_state
                if name == "__setitem__":
                    return None
                return args[0]  # an in-place method returns the tensor it changed
            out = self._run(func, args, kwargs)
            if isinstance(out, torch.Tensor) and (
                    getattr(func, "__self__", None) is _DATA or (
                        isinstance(out, FakeTensor) and out._is_view())):
                key = out.untyped_storage()._cdata if isinstance(out, FakeTensor) else id(out)
                self.viewed[key] = (out, self._real_of(args[0]))
            return out
        if (func is _NUMPY or func is _ARRAY) and args and isinstance(args[0], FakeTensor):
            raise _HostRead(f"{func.__name__}() of a value only known when the call runs")
        if self.viewed:
            target = args[0] if in_place and args else kwargs.get("out")
            real = self._real(target) if isinstance(target, FakeTensor) else None
            if real is not None:
                changed_in_place(real)
                # (the fake of a real tensor moves the real one's version counter)
                with _unsafe_preserve_version_counter((real,)):
                    return self._run(func, args, kwargs)
        return self._run(func, args, kwargs)

    def _run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if func in _PER_ELEMENT_PYTHON and any(
            isinstance(a, FakeTensor) for a in (*args, *kwargs.values())
        ):
            raise _HostRead(f"{func.__name__}() runs Python on values only known when "
                            "the call runs")
        out = kwargs.get("out")
        if isinstance(out, torch.Tensor) and not isinstance(out, FakeTensor):
            return out
        operands = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        real = tuple(a for a in operands if not isinstance(a, FakeTensor))
        if mixes_fakes(args, kwargs):
            args, kwargs = fakes_of(self.mode, args, kwargs)
        if real and len(real) < len(operands):
            with _unsafe_preserve_version_counter(real):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _QuietFakeErrors(logging.Filter):
    """Drops torch's error logs from this thread's batchgraph fake runs.

    Torch logs every exception of a meta kernel (a shape error) with its traceback,
    as ERROR on stderr, before raising it. A run here that fails raises
    ``ShapeMismatchError`` with torch's message in it, or learns only that a key
    cannot batch (``probe_vmap``): the log said it all again, even where the user
    caught the error. A filter on torch's logger, not a level change: other threads
    (their own fake tensor work) keep their logs, and torch's logging setup
    (``TORCH_LOGS``, ``torch._logging.set_logs``) replaces handlers, not filters.
    """

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    @property
    def depth(self) -> int:
        depth: int = getattr(self._local, "depth", 0)
        return depth

    @depth.setter
    def depth(self, value: int) -> None:
        self._local.depth = value

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or not self.depth


_QUIET = _QuietFakeErrors()
logging.getLogger(fake_tensor.__name__).addFilter(_QUIET)


@contextlib.contextmanager
def on_fake_tensors() -> Iterator[None]:
    """Where a call runs on fake tensors to learn its output: torch's fake mode (real
    tensors the function holds allowed), no autocast cache, host reads of fake values
    raised as ``_HostRead``, real tensors kept as they are (``_FakeRunGuard``), and
    torch's error log of a failing run left out (``_QuietFakeErrors``).

    Example:
        >>> with on_fake_tensors():
        ...     torch.ones(2, 3).sum(0).shape
        torch.Size([3])
    """
    mode = fake_mode()
    outermost = not _QUIET.depth
    if outermost:
        begin_run(mode)
        states = rng_states()  # a draw of Python's or NumPy's is one per batch
    _QUIET.depth += 1
    before = len(FakeTensorMode.cache)
    try:
        with without_autocast_cache(), mode, _FakeRunGuard(mode):
            yield
    finally:
        _QUIET.depth -= 1
        if outermost:  # the outermost run: its entries, nested runs' included
            trim_fake_cache(before)
            end_run(mode)
            note_if_drawn(states)


def infer_spec(
    fn: Callable[..., Any], name: str, call: CallSignature
) -> tuple[OutSpec, bool, ResultKind]:
    """The call's output spec (None: unknowable before it runs), whether it
    draws random numbers (assumed when that cannot be told either), and the
    result's sequence kinds (see ``batchgraph.result_kinds``).

    Raises:
        ShapeMismatchError: the call does not accept these per-example inputs.
        NotATensorError: it returns something other than tensors.

    Example:
        >>> from batchgraph.specs import TensorSpec
        >>> spec = TensorSpec((3,), torch.float32, torch.device("cpu"))
        >>> call = CallSignature((InputSlot(0),), (), (spec,), None)
        >>> infer_spec(torch.tanh, "tanh", call)[0].shape
        (3,)
    """
    if any(s is None for s in call.input_specs):
        return None, True, None
    draws = RandomDraws()
    try:
        try:
            out = _fake_apply(fn, call, draws, frozenset())
        except DataDependentOutputException:
            # ``table[i]`` with a 0-d integer tensor ``i`` (a predicted token) reads
            # its value, which a fake tensor has not. Such an index acts exactly as
            # the int would, and no int changes the result's shape: run it with 0.
            scalars = _scalar_index_slots(fn, call)
            if not scalars:
                raise
            out = _fake_apply(fn, call, draws, scalars)
    except _UNKNOWABLE:
        if fn is set_item and type(call.input_specs[0]) is TensorSpec:
            # `h[index] = value` keeps h's shape and dtype whatever the index selects
            # (a 0-d boolean mask, `h[h > 0] = v` on a 0-d h, whose selection fake
            # tensors cannot size): h stays a tensor of its spec, as eagerly.
            return call.input_specs[0], False, None
        return None, True, None
    except TypeError:
        raise
    except Exception as err:
        try:
            # Fakes require no grad, and a function differentiating with respect to
            # its input (forces = -torch.autograd.grad(energy, pos)) fails on them
            # where eagerly its input requires grad. Its spec is that of a run on
            # fakes that do; any other failure is the first run's.
            out = _fake_apply(fn, call, draws, frozenset(), grad=True)
        except Exception:
            shown = ", ".join(
                f"input {i}: {s.describe()}" for i, s in enumerate(call.input_specs) if s
            )
            raise ShapeMismatchError(
                f"{name} does not accept these per-example inputs ({shown}): "
                f"{type(err).__name__}: {err}. Per-example values carry no batch "
                "dimension; check the shapes the per-example code passes to this call."
            ) from err
    try:
        return spec_of(out), draws.seen, result_kind(out)
    except TypeError as err:
        if getattr(torch.Tensor, getattr(fn, "__name__", ""), None) is fn:
            # A tensor method called on a handle (h.is_contiguous(), h.stride()):
            # advice about wrapping tensor work would not fit.
            raise NotATensorError(
                f"{name} returned {type(out).__name__}{_culprit(out)}, a Python value: "
                "on a handle it is not known while recording (a handle has a value, and "
                "a memory layout, only once its batch has run). Compute the handle "
                "first (bg.compute(h), or `await bg.value(h)` in a coroutine example) "
                "and call it on the tensor."
            ) from err
        raise NotATensorError(
            f"{name} returned {type(out).__name__}{_culprit(out)}; a recorded call must "
            "return a tensor or a tuple of tensors (None allowed). Wrap the tensor work "
            "in a module or function that returns tensors, and do the rest on computed "
            "values."
        ) from err


_warm = False  # warm_up has run in this process


def warm_up() -> bool:
    """Pay torch's one-time set-up of its fake mode now: run one call on fake tensors.

    The first run on fake tensors in a process imports and builds what fake mode needs
    (1.3 s measured on a 2-core host; later new signatures took 10-40 ms), and it
    happens in the first recorded call. ``AsyncBatcher`` calls this on its executor
    thread, so that the event loop, where its examples record, is not blocked by it.

    Returns:
        Whether it ran (False: it already had, in this process).

    Example:
        >>> _ = warm_up()
        >>> warm_up()
        False
    """
    global _warm
    if _warm:
        return False
    spec = TensorSpec((2,), torch.float32, torch.device("cpu"))
    infer_spec(torch.tanh, "tanh", CallSignature((InputSlot(0),), (), (spec,), None))
    _warm = True
    return True


def warmed_up() -> bool:
    """Whether ``warm_up`` has run in this process.

    Example:
        >>> _ = warm_up()
        >>> warmed_up()
        True
    """
    return _warm


def _culprit(out: Any, where: str = "") -> str:
    """Where a result that is a tuple or list holds something other than tensors or
    None: `` holding int at [2]`` (empty when ``out`` itself is the culprit)."""
    if not isinstance(out, (tuple, list)):
        return f" holding {type(out).__name__} at {where}" if where else ""
    for i, item in enumerate(out):
        if item is not None and not isinstance(item, torch.Tensor):
            return _culprit(item, f"{where}[{i}]")
    return ""


def fake_apply(fn: Callable[..., Any], call: CallSignature) -> Any:
    """``call`` run on fake tensors of its input specs, as ``infer_spec`` runs it (a
    0-d integer index read on the host taken as 0); its errors propagate."""
    draws = RandomDraws()
    try:
        return _fake_apply(fn, call, draws, frozenset())
    except DataDependentOutputException:
        scalars = _scalar_index_slots(fn, call)
        if not scalars:
            raise
        return _fake_apply(fn, call, draws, scalars)


def _fake_apply(
    fn: Callable[..., Any], call: CallSignature, draws: RandomDraws, as_zero: frozenset[int],
    grad: bool = False,
) -> Any:
    """Run ``call`` on fake tensors of its input specs (the slots in ``as_zero``
    get the int 0 instead; with ``grad``, floating fakes require grad)."""
    # state_kept: a forward keeping a tensor it makes (self.mask = ...) keeps no fake.
    slots = [(i, s) for i, s in enumerate(call.input_specs) if s is not None]

    def inputs() -> list[Any]:
        return [
            0 if i in as_zero else torch.empty(
                s.shape, dtype=s.dtype, device=s.device,
                requires_grad=grad and (s.dtype.is_floating_point or s.dtype.is_complex))
            for i, s in slots
        ]

    with state_kept(fn) as kept, on_fake_tensors(), draws, draws.calls():
        fakes = inputs()
        out = call.apply(fn, fakes)
        # A forward changing its state again each call (self.n += 1) gives each call
        # another value: its calls run one at a time, in order (see module_state).
        carries_state(kept, lambda: call.apply(fn, inputs()))
    for (i, spec), fake in zip(slots, fakes):
        # (Made in inference mode, a fake keeps no version counter: not seen there.)
        if isinstance(fake, torch.Tensor) and not fake.is_inference() and fake._version:
            raise _changes_its_input(fn, i, spec)
    return out


def _changes_its_input(fn: Callable[..., Any], i: int, spec: TensorSpec) -> TypeError:
    """The error for a callable that changed its input ``i`` in place (``x.mul_(2)``
    in its body): eagerly the change reaches the caller's tensor and every later use
    of it, but a batched call gets its inputs gathered (copied) from the batch, so
    later calls would read the old values, silently."""
    return TypeError(
        f"{callable_name(fn)} changes its input {i} ({spec.describe()}) in place, which "
        "cannot be recorded: eagerly the change reaches the caller's tensor and every "
        "later use of it, but a batched call works on a gathered copy of its inputs. "
        "Change a copy instead (x = x.clone() first, or the out-of-place form: "
        "x = x * 2 for x.mul_(2)), and return what the caller needs."
    )


_INDEXING: tuple[Any, ...] = (operator.getitem, torch.Tensor.__getitem__)
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8})


def _scalar_index_slots(fn: Any, call: CallSignature) -> frozenset[int]:
    """The input slots of ``call`` that are 0-d integer tensors used as indices,
    when the index holds nothing else but ints, slices, ``None`` and ``...`` (with
    other tensor indices a 0-d one is an advanced index, not an int). Empty when
    ``call`` is not such an indexing.
    """
    if fn not in _INDEXING or len(call.args) != 2 or call.kwargs:
        return frozenset()
    slots = set()
    for part in tuple_parts(call.args[1]):
        if type(part) is InputSlot:
            spec = call.input_specs[part.slot]
            if spec is None or spec.shape or spec.dtype not in _INDEX_DTYPES:
                return frozenset()
            slots.add(part.slot)
        elif not (part is None or part is Ellipsis or type(part) in (int, slice)):
            return frozenset()
    return frozenset(slots)
