"""Running stage forwards for a check on real tensors, leaving no trace of it.

The kept-inputs check (:mod:`batchgraph.pipeline.kept_inputs`) runs the stages on meta
tensors, where nothing is computed. A forward that reads a value in Python (``.item()``,
``.tolist()``, ``if x.sum() > 0``) or makes a shape from values (``x[x > 0]``,
``torch.nonzero``) cannot run there; the check then runs the stages on a real
microbatch instead. What those runs would change is undone here:

* :class:`WriteGuard`: a tensor of the modules' state (a parameter, a buffer, a plain
  tensor attribute, in a container too) that an operation writes in place
  (``self.total += x.sum(0)``, ``out=``, a view of it) is copied just before the first
  write and copied back by :meth:`WriteGuard.undo`: no copy of the state up front;
* :class:`Generators`: each run draws the same random numbers (a draw read in Python
  then differs in no run), and the generators are as they were afterwards, so the step
  draws what it would have without the check: torch's, and Python's ``random`` and
  NumPy's global one (a LayerDrop's ``random.random() < p``), which the runs on meta
  tensors draw from too.

The modules' Python attributes are put back by the check itself
(:class:`batchgraph.python_state.SavedAttributes`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from batchgraph.python_state import DEPTH, instances_in, tensors_in

__all__ = ["Generators", "WriteGuard", "unmarked_writes"]

_aten = torch.ops.aten
# Ops that write arguments their schemas do not mark as written (Tensor(a!)): the batch
# norms update their running statistics in place in training (BatchNorm in train()).
_BATCH_NORMS = frozenset(
    op for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if (op := getattr(getattr(_aten, name, None), "default", None)) is not None)


def unmarked_writes(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors ``func`` writes in place that its schema does not mark as written
    (for :meth:`WriteGuard.before_write`): a batch norm's running statistics where it
    trains.

    Example:
        >>> mean, var = torch.zeros(2), torch.ones(2)
        >>> args = (torch.randn(3, 2), None, None, mean, var, True, 0.1, 1e-5)
        >>> [t is mean or t is var for t in unmarked_writes(_aten.native_batch_norm.default, args, {})]
        [True, True]
        >>> unmarked_writes(_aten.native_batch_norm.default, (*args[:5], False, 0.1, 1e-5), {})
        []
    """
    if func not in _BATCH_NORMS:
        return []
    names = [a.name for a in func._schema.arguments]
    given = {**dict(zip(names, args)), **kwargs}
    if not given.get("training"):
        return []
    return [t for name in ("running_mean", "running_var")
            if isinstance(t := given.get(name), Tensor)]


def _storage(t: Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse or nested: no plain storage
        return None


class WriteGuard:
    """Copies of the tensors of ``modules``' state taken just before a write (see the
    module docstring); :meth:`undo` writes them back.

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> guard, before = WriteGuard([lin]), lin.bias.detach().clone()
        >>> with torch.no_grad():
        ...     guard.before_write([lin.bias])
        ...     _ = lin.bias.add_(1)
        >>> guard.undo()
        >>> torch.equal(lin.bias, before)
        True
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._held: dict[int, list[Tensor]] = {}  # storage -> the state's tensors on it
        for root in modules:
            for m in root.modules():
                found = [*m._parameters.values(), *m._buffers.values()]
                found += [t for v in vars(m).values() for t in tensors_in(v, DEPTH)]
                for t in found:
                    if isinstance(t, Tensor) and (key := _storage(t)) is not None:
                        held = self._held.setdefault(key, [])
                        if not any(t is h for h in held):
                            held.append(t)
        self._copies: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def before_write(self, written: Sequence[Tensor]) -> None:
        """Copy the state on the storage of ``written``, unless copied already."""
        for t in written:
            key = _storage(t)
            if key is not None and key in self._held and key not in self._copies:
                with torch.no_grad():
                    self._copies[key] = [(h, h.detach().clone()) for h in self._held[key]]

    def undo(self) -> None:
        """Write the copies back: the state is as it was before the first write."""
        with torch.no_grad():
            for copies in self._copies.values():
                for t, copy in copies:
                    t.detach().copy_(copy)
        self._copies.clear()


# nn.Module's own attributes (parameters, buffers, submodules, hooks): no generator is
# kept there, and walking them costs (27 ms a check for 48 transformer layers).
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


class Generators:
    """The CPU generator's state, those of ``devices``' CUDA generators, of Python's
    ``random`` and NumPy's global generator, and of the ``torch.Generator`` objects
    ``modules`` keep (``self.gen``, drawn from with ``generator=``): :meth:`reset` sets
    them back to it (each run of a check draws the same numbers, and the step after the
    check draws what it would have).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> layer.gen = torch.Generator().manual_seed(0)
        >>> gens = Generators([torch.device("cpu")], [layer])
        >>> a, b, c = torch.rand(1), random.random(), torch.rand(1, generator=layer.gen)
        >>> gens.reset()
        >>> torch.equal(torch.rand(1), a), random.random() == b
        (True, True)
        >>> torch.equal(torch.rand(1, generator=layer.gen), c)
        True
        >>> gens.reset()
    """

    def __init__(self, devices: Iterable[torch.device], modules: Iterable[nn.Module] = ()) -> None:
        self.cpu = torch.get_rng_state()
        indices = {d.index if d.index is not None else torch.cuda.current_device()
                   for d in devices if d.type == "cuda"}
        self.cuda = {i: torch.cuda.get_rng_state(i) for i in sorted(indices)}
        # A forward may draw from these in Python (a LayerDrop): the check's runs would
        # take other branches run to run (refused as computing otherwise at the second
        # call) and shift the draws of the step and of the user's code after it.
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")  # not imported: nothing drew from it
        self.numpy: Any = None if numpy is None else numpy.random.get_state()
        # A module's own generator is state of it, which the runs on real tensors move.
        own: dict[int, torch.Generator] = {}
        for root in modules:
            for m in root.modules():
                for name, value in vars(m).items():
                    if name in _MODULE_INTERNALS:  # (each submodule is walked itself)
                        continue
                    for gen in instances_in(value, torch.Generator, DEPTH):
                        own[id(gen)] = gen
        self.own = [(gen, gen.get_state()) for gen in own.values()]

    def reset(self) -> None:
        torch.set_rng_state(self.cpu)
        for i, state in self.cuda.items():
            torch.cuda.set_rng_state(state, i)
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        for gen, state in self.own:
            gen.set_state(state)
