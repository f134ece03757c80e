"""Choosing a ``BatchKey`` class for a call: the built-in registry and its fallbacks.

Order of precedence: a module's own ``batch_key`` attribute, then the policy's
``rules`` (by module instance, then by module type; or by function), then the built-in fast rules below, then
``VmapKey``. Separately, ``batchgraph.vmap_probe.probe_vmap`` checks once per signature
that vmap can run the call at all; if not, the call runs one at a time (``UnbatchedKey``)
and stats say so.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from batchgraph.embedding import EmbeddingFreqKey, PaddedEmbeddingKey
from batchgraph.hooks import BatchedHooksWarning, warn_about_hooks, warn_about_read_hooks
from batchgraph.keys import (
    DIM_FUNCTIONS,
    ELEMENTWISE_FUNCTIONS,
    RANDOM_FUNCTIONS,
    REDUCTION_FUNCTIONS,
    BatchKey,
    DimArgKey,
    ElementwiseKey,
    IndexKey,
    ReductionKey,
    StackKey,
    UnbatchedKey,
    VmapKey,
)
from batchgraph.sequence import packed_sequence_rule
from batchgraph.specs import (
    CallSignature,
    InputSlot,
    tuple_parts,
)
from batchgraph.tie_reductions import EVEN_REDUCTIONS, EvenReductionKey

__all__ = [
    "BatchedHooksWarning", "KeyFactory", "RandomDraws", "choose_key", "may_be_random", "rule_table",
]

KeyFactory = Callable[..., BatchKey]

# Modules whose forward treats dim 0 as a batch dimension for any input rank.
_STACK_ANY_RANK: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.Identity, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.GELU,
    nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus, nn.Hardtanh, nn.Mish, nn.LayerNorm,
    nn.Dropout, nn.AlphaDropout, nn.LogSigmoid, nn.Softsign, nn.Tanhshrink, nn.ReLU6,
)
# Modules that accept an unbatched input of exactly this rank and add a batch dim.
_STACK_AT_RANK: dict[type[nn.Module], int] = {
    nn.LSTMCell: 1, nn.GRUCell: 1, nn.RNNCell: 1,
    nn.Conv1d: 2, nn.Conv2d: 3, nn.Conv3d: 4,
    nn.MaxPool1d: 2, nn.MaxPool2d: 3, nn.AvgPool1d: 2, nn.AvgPool2d: 3,
}
_RANDOM_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
)


def _is_random_module(module: nn.Module) -> bool:
    return any(isinstance(m, _RANDOM_MODULES) and m.training for m in module.modules())


def may_be_random(fn: Any) -> bool:
    """Whether calls of ``fn`` may ever give different results for the same inputs: a
    random function, or a module holding a random layer in *either* mode (a layer in
    eval mode now may be put in training mode later, while a signature cached now is
    still in use). Such calls are never merged.

    Example:
        >>> may_be_random(nn.Sequential(nn.Linear(2, 2), nn.Dropout()).eval())
        True
        >>> may_be_random(torch.tanh)
        False
    """
    if isinstance(fn, nn.Module):
        return any(isinstance(m, _RANDOM_MODULES) for m in fn.modules())
    try:
        return fn in RANDOM_FUNCTIONS
    except TypeError:  # unhashable callable
        return False


class RandomDraws(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes whether the code run under it draws random numbers (an op that PyTorch
    tags ``nondeterministic_seeded``: ``randn_like``, dropout, ``bernoulli``...).

    A recorded call's shape inference runs under it once per signature, so that a
    function with randomness inside (``lambda x: x + torch.randn_like(x)``) is never
    merged with an identical call: each example draws its own values, as in eager code.

    Example:
        >>> with RandomDraws() as draws:
        ...     _ = torch.nn.functional.dropout(torch.ones(3), 0.5, training=True)
        >>> draws.seen
        True
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))

    def calls(self) -> TorchFunctionMode:
        """A mode that also notes calls of functions that draw only with some
        arguments (dropout with ``training=True``), where this run drew nothing.

        A signature is cached for later calls, and what decides such a draw (a
        module's mode, a flag the function reads) may change while it is in use:
        a function calling dropout in eval mode now would otherwise be merged with
        identical calls once the layer trains, all examples sharing one mask.

        Example:
            >>> draws = RandomDraws()
            >>> with draws.calls():
            ...     _ = torch.nn.functional.dropout(torch.ones(3), 0.5, training=False)
            >>> draws.seen
            True
        """
        return _MayDraw(self)


# Functions that draw random numbers for some arguments only (and their modules
# call them whatever their mode).
MAY_DRAW_FUNCTIONS: frozenset[Any] = RANDOM_FUNCTIONS | frozenset({
    nn.functional.dropout1d, nn.functional.dropout2d, nn.functional.dropout3d,
    nn.functional.feature_alpha_dropout, nn.functional.rrelu, torch.rrelu,
    torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
})


class _MayDraw(TorchFunctionMode):
    def __init__(self, draws: RandomDraws) -> None:
        super().__init__()
        self.draws = draws

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        try:
            if func in MAY_DRAW_FUNCTIONS:
                self.draws.seen = True
        except TypeError:  # an unhashable callable
            pass
        return func(*args, **(kwargs or {}))


def _module_key(module: nn.Module, call: CallSignature) -> KeyFactory:
    kind = type(module)
    if kind is nn.Embedding and module.scale_grad_by_freq:
        return EmbeddingFreqKey  # stacked, the lookup would count rows over the batch
    if kind in _STACK_ANY_RANK:
        return StackKey
    if kind in (nn.LSTM, nn.GRU, nn.RNN):
        return packed_sequence_rule
    rank = _STACK_AT_RANK.get(kind)
    if rank is not None and call.input_specs and call.input_specs[0] is not None:
        # The first input decides whether the module sees its unbatched form.
        if len(call.input_specs[0].shape) == rank:
            return StackKey
    if isinstance(module, (nn.Softmax, nn.LogSoftmax)) and isinstance(module.dim, int):
        if module.dim < 0 and _no_scalars(call):  # on a 0-d input -1 is not the last dim
            return _SoftmaxModuleKey
    return VmapKey


class _SoftmaxModuleKey(StackKey):
    """``nn.Softmax``/``nn.LogSoftmax`` chosen with a dim from the end: stacked, it
    still addresses each example's dim. Its ``dim`` is read again when the batch runs:
    a call site keeps this key for its signature, and a module whose ``dim`` was set
    since (to one from the front, or None) would otherwise take its softmax across the
    examples, silently. Such a dim is moved past the batch dimension instead."""

    def run(self, fn: Callable[..., Any], inputs: Any, size: int) -> Any:
        dim = getattr(fn, "dim", -1)
        if isinstance(dim, int) and dim < 0:
            return super().run(fn, inputs, size)
        x = inputs[0]
        if dim is None:  # the legacy implicit dim, as eager code picks it per example
            dim = 0 if x.dim() - 1 in (0, 1, 3) else 1
        op = torch.log_softmax if isinstance(fn, nn.LogSoftmax) else torch.softmax
        return op(x, int(dim) + 1)


def _function_key(fn: Any, call: CallSignature) -> KeyFactory:
    if fn is nn.functional.embedding and call.static_arg(2, "padding_idx", None) is not None:
        return PaddedEmbeddingKey
    if fn in ELEMENTWISE_FUNCTIONS:
        return ElementwiseKey
    if fn in EVEN_REDUCTIONS and call.args == (InputSlot(0),) and not call.kwargs:
        return EvenReductionKey
    if fn in REDUCTION_FUNCTIONS and call.args[:1] == (InputSlot(0),):
        if len(call.args) == 1 and not call.kwargs and fn not in _NEEDS_DIM:
            return ReductionKey
        if isinstance(call.static_arg(1, "dim", None), int) and _no_scalars(call):
            return lambda f, c, **kw: DimArgKey(f, c, dim_position=1, **kw)
    position = DIM_FUNCTIONS.get(fn)
    if (position is not None and isinstance(call.static_arg(position, "dim", 0), int)
            and (fn in _STACKS or _no_scalars(call)) and not _skips_empty(fn, call)):
        return lambda f, c, **kw: DimArgKey(f, c, dim_position=position, **kw)
    if fn is operator.getitem and _static_index(call):
        return IndexKey
    return VmapKey


# Reductions that have no whole-tensor form (a dim is required).
_NEEDS_DIM = frozenset({torch.logsumexp, torch.Tensor.logsumexp})
# Their dim counts the dimensions of a tensor that has one at least (the *output* of
# ``stack``, the base of ``select_scatter``, whose ``src`` may be 0-d): shifting it for
# the batch dimension stays right beside 0-d inputs.
_STACKS = frozenset({torch.stack, torch.select_scatter, torch.Tensor.select_scatter})


def _skips_empty(fn: Any, call: CallSignature) -> bool:
    """Whether a ``cat`` skips an input, as torch does for a 1-d empty one beside
    inputs of another rank (legacy, and the usual start of rows gathered in a loop:
    ``acc = torch.cat([acc, row[None]])`` from ``acc = torch.empty(0)``). Batched,
    that input is 2-d and not skipped ("Tensors must have same number of
    dimensions"); vmap skips it as eager code does."""
    if fn not in _CATS:
        return False
    specs = [s for s in call.input_specs if s is not None]
    return any(tuple(s.shape) == (0,) for s in specs) and any(len(s.shape) != 1 for s in specs)


_CATS = frozenset({torch.cat, torch.concat, torch.concatenate})


def _no_scalars(call: CallSignature) -> bool:
    """Whether no per-example input is 0-d. A 0-d tensor takes dim 0 or -1 as if it
    had one dimension (``x.sum(-1)``, ``softmax(x, 0)`` leave it as it is); stacked,
    -1 would address the batch dimension (a softmax across examples, silently) and
    a shifted 0 would be out of range. Such calls go to ``VmapKey``, which keeps
    the per-example meaning.
    """
    return all(s is None or s.shape for s in call.input_specs)


def _static_index(call: CallSignature) -> bool:
    if len(call.args) != 2 or type(call.args[0]) is not InputSlot:
        return False
    # Exact types: an InputSlot (a tensor index) is a NamedTuple, so an isinstance
    # test would take its slot number for an int index.
    return all(
        p is None or p is Ellipsis or type(p) in (int, bool, slice)
        for p in tuple_parts(call.args[1])
    )


def choose_key(
    fn: Any,
    call: CallSignature,
    rules: Mapping[Any, KeyFactory],
) -> BatchKey:
    """Build the key for one call signature (done once per signature, then cached).

    Args:
        fn: the callable.
        call: its signature.
        rules: the policy's registry, by module instance, module type or function.

    Returns:
        A ``BatchKey`` instance.
    """
    if any(s is None for s in call.input_specs):
        # An input whose structure is unknown until it runs cannot be stacked.
        return UnbatchedKey(fn, call)
    if isinstance(fn, nn.Module):
        deterministic = not _is_random_module(fn)
        # Read from the class unless the instance has its own: a factory function
        # given as a class attribute would otherwise come back bound to the module
        # (and fail with "takes 2 positional arguments but 3 were given").
        factory: KeyFactory | None = fn.__dict__.get("batch_key")
        if factory is None:
            factory = getattr(type(fn), "batch_key", None)
        if factory is not None and not callable(factory):
            # Else "'str' object is not callable" from here, naming neither the module
            # nor the attribute.
            raise TypeError(
                f"{type(fn).__name__}.batch_key is {factory!r}, not a BatchKey class: set "
                "it to the class itself (batch_key = bg.StackKey, or a subclass of "
                "bg.BatchKey), not an instance or a name"
            )
        if factory is None and rules:
            factory = _module_rule(fn, rules)
        if factory is None:
            factory = _module_key(fn, call)
    else:
        deterministic = fn not in RANDOM_FUNCTIONS
        factory = rules.get(fn)
        if factory is None:
            factory = _function_key(fn, call)
    key = factory(fn, call, deterministic=deterministic)
    if key.batchable:
        if isinstance(fn, nn.Module):
            warn_about_hooks(fn, key)
        else:
            warn_about_read_hooks(fn, key)
    return key


def _module_rule(module: nn.Module, rules: Mapping[Any, KeyFactory]) -> KeyFactory | None:
    """The rule for this module itself, else for its class."""
    try:
        factory = rules.get(module)
    except TypeError:  # a module class that made its instances unhashable
        factory = None
    return factory if factory is not None else rules.get(type(module))


def rule_table(rules: Mapping[Any, KeyFactory] | None) -> dict[Any, KeyFactory]:
    """``rules`` as ``choose_key`` reads them: a call site (what ``batched_func``
    returns, or a submodule's stand-in while a policy records) stands for its
    callable, which is what calls are looked up by; as a key of its own it would
    never match, and the rule would be ignored without a word.

    Raises:
        TypeError: for ``rules`` that is not a mapping, a key that is not callable (a
            name such as ``"Linear"``, which no call is looked up by) or a value that
            is not (a ``bg.StackKey`` instance, a string).

    Example:
        >>> import batchgraph as bg
        >>> lin = nn.Linear(2, 2)
        >>> rule_table({bg.batched_func(lin): bg.UnbatchedKey}) == {lin: bg.UnbatchedKey}
        True
    """
    from batchgraph.recording import CallSite  # it imports this module

    if rules is None:
        return {}
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"rules must map callables to BatchKey classes, got {type(rules).__name__}: "
            "write rules={MyModule: MyKey} (a module class, one module, or a function)"
        )
    for k, v in rules.items():
        # A key no call is looked up by (a class's name as a string, say) would be
        # ignored without a word; a value that is no factory would fail at the first
        # call recorded, far from here.
        if not callable(k):
            raise TypeError(
                f"rules key {k!r} is a {type(k).__name__}, which no call is looked up by: "
                "key a rule by the module class (nn.Linear), one module instance, or the "
                "function itself, not by a name"
            )
        if not callable(v):
            raise TypeError(
                f"rules[{k!r}] is {v!r}, not a BatchKey class: give the class itself "
                "(bg.StackKey, bg.UnbatchedKey, a subclass of bg.BatchKey), not an "
                "instance or a name"
            )
    return {(k._bg_fn if isinstance(k, CallSite) else k): v for k, v in rules.items()}
