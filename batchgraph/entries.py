"""What a call signature resolves to (``Entry``): its key and output spec, and what
the recording hot path (``batchgraph.recording``) checks before reusing them."""

from __future__ import annotations

from typing import Any, cast

from batchgraph.attributes import Attributes
from batchgraph.graph import RecordedGrad
from batchgraph.hooks import Hooks
from batchgraph.keys import BatchKey
from batchgraph.result_kinds import ResultKind
from batchgraph.rules import may_be_random
from batchgraph.specs import OutSpec, TensorSpec

__all__ = ["Entry"]


class Entry:
    """What a call signature resolves to; cached on its ``CallSite``.

    Example:
        >>> import batchgraph as bg, torch
        >>> site = bg.batched_func(torch.nn.Linear(2, 2))  # a site of its own
        >>> with bg.BatchingPolicy():
        ...     _ = site(torch.zeros(2))
        >>> [type(e).__name__ for e in site._bg_cache.values()]
        ['Entry']
    """

    __slots__ = (
        "attrs", "children", "dedupe", "hooks", "key", "kind", "layout", "memo", "modes", "on_copy",
        "rules_token", "sig", "single", "spec", "view",
    )

    def __init__(
        self, key: BatchKey, spec: OutSpec, rules_token: int, draws_random: bool,
        kind: ResultKind = None,
    ) -> None:
        self.key = key
        self.spec = spec
        # The eager result's sequence kinds where not plain tuples (a list, a
        # namedtuple, ``torch.return_types.max``, at any depth): handles come back so.
        self.kind = kind
        # A call with several outputs returns a tuple of handles, as the eager call
        # returns a tuple of tensors: ``h, c = cell(...)`` is then a plain tuple
        # unpacking. For a flat tuple these are (leaf, spec) per output; None for a
        # single tensor, an unknown structure, or nested tuples (built recursively).
        self.children: tuple[tuple[int, TensorSpec], ...] | None = None
        if kind is None and type(spec) is tuple and all(type(c) is TensorSpec for c in spec):
            self.children = tuple(enumerate(cast(tuple[TensorSpec, ...], spec)))
        # One tensor (or an unknown structure): the call returns one handle.
        self.single = type(spec) is not tuple
        # Random calls (dropout, or a function drawing random numbers inside) are
        # never merged with identical ones; nor are calls of a module with a random
        # layer in eval mode, which may be trained later.
        # A call keeping state of its own (in_order) counts once per call, as eagerly.
        self.dedupe = (key.deterministic and not draws_random and not key.in_order
                       and not may_be_random(key.fn))
        self.rules_token = rules_token
        # (graph stamp, key id in that graph, grad mode, module mode and hook count it
        # was recorded in): one tuple, so it is replaced atomically, and a stamp rather
        # than the graph, so the cache keeps no batch alive.
        self.memo: tuple[int, int, RecordedGrad, bool | None, int | None] = (
            -1, -1, True, None, None)
        # The dtype, device and shape of each tensor the callable reads besides its
        # arguments, and its buffers' shapes (Graph.signature_layout), when the spec was inferred: see CallSite.__call__.
        self.layout: tuple[Any, ...] = ()
        # The modes of the module and its submodules when resolved (Graph.modes_of),
        # and its cache key (None: not cached): see stale_entries.switch_modes.
        self.modes: tuple[bool, ...] | None = None
        # A module's hooks when resolved (hooks.hooks_of; None for a function).
        self.hooks: Hooks | None = None
        # The plain attributes of the modules the key's callable is or reads when
        # resolved (batchgraph.attributes), as Graph.key_id notes them.
        self.attrs: Attributes | None = None
        self.sig: Any = None
        # An in-place call on a handle, recorded on a copy (batchgraph.on_copy): the
        # input handle then stands for the result.
        self.on_copy = False
        # Whether the call makes a view of an input (aliasing.makes_view); worked out
        # the first time a handed-out value is its input (None until then).
        self.view: bool | None = None
