"""Stubs pinned in instance dicts while recording (see ``module._SubmoduleAttribute``).

While a policy records, reading ``model.cell`` on a ``BatchedModule`` must give the
cell's call site (a ``ModuleStub``) instead of the module. The first read goes
through a descriptor, which pins the stub in the instance's ``__dict__`` so later
reads are plain attribute lookups. Every recording context takes its pins out when
it ends, so outside one the attribute reads as the module again.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["pin_stub", "unpin_stubs"]

# (owner, attribute name, stub) of every pinned stub.
_PINNED: list[tuple[weakref.ref[Any], str, Any]] = []


def pin_stub(owner: Any, name: str, stub: Any) -> None:
    """Let ``owner.<name>`` read as ``stub`` by plain lookup until ``unpin_stubs``."""
    owner.__dict__[name] = stub
    _PINNED.append((weakref.ref(owner), name, stub))


def unpin_stubs() -> None:
    """Take every pinned stub out of its instance dict (a recording context ended).

    Recording contexts of other threads lose theirs too; their next read goes
    through the descriptor again and pins anew, which is only slower.
    """
    while _PINNED:
        try:
            ref, name, stub = _PINNED.pop()
        except IndexError:  # another thread emptied it meanwhile
            return
        owner = ref()
        if owner is not None and owner.__dict__.get(name) is stub:
            owner.__dict__.pop(name, None)
