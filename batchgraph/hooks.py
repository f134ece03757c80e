"""Hooks on a batched module: they run once per batched call, not once per example.

A hook cannot be split per example: under a stacking rule it sees the whole batch
(``(B, ...)`` tensors), so recording a hooked module warns (``BatchedHooksWarning``),
once per call signature, saying what to register instead. A call site resolves a
signature once and caches it, so it also notes the module's hooks (``hooks_of``) and
resolves its signatures anew when they changed: a hook registered after a first batch
was recorded (a normalizing forward hook, say) warned nowhere and saw whole batches.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.modules.lazy import LazyModuleMixin

from batchgraph.keys import BatchKey, VmapKey, callable_name

__all__ = [
    "BatchedHooksWarning", "Hooks", "hooks_of", "warn_about_hooks", "warn_about_read_hooks",
]

# Per hook dict, the ids of the hooks in it (``hooks_of``).
Hooks = tuple[tuple[int, ...], ...]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def hooks_of(module: nn.Module) -> Hooks:
    """Which hooks calls of ``module`` run now: the handle ids of each hook dict of
    the module and its submodules, then of torch's global module hooks. Compared
    with what a call site noted when it resolved a signature, once per key and
    compute (``CallSite.__call__``), not per call; and noted per key id
    (``Graph.key_hooks``) for the check at compute (``compute_checks.check_modes``).

    Example:
        >>> lin = nn.Linear(2, 2)
        >>> before = hooks_of(lin)
        >>> handle = lin.register_forward_hook(lambda m, i, o: o)
        >>> hooks_of(lin) == before
        False
        >>> handle.remove()
        >>> hooks_of(lin) == before
        True
    """
    found = [tuple(getattr(m, attr, None) or ()) for m in module.modules() for attr in _HOOK_DICTS]
    found += [tuple(getattr(torch_module, f"_global{attr}", None) or ()) for attr in _HOOK_DICTS]
    return tuple(found)


class BatchedHooksWarning(UserWarning):
    """A module with hooks is batched: its hooks run once per batched call."""


def _hook_kinds(modules: list[nn.Module]) -> list[str]:
    kinds = []
    for name, attr in zip(("forward", "forward pre", "backward", "backward pre"), _HOOK_DICTS):
        if (modules and getattr(torch_module, f"_global{attr}", None)) or any(
            _per_example_unsafe(getattr(m, attr, None)) for m in modules
        ):
            kinds.append(name)
    return kinds


# Hooks torch itself installs to compute a parameter from others before each forward
# (torch.nn.utils.weight_norm's WeightNorm): they read no activations and keep no
# state, so running once per batched call gives what each eager call gets. (So does
# a lazy module's, which initializes it: a function reading one it does not call.) Not
# spectral_norm's: in train mode each call takes a power-iteration step, per example
# eagerly, once per batch here.
_PARAMETER_HOOK_MODULES = ("torch.nn.utils.weight_norm",)


def _per_example_unsafe(hooks: Any) -> bool:
    """Whether a module's hook dict holds a hook that may see activations."""
    if not hooks:
        return False
    return any(
        getattr(type(hook), "__module__", None) not in _PARAMETER_HOOK_MODULES
        and getattr(hook, "__func__", None) is not LazyModuleMixin._infer_parameters
        for hook in hooks.values()
    )


def warn_about_hooks(module: nn.Module, key: BatchKey) -> None:
    """Warn (once per signature: keys are chosen once) that a batched module's hooks
    do not run per example as eagerly. Hooks cannot be split per example, and
    running such a module one call at a time would be a silent slowdown, so this
    says what happens and what to register instead.
    """
    kinds = _hook_kinds(list(module.modules()))
    if not kinds:
        return
    if isinstance(key, VmapKey):
        how = (
            "forward hooks run inside torch.func.vmap (a tensor a hook keeps escapes it "
            "and cannot be used afterwards), and backward hooks see the whole batch's "
            "gradients"
        )
    else:
        how = (
            "a hook sees the whole batch, (B, ...) tensors, so one that reads or changes "
            "values across an example (out / out.norm()) mixes the examples, and one "
            "that keeps tensors keeps batches"
        )
    name = type(module).__name__
    vmap = "" if isinstance(key, VmapKey) else (
        "; a forward hook that only transforms each example's values is right under "
        f"rules={{{name}: bg.VmapKey}}"
    )
    warnings.warn(
        f"{callable_name(module)} has {' and '.join(kinds)} hooks; batched by "
        f"{type(key).__name__}, they run once per batched call (and once on fake tensors "
        f"when a call signature is new), not once per example: {how}. For eager "
        f"behaviour run it one call at a time, BatchingPolicy(rules={{{name}: "
        f"bg.UnbatchedKey}}) (or, for this module alone, the module as the key: "
        f"rules={{module: bg.UnbatchedKey}}){vmap}.",
        BatchedHooksWarning,
        stacklevel=_caller_level(),
    )


def warn_about_read_hooks(fn: Any, key: BatchKey) -> None:
    """Warn (once per signature) that hooks of modules a batched function reads
    (closed over, global, a bound method's module: as ``batchgraph.captured`` finds
    them) run inside its batched call, as ``warn_about_hooks`` does for a module's:
    under vmap a forward hook that keeps its output (``store.append(out)``) kept one
    vmap-internal tensor, which failed when used ("tensor may have escaped")."""
    from batchgraph.captured import captured_parts  # it imports nothing of ours

    named = captured_parts(fn)[2]
    kinds = _hook_kinds([m for _, m in named])
    if not kinds:
        return
    hooked = [name for name, m in named if _hook_kinds([m])]
    warnings.warn(
        f"{callable_name(fn)} reads modules with {' and '.join(kinds)} hooks "
        f"({', '.join(hooked[:5]) or 'global ones'}); batched by {type(key).__name__}, "
        "they run once per batched call (and once on fake tensors when a call signature "
        "is new), not once per example: under vmap a forward hook sees each example's "
        "values, but a tensor it keeps escapes vmap and cannot be used afterwards, and "
        "backward hooks see the whole batch's gradients. For eager behaviour run it one "
        "call at a time: BatchingPolicy(rules={fn: bg.UnbatchedKey}).",
        BatchedHooksWarning,
        stacklevel=_caller_level(),
    )


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _caller_level() -> int:
    """The ``stacklevel``, for a warning its caller raises, of the first frame
    outside batchgraph: the line that recorded the call, however many of
    batchgraph's frames lie between (a call site resolving its signatures anew
    calls itself again)."""
    frame = sys._getframe(1)  # the frame that calls warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    return level
