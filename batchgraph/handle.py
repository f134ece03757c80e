"""``ResultHandle``: the stand-in for a value that has been recorded but not computed.

A handle behaves like the per-example tensor it stands for, as far as recording
goes. A call with several outputs returns a tuple of handles, as the eager call
returns a tuple of tensors, so ``h, c = cell(x)`` is a plain tuple unpacking. A
handle answers ``shape``, ``dtype`` and ``device`` from its spec, and its operators,
tensor methods and any ``torch`` function applied to it are recorded with
per-example semantics. Reading its value needs ``compute`` first; branching on it
(``if h > 0``) needs a coroutine (see ``bg.run_all``).
"""

from __future__ import annotations

import copy
import dis
import operator
import sys
import types
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from batchgraph import handed_changes, handle_operators
from batchgraph.aliasing import unmerge_viewed
from batchgraph.attribute_reads import RESULT_FIELDS, TENSOR_PROPERTIES, property_call, read_field
from batchgraph.errors import ConstantChangedError, NotComputedError, PolicyMismatchError
from batchgraph.handed_views import note_handed
from batchgraph.handle_metadata import TensorMetadata
from batchgraph.handle_operators import TensorOperators
from batchgraph.spec_answers import answer_from_specs
from batchgraph.specs import OutSpec, TensorSpec

if TYPE_CHECKING:
    from batchgraph.graph import Graph

__all__ = ["ResultHandle", "snapshot", "unchanged"]


def unchanged(out: tuple[Any, Any]) -> bool:
    """Whether a handed-out value (``handle._out``) is as it was handed out, so that a
    call recorded on its handle may read the stored row instead (see ``snapshot``)."""
    version = out[1]
    if type(version) is int:
        return bool(out[0]._version == version)
    # None: an inference tensor, which keeps no version (counts as changed); else a
    # result of unknown structure, with the versions of its tensors.
    return version is not None and _versions(out[0]) == version


def snapshot(handle: ResultHandle) -> torch.Tensor:
    """What a call recorded on ``handle`` takes when its handed-out value was changed in
    place: a copy of the value as it is now. The eager call would have read it now; a
    copy, because a later change must not reach the call either.

    Raises:
        ConstantChangedError: for a result of unknown structure that is not one tensor
            (a tuple from ``torch.unique``, say): it cannot be passed as a copy.
    """
    assert handle._out is not None
    value = handle._out[0]
    if not isinstance(value, torch.Tensor):
        raise ConstantChangedError(
            f"the value of {handle!r}, a {type(value).__name__} of tensors known only "
            "once computed, was changed in place after it was read, and a call was "
            "recorded on the handle: the call would read the computed result, not your "
            "change. Pass the changed value itself to the call instead of the handle."
        )
    return value.clone()


def _versions(value: Any) -> tuple[int, ...]:
    """The versions of the tensors in a structure (inference tensors keep none: they
    count as unchanged, so a call recorded on a structure of them reads the result as
    computed)."""
    leaves = tree_leaves(value)
    return tuple([t._version if not t.is_inference() else -1 for t in leaves
                  if isinstance(t, torch.Tensor)])


