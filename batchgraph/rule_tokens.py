"""Signature-cache tokens: which resolved signatures a policy may reuse.

A call site caches each signature it resolves (its output spec and ``BatchKey``, found
by a run on fake tensors) with a token naming the rules and the default dtype it was
resolved under: the key chosen depends on the rules, the spec on the default dtype
(``int_h * 2.5`` is float64 under a float64 default). Policies with the same rules
share tokens, so a signature is resolved once, not once per policy.

The rules are compared by the identity of their entries (``{nn.Linear: bg.VmapKey}``
written anew per batch is the same table each time). Before, every policy with rules
had tokens of its own: a training loop making ``BatchingPolicy(rules=RULES)`` per
batch resolved every signature of every batch anew, a run on fake tensors each (about
10 ms apiece). A table's tokens are kept while the objects in it live (held weakly
where they can be): one of them gone, its id may be another object's, so the entry
goes with it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["RuleTokens", "tokens_for"]

_counter = itertools.count(1)
_lock = threading.Lock()
# Per rule table (its entries' ids, in order), its tokens and what keeps the entry
# valid: weak references to the rule objects (or the objects, where they take none).
_TABLES: dict[tuple[tuple[int, int], ...], tuple[RuleTokens, list[Any]]] = {}


class RuleTokens:
    """The signature-cache tokens of one rule table, one per default dtype.

    Example:
        >>> tokens = tokens_for({})
        >>> tokens.of(torch.float32)
        0
        >>> tokens.of(torch.float64) == tokens.of(torch.float64) != 0
        True
    """

    __slots__ = ("base", "by_dtype")

    def __init__(self, base: int) -> None:
        self.base = base  # the token under float32, the default default
        self.by_dtype: dict[torch.dtype, int] = {}

    def of(self, default: torch.dtype) -> int:
        """The token of these rules under the default dtype ``default``."""
        if default is torch.float32:
            return self.base
        token = self.by_dtype.get(default)
        if token is None:
            with _lock:
                token = self.by_dtype.setdefault(default, next(_counter))
        return token


# Policies without rules: one table, living as long as the program.
_NO_RULES = RuleTokens(0)


def tokens_for(rules: Mapping[Any, Any]) -> RuleTokens:
    """The tokens of the rule table ``rules`` (shared by every table with the same
    entries, by identity, while those objects live).

    Example:
        >>> import batchgraph as bg
        >>> from torch import nn
        >>> tokens_for({nn.Linear: bg.VmapKey}) is tokens_for({nn.Linear: bg.VmapKey})
        True
        >>> tokens_for({nn.Linear: bg.VmapKey}) is tokens_for({nn.GRUCell: bg.VmapKey})
        False
    """
    if not rules:
        return _NO_RULES
    ident = tuple(sorted((id(k), id(v)) for k, v in rules.items()))
    with _lock:
        found = _TABLES.get(ident)
        if found is not None:
            return found[0]
        tokens = RuleTokens(next(_counter))

        def forget(_: Any, ident: tuple[tuple[int, int], ...] = ident) -> None:
            _TABLES.pop(ident, None)  # no lock: this may run inside the locked block

        keep: list[Any] = []
        for obj in {id(o): o for pair in rules.items() for o in pair}.values():
            try:
                keep.append(weakref.ref(obj, forget))
            except TypeError:  # a C function or the like: it lives as long as the program
                keep.append(obj)
        _TABLES[ident] = (tokens, keep)
        return tokens
