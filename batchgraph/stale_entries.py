"""Whether a call site's cached signature still holds at a key's first call after
each compute (``CallSite.__call__`` asks, not per call): what it was resolved under
(the default dtype, the layout, train/eval modes, hooks and plain attributes of the
modules it reads) may have changed since; then it is resolved anew."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from batchgraph.attributes import Attributes, note_own_state, spec_attributes
from batchgraph.buffers import buffers_kept
from batchgraph.hooks import hooks_of
from batchgraph.lazy_modules import guard_lazy_reads
from batchgraph.lifetimes import bounded, keep_signature
from batchgraph.rules import may_be_random
from batchgraph.specs import intern_spec

if TYPE_CHECKING:
    from batchgraph.entries import Entry
    from batchgraph.policy import BatchingPolicy
    from batchgraph.recording import CallSite

__all__ = ["STALE", "recheck", "switch_modes"]

STALE: Any = object()  # what recheck returns for an entry resolved anew
_default_dtype = torch.get_default_dtype


def recheck(
    site: CallSite, policy: BatchingPolicy, entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """At a key's first call after each compute (not per call): whether what
    ``entry`` was resolved under still holds. ``STALE`` where not (the caller
    calls again, which resolves anew), else the plain attributes for key_id."""
    graph, module = policy.graph, site._bg_mode_module
    if _default_dtype() is not policy.default_dtype and policy.follow_default_dtype():
        # torch.set_default_dtype inside the block: noted (compute refuses), and
        # the signature resolved under the new default (int_h * 2.5 is float64).
        return STALE
    if entry.layout and entry.layout != graph.signature_layout(site._bg_fn):
        # The module was converted (model.double(), .to(device)), a tensor the
        # function reads was rebound to another dtype, or a parameter or buffer
        # given another shape (`p.data = t`, `m.buf = t`), since this
        # signature was resolved: its cached output spec is stale (an
        # embedding's dtype is its weight's). Checked here, once per key and
        # compute, not per call, and not for callables that read no tensors
        # (operators, most functions); the signatures are resolved anew.
        site._bg_forget()
        # A conversion keeps the parameters' objects but replaces the buffers:
        # the graph lists them anew, so the new ones are watched.
        graph.forget_parts(site._bg_fn)
        return STALE
    if entry.modes is not None and entry.modes != graph.modes_of(site._bg_fn):
        # The module or a submodule was switched (train/eval) since this
        # signature was resolved: see switch_modes. Checked as the layout is.
        switch_modes(site, policy, entry, args, kwargs)
        return STALE
    if entry.hooks is not None and module is not None and entry.hooks != hooks_of(module):
        # Hooks changed since this signature was resolved: its spec may not
        # hold (a hook may reshape), and resolving warns of batched hooks.
        site._bg_forget()
        return STALE
    attrs = graph.attributes_now(entry.key.fn)
    if entry.attrs != attrs and (now := spec_attributes(attrs)) != entry.attrs:
        # A plain attribute of a module it reads was set since this signature
        # was resolved (conv.padding, drop.p): the spec may not hold. Its calls
        # get a key id of their own, and compute refuses those recorded before.
        if _only_numbers_changed(entry.attrs, now) and _spec_holds(site, policy, entry):
            entry.attrs = now  # an annealed temperature: the same spec
            return attrs
        site._bg_forget()
        return STALE
    return attrs


def _only_numbers_changed(then: Attributes | None, now: Attributes | None) -> bool:
    """Whether ``then`` and ``now`` name the same attributes and differ only in
    float values (a temperature or dropout rate annealed per batch), not in
    structural settings (a padding, a flag), which resolve the signature anew."""
    if then is None or now is None or len(then) != len(now):
        return False
    for (i, name, old), (j, other, new) in zip(then, now):
        if i != j or name != other:
            return False
        if old != new and not (old[0] is float and new[0] is float):
            return False
    return True


def _spec_holds(site: CallSite, policy: BatchingPolicy, entry: Entry) -> bool:
    """Whether ``entry``'s call run on fake tensors under the settings of now gives
    the spec, randomness and result type it was resolved with (``Upsample``'s
    ``scale_factor`` changes the shape; a dropout rate from 0 draws random numbers):
    then its key and vmap check stand (a run on fake tensors costs about a third of
    resolving anew, where the vmap check is most of it)."""
    from batchgraph.recording import not_recording  # which imports this module

    call = getattr(entry.key, "call", None)
    if call is None or entry.on_copy:
        return False
    fn = site._bg_fn
    graph = policy.graph
    before = graph.attributes_now(fn)
    try:
        with not_recording(), guard_lazy_reads(fn), buffers_kept(fn):
            spec, draws_random, kind = site._bg_infer_spec(call)
    except Exception:  # resolving anew reports it where it belongs
        return False
    note_own_state(graph.watched_modules(fn), before, graph.attributes_now(fn))
    key = entry.key
    dedupe = key.deterministic and not draws_random and not may_be_random(key.fn)
    return intern_spec(spec) is entry.spec and kind == entry.kind and dedupe == entry.dedupe


def switch_modes(
    site: CallSite, policy: BatchingPolicy, entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Cache ``entry``'s signature resolved in the modes of now (kept from an
    earlier switch, or resolved now) in place of ``entry``, kept for a switch back.

    The spec, key and randomness found in one mode may not hold in the other: a
    BatchNorm vmapped in eval mode cannot run so in training, and a layer adding
    noise only in training, found deterministic, had identical calls merged into
    one draw. (An uncached entry, of an unhashable static argument, is resolved
    at each call, so only cached ones get here.)"""
    sig, old, modes = entry.sig, entry.modes, policy.graph.modes_of(site._bg_fn)
    assert sig is not None and old is not None and modes is not None
    other = site._bg_by_modes.get((sig, modes))
    if other is None or other.rules_token != policy.rules_token:
        other = site._bg_resolve(policy, args, kwargs, sig)
        other.sig = sig
    site._bg_by_modes = bounded(site._bg_by_modes, (sig, old), entry)
    keep_signature(site, sig, other)
    site._bg_last = (None, None)
    site._bg_last1 = (None, None)