class ResultHandle(TensorOperators, TensorMetadata):
    """A recorded value: output ``leaf`` of ``node`` (the whole result if its structure
    was unknown before running).

    Example:
        >>> import batchgraph as bg, torch
        >>> with bg.BatchingPolicy():
        ...     h = bg.batched_func(torch.tanh)(torch.zeros(3))
        ...     g = h * 2 + 1
        >>> bg.compute(g)
        tensor([1., 1., 1.])
    """

    # _gen: the graph's generation when the handle was made (see batchgraph.releasing).
    # _out: the value handed out for it, with that value's version then (see ``value``).
    __slots__ = ("_gen", "_graph", "_out", "leaf", "node", "spec")

    # As a tensor's: NumPy scalars and arrays leave `np.float32(2) * h` to the
    # handle's reflected operator (without it NumPy tried to convert the handle).
    __array_priority__ = 1000

    def __init__(self, graph: Graph, node: int, leaf: int, spec: OutSpec) -> None:
        # CallSite.__call__ sets these fields itself (faster): keep the two in step.
        self._graph = graph
        self._gen = graph.generation
        self.node = node
        self.leaf = leaf
        self.spec = spec
        self._out: tuple[Any, Any] | None = None

    # -- structure -----------------------------------------------------------------
    # A call with several outputs returns a tuple of handles (see ``handles_for``), so
    # a handle stands for one tensor, or for a result whose structure is unknown.
    def __iter__(self) -> Iterator[Any]:
        spec = self.spec
        if isinstance(spec, TensorSpec):
            if not spec.shape:
                raise TypeError("iteration over a 0-d tensor handle")
            return (self[i] for i in range(spec.shape[0]))
        raise TypeError(
            f"cannot unpack {self!r}: the structure of its result is only known once it runs "
            "(its output could not be inferred before running). Compute it first."
        )

    def __len__(self) -> int:
        spec = self.spec
        if isinstance(spec, TensorSpec):
            if not spec.shape:
                # As for a 0-d tensor. torch.tensor([h, g]), torch.tensor(h) and
                # torch.as_tensor(h) end here too (not dispatched to handles: they
                # read their data as nested sequences, down to 0-d items).
                raise TypeError(
                    "len() of a 0-d tensor handle. torch.tensor(...) and "
                    "torch.as_tensor(...) read their data as (nested) sequences of "
                    "numbers, which a handle's values are not until computed: for a "
                    "handle h, use h itself (h.to(dtype), h.clone()); to make a tensor "
                    "of handles, use torch.stack([...])"
                )
            if _in_subscript(sys._getframe(1)):
                # ``t[h]`` on a tensor: torch's C indexing asks for our length before
                # it dispatches to __torch_function__, to guess (as NumPy once did)
                # whether a short sequence is a tuple of indices; it then reads every
                # item (recording a call each) and warns "Using a non-tuple sequence
                # for multidimensional indexing is deprecated". Failing here makes it
                # take the handle as one index, as it takes a tensor, silently.
                raise TypeError(f"{self!r} is one index, not a sequence of indices")
            return spec.shape[0]
        raise TypeError(f"len() of {self!r}: its structure is unknown until it runs")

    def __getitem__(self, index: Any) -> Any:
        return _record(operator.getitem, (self, index), {})

    # -- values ------------------------------------------------------------------------
    @property
    def computed(self) -> bool:
        """Whether ``compute`` has run this handle's node."""
        return self._graph.computed(self.node)

    @property
    def value(self) -> Any:
        """The computed per-example tensor (for an unknown structure: the whole result).

        The value is the caller's own tensor, as an eager call's result would be: every
        read of the handle gives the same tensor, and changing it in place reaches the
        calls recorded on the handle afterwards, but neither those recorded before the
        change nor any other example.

        Raises:
            NotComputedError: if the handle has not been computed yet.
        """
        out = self._out
        if out is not None:
            return out[0]
        if not self.computed:
            raise NotComputedError(
                f"{self!r} has not been computed yet; call bg.compute(...) on it (or on a "
                "structure holding it) before reading its value"
            )
        if self.spec is None:  # the whole result, whatever its structure turned out to be
            return self.handed(self._graph.leaf_value(self.node, -1))
        return self.handed(self._graph.leaf_value(self.node, self.leaf))

    def handed(self, value: Any) -> Any:
        """Note ``value``, a tensor no store shares, as this handle's value: later reads
        give it again, and calls recorded on the handle after it changed in place read
        it as it is then (``unchanged``)."""
        spec = self.spec
        graph = self._graph
        graph.handed_out.add(self.node)
        inputs = graph.node_inputs
        # (A graph rebuilt for binding may hold values of nodes it does not record.)
        # (Known no view, as most calls are: no call made; see aliasing.known_view.)
        if (self.node < len(inputs) and inputs[self.node] and graph.dedupe and getattr(
                graph.keys[graph.node_key[self.node]], "_known_view", True)):
            unmerge_viewed(graph, self.node)
        if isinstance(value, torch.Tensor):
            if type(spec) is TensorSpec or spec is None:
                # Inference tensors keep no version: they count as changed (None).
                self._out = (value, None if value.is_inference() else value._version)
                handed_changes.note(self._graph, self.node, self.leaf, value, self._out[1])
                if self._graph.first_uncomputed < len(self._graph.node_key):  # calls pending
                    note_handed(self._graph, self.node, self.leaf, value, self._out[1])
        elif spec is None:  # a structure known only once computed
            self._out = (value, _versions(value))
        return value

    # -- coroutines (see batchgraph.awaiting) ---------------------------------------------
    def __await__(self) -> Generator[Any, Any, Any]:
        """``await h`` is ``await bg.value(h)``: suspend the example until ``h`` is computed."""
        from batchgraph.awaiting import value  # import here: awaiting imports this module

        return value(self).__await__()

    def __bool__(self) -> bool:
        raise _not_known(f"the truth value of {self!r}")

    # Python numbers and host copies of a value are not known while recording either:
    # these fail with the same advice, not with "int() argument must be ... not
    # 'ResultHandle'" or a shape error from the fake run of ``.item()``.
    def __int__(self) -> int:
        raise _not_known(f"int({self!r})")

    def __float__(self) -> float:
        raise _not_known(f"float({self!r})")

    def __index__(self) -> int:
        raise _not_known(f"{self!r} as an index")

    def __complex__(self) -> complex:
        raise _not_known(f"complex({self!r})")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _not_known(f"a NumPy array of {self!r}")

    def __format__(self, format_spec: str) -> str:
        if not format_spec:  # f"{h}": the handle's description, as print(h) gives
            return repr(self)
        raise _not_known(f"{self!r} formatted with {format_spec!r}")

    def item(self) -> Any:
        raise _not_known(f"{self!r}.item()")

    def tolist(self) -> Any:
        raise _not_known(f"{self!r}.tolist()")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise _not_known(f"{self!r}.numpy()")

    # Autograd runs on computed values: these would otherwise be recorded as calls
    # and fail in shape inference with an autograd error about fake tensors.
    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise _on_values_only(self, "backward()")

    def register_hook(self, hook: Callable[..., Any]) -> Any:
        raise _on_values_only(self, "register_hook()")

    def retain_grad(self) -> None:
        raise _on_values_only(self, "retain_grad()")

    # A shallow copy of a tensor shares its memory, as the handle itself does (an
    # in-place call on it, h += g, rebinds the handle). Pickling would need the graph.
    def __copy__(self) -> ResultHandle:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Eagerly a new tensor of equal value, which an in-place change of either does
        not reach (a beam's hypotheses copied, then one changed): a recorded clone (a
        value of its own, sharing no view: ``s = h[0]; g = copy.deepcopy(h); g += 1;
        s * 2`` reads ``h``), or, where the value is at hand (handed out, or the tensor
        given to ``batched_value``), a deep copy of it; a twin handle of the value where
        no call can be recorded (nor can a change)."""
        if self._out is not None:
            return copy.deepcopy(self._out[0], memo)
        if self._graph.open:
            try:
                return self.clone()
            except PolicyMismatchError:  # another policy records here: a twin, as below
                pass
        twin = object.__new__(ResultHandle)
        twin._graph, twin._gen, twin._out = self._graph, self._gen, None  # keeps its value
        twin.node, twin.leaf, twin.spec = self.node, self.leaf, self.spec
        return twin

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{self!r} cannot be pickled: it stands for a value of a graph that lives in "
            "this process. Pickle computed tensors (bg.compute), or record in worker "
            "processes with bg.GraphCollate, whose batches pickle."
        )

    def __repr__(self) -> str:
        spec = self.spec
        what = spec.describe() if isinstance(spec, TensorSpec) else "unknown structure"
        return f"<ResultHandle node={self.node} leaf={self.leaf} {what} of {self._graph.name}>"

    # -- recorded operations ---------------------------------------------------------
    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _PYTHON_VALUED:
            raise _not_known(f"{getattr(func, '__name__', func)}(...) of a handle")
        answer = answer_from_specs(func)  # torch.numel(h): known while recording
        if answer is not None:
            return answer(*args, **(kwargs or {}))
        if func in _DIFFERENTIATIONS:
            raise _not_differentiable(func)
        return _record(func, tuple(args), kwargs or {})

    def __getattr__(self, name: str) -> Any:
        if name in TENSOR_PROPERTIES:  # h.T and friends: recorded right away
            fn, args = property_call(name, self)
            return _record(fn, args, {})
        if name in RESULT_FIELDS and self.spec is None:
            return _record(read_field, (self, name), {})
        method = getattr(torch.Tensor, name, None)
        if method is None or name.startswith("_") or not callable(method):
            raise AttributeError(
                f"ResultHandle has no attribute {name!r}"
                + ("; it is only available on computed values (handle.value)" if method else "")
            )
        # Installed on the class, so later lookups of this name find a plain method
        # (a failed attribute lookup and a closure per call cost more than the record).
        recorded = _recorded_method(name, method)
        setattr(ResultHandle, name, recorded)
        return recorded.__get__(self)



# The opcodes of `x[i]`, `x[i] = v` and `del x[i]` (Python 3.14 makes the first a
# BINARY_OP, told apart by its argument).
_SUBSCRIPTS = frozenset(
    dis.opmap[name] for name in ("BINARY_SUBSCR", "STORE_SUBSCR", "DELETE_SUBSCR")
    if name in dis.opmap
)
_BINARY_OP = dis.opmap["BINARY_OP"]
_NB_SUBSCR = next((i for i, (name, _) in enumerate(getattr(dis, "_nb_ops", ()))
                   if name == "NB_SUBSCR"), None)


def _in_subscript(frame: types.FrameType) -> bool:
    """Whether ``frame``, the Python caller of a C function that called us, is running
    a subscript: ``len(h)`` runs a call there, ``t[h]`` a subscript."""
    code = frame.f_code.co_code
    at = frame.f_lasti
    op = code[at]
    return op in _SUBSCRIPTS or (op == _BINARY_OP and code[at + 1] == _NB_SUBSCR)


def _not_known(what: str) -> NotComputedError:
    return NotComputedError(
        f"{what} is not known while recording. Compute it first, or write the example "
        "as a coroutine and `await bg.value(h)` (see bg.run_all)."
    )


def _on_values_only(handle: ResultHandle, what: str) -> TypeError:
    return TypeError(
        f"{what} runs on computed values, and {handle!r} is a recorded one: compute "
        "it first (bg.compute(...), or read it in a coroutine with `await "
        "bg.value(h)`) and call it on the tensor"
    )


# Functions of tensors that answer a Python value (a bool): not known while recording,
# as `bool(h)` is not; recorded, they would fail at compute for not returning tensors.
_PYTHON_VALUED = frozenset({
    torch.equal, torch.allclose, torch.is_nonzero,
    torch.Tensor.equal, torch.Tensor.allclose, torch.Tensor.is_nonzero,
})


# Recorded as one call, these would get fakes (then batches) of their outputs and
# inputs, unconnected: the graph between them is built only when the batch runs.
_DIFFERENTIATIONS = frozenset({torch.autograd.grad, torch.autograd.backward})


def _not_differentiable(func: Callable[..., Any]) -> TypeError:
    name = f"torch.autograd.{getattr(func, '__name__', func)}"
    return TypeError(
        f"{name}(...) of handles cannot be recorded: the graph from the inputs to the "
        "outputs is built only when their batch runs. Differentiate inside one recorded "
        "function, bg.batched_func(f), where f computes the outputs from its inputs and "
        f"calls {name} itself (forces = -torch.autograd.grad(energy, pos, "
        "create_graph=True)[0]; it runs one example at a time), or call it on computed "
        "values."
    )


def _recorded_method(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """A handle method that records the tensor method ``method``."""

    def recorded(self: ResultHandle, *args: Any, **kwargs: Any) -> Any:
        return _record(method, (self, *args), kwargs)

    def not_known(self: ResultHandle, *args: Any, **kwargs: Any) -> Any:
        raise _not_known(f"{self!r}.{name}(...)")

    if method in _PYTHON_VALUED:
        recorded = not_known

    recorded.__name__ = recorded.__qualname__ = name
    return recorded


from batchgraph.sites import record_function as _record  # noqa: E402  (cycle by design)

handle_operators._record = _record
