"""The fake tensor mode batchgraph's runs on fake tensors use: one per thread, kept
across runs, with the fakes of the real tensors they read kept too.

A run on fake tensors of a module call reads the module's real parameters, which
torch's fake mode turns into fakes at each operation that mixes them with fakes. With
a new mode per run (as before), every run converted every parameter anew, and an
operation with a real operand skips torch's dispatch cache of fake tensors: the full
fake kernel (``linear`` decomposed into ``addmm``, its type promotion, its meta
function) ran each time. Kept here, the fakes are converted once and handed to such an
operation in place of the real tensors (``fakes_of``), so its dispatch is all fakes
and found in the cache. Per run on a loaded 2-core host (/tmp/fk/ab.py, medians):
``nn.Linear(256, 256)`` 16 -> 7 ms, ``GRUCell`` 51 -> 29, an MLP 55 -> 24, a
``TransformerEncoderLayer`` 120 -> 72; a batch of 20 shapes with an annealed setting
404 -> 288 ms.

A kept fake stands for its real tensor while the tensor's layout is what it was when
converted (``_layout``: shape, strides, offset, storage and its size, dtype, device,
``requires_grad``, leaf or not), and while the fake itself was not changed in place by
a run (an embedding's ``max_norm`` renormalizes its weight within torch: on the fake,
moving its version). ``p.data = new``, ``p.resize_(...)``, ``p.requires_grad_(False)``
make it converted anew at its next use. An in-place change of values is no reason: a
fake has no values (``copy_data`` is off: it is on only under torch's
``fake_tensor_propagate_real_tensors``, and then nothing is kept), so an optimizer step
between batches leaves the fakes kept.

Nothing is kept alive by it: the fakes are held by their real tensors' identity,
weakly (a fake does not refer to its real tensor), and at most ``FAKES_KEPT`` of them
per thread, the oldest dropped past it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
import torch._functorch.config
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "FAKES_KEPT", "begin_run", "changed_in_place", "end_run", "fake_mode", "fakes_of",
    "kept_fakes", "mixes_fakes", "watching_changes",
]

# Enough for the parameters and buffers of the models a program records (a fake takes
# about 1 KB, its real tensor's data none of it): 4 MB per thread at most.
FAKES_KEPT = 4096

_KEEPABLE = (torch.Tensor, torch.nn.Parameter)
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """What a fake of ``t`` is made of (its values are not)."""
    storage = t.untyped_storage()
    return (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            t.is_leaf, storage._cdata, storage.nbytes(), t.is_conj(), t.is_neg())


def _own_layout(fake: torch.Tensor) -> tuple[Any, ...]:
    """What of a kept fake a run could have changed in place."""
    return fake.shape, fake.stride(), fake.storage_offset(), fake.requires_grad, fake._version


class _KeptFakes(FakeTensorConverter):
    """torch's converter of real tensors to fakes, keeping the fakes of plain strided
    tensors across runs while they stand for them (see the module's docstring).

    torch's own memo (by tensor identity, while its fake lives) would hand out a fake
    that no longer stands for its tensor: it is dropped for a tensor converted anew,
    and for its base (a view's fake is made on a fake of its base, from that memo),
    and a storage's when its size changed (``resize_``)."""

    def __init__(self, *, copy_data: bool, export: bool) -> None:
        super().__init__(copy_data=copy_data, export=export)
        # torch.utils.weak is untyped: Any, not WeakIdKeyDictionary, for mypy.
        self.kept: Any = WeakIdKeyDictionary()
        self.keeps = not copy_data  # with copy_data a fake holds its values

    def from_real_tensor(self, fake_mode: FakeTensorMode, t: torch.Tensor,
                         make_constant: bool = False, shape_env: Any = None, *,
                         source: Any = None, symbolic_context: Any = None,
                         trace: bool = True) -> FakeTensor:
        plain = (self.keeps and not make_constant and shape_env is None and source is None
                 and symbolic_context is None and _keepable(t))
        if plain:
            layout = _layout(t)
            got = self.kept.get(t)
            if got is not None and got[0] == layout and _own_layout(got[1]) == got[2]:
                fake: FakeTensor = got[1]
                return fake
        self._forget(t)
        fake = super().from_real_tensor(
            fake_mode, t, make_constant, shape_env, source=source,
            symbolic_context=symbolic_context, trace=trace)
        if plain:
            self.kept[t] = (layout, fake, _own_layout(fake))
            if len(self.kept) > FAKES_KEPT:  # the oldest go (insertion order), down to
                # half the bound, which may have been lowered since they were kept
                for old in list(islice(self.kept.keys(), len(self.kept) - FAKES_KEPT // 2)):
                    self.kept.pop(old, None)
        return fake

    def _forget(self, t: torch.Tensor) -> None:
        describer: Any = self.meta_converter.describer  # its dicts are untyped
        describer.lookup_tensor.pop(t, None)
        if t._is_view() and t._base is not None:
            describer.lookup_tensor.pop(t._base, None)
        if not _keepable(t):
            return
        storage = t.untyped_storage()
        sid = describer.lookup_storage.get(storage)
        meta = None if sid is None else self.meta_converter.storage_memo.get(sid)
        if meta is not None and meta.nbytes() != storage.nbytes():
            describer.lookup_storage.pop(storage, None)

    def drop_dead_constants(self) -> None:
        """Drop the entries of constants no longer alive (torch never does): a mode kept
        across runs gathered one per ``torch.tensor(...)`` a run made."""
        mapping = self.constant_storage_mapping
        for storage, refs in list(mapping.items()):
            if all(ref() is None for ref in refs):
                del mapping[storage]


def _keepable(t: torch.Tensor) -> bool:
    return (type(t) in _KEEPABLE and t.layout is torch.strided and not t.is_quantized
            and not _is_wrapped(t))


class _Local(threading.local):
    mode: FakeTensorMode | None = None
    config: tuple[bool, bool] | None = None


_local = _Local()


def fake_mode() -> FakeTensorMode:
    """This thread's fake mode for batchgraph's runs (real inputs allowed), made anew
    where torch's settings for fake modes changed since it was made.

    Example:
        >>> fake_mode() is fake_mode()
        True
    """
    import torch._dynamo.config  # what the mode reads when made

    config = (torch._functorch.config.fake_tensor_propagate_real_tensors,
              torch._dynamo.config.fake_tensor_cache_enabled)
    mode = _local.mode
    if mode is None or _local.config != config:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        mode.fake_tensor_converter = _KeptFakes(copy_data=mode.propagate_real_tensors,
                                                export=False)
        _local.mode, _local.config = mode, config
    return mode


def begin_run(mode: FakeTensorMode) -> None:
    """Before a run (not a nested one) in ``mode``: its count of nested tensors'
    offsets starts where eager code's is, as a mode made for the run would (torch asks
    a mode used again to be reset).

    Example:
        >>> begin_run(fake_mode())
    """
    import torch.nested._internal.nested_tensor as nested

    mode.nt_tensor_id_initial_count = mode.nt_tensor_id_counter = nested._tensor_id_counter


def end_run(mode: FakeTensorMode) -> None:
    """After a run (not a nested one) in ``mode``: what torch noted of the constants it
    made, now dead, dropped (``_KeptFakes.drop_dead_constants``).

    Example:
        >>> end_run(fake_mode())
    """
    converter = mode.fake_tensor_converter
    if isinstance(converter, _KeptFakes):
        converter.drop_dead_constants()


def kept_fakes() -> int:
    """How many fakes of real tensors this thread's mode keeps.

    Example:
        >>> kept_fakes() <= FAKES_KEPT
        True
    """
    mode = _local.mode
    if mode is None:
        return 0
    converter = mode.fake_tensor_converter
    return len(converter.kept) if isinstance(converter, _KeptFakes) else 0


def changed_in_place(t: torch.Tensor) -> None:
    """Note that a run on fake tensors skipped an in-place change of the real tensor
    ``t`` (``inference._FakeRunGuard``: ``self.total += x`` leaves it as it was), where
    a ``watching_changes`` block of this thread is open.

    Example:
        >>> with watching_changes() as changed:
        ...     changed_in_place(total := torch.zeros(2))
        >>> changed == [total]
        True
    """
    changed: list[torch.Tensor] | None = getattr(_local, "changed", None)
    if changed is not None:
        changed.append(t)


@contextlib.contextmanager
def watching_changes() -> Iterator[list[torch.Tensor]]:
    """A block noting the real tensors whose in-place changes this thread's runs on
    fake tensors skip (``changed_in_place``), in order; nested blocks share the list
    (the caller reads from its length on entry), dropped when the outermost ends."""
    outermost = getattr(_local, "changed", None) is None
    if outermost:
        _local.changed = []
    try:
        yield _local.changed
    finally:
        if outermost:
            _local.changed = None


def mixes_fakes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call's arguments (and the lists and tuples among them) hold both fakes
    (or functorch's wrappers of them, under vmap) and plain real tensors.

    Example:
        >>> with fake_mode():
        ...     x = torch.empty(2)
        >>> mixes_fakes((x, [torch.ones(2)]), {}), mixes_fakes((x,), {})
        (True, False)
    """
    fakes = reals = False
    for a in (*args, *kwargs.values()):
        for t in a if type(a) in (list, tuple) else (a,):
            if isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and _is_wrapped(t)):
                fakes = True
            elif type(t) in _KEEPABLE:
                reals = True
    return fakes and reals


def fakes_of(mode: FakeTensorMode, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with the plain real tensors in them (and in lists and
    tuples among them) replaced by their fakes in ``mode``, as its dispatch would
    convert them, only sooner: an operation's dispatch with real operands skips the
    cache. Only for a call that has fake operands: on real ones alone a method may not
    dispatch (``w.data_ptr()``, ``w.grad``) and must see the real tensor.

    Example:
        >>> mode = fake_mode()
        >>> with mode:
        ...     (w,), _ = fakes_of(mode, (torch.ones(2),), {})
        >>> type(w).__name__, tuple(w.shape)
        ('FakeTensor', (2,))
    """
    convert = mode.fake_tensor_converter.from_real_tensor

    def fake(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return convert(mode, a) if _keepable(a) else a
        if type(a) in (list, tuple) and any(type(x) in _KEEPABLE for x in a):
            return type(a)(convert(mode, x) if _keepable(x) else x for x in a)
        return a

    return tuple(fake(a) for a in args), {k: fake(v) for k, v in kwargs.items()}
