"""Checkpoints of a pipelined model: its state under the original model's names.

A pipeline's stages hold the model's parameters and buffers under names of their own:
stage 1 of an ``nn.Sequential`` split after its second layer calls that model's layer
``2`` its ``0``. :class:`StateNames` maps each stage's ``state_dict`` keys to the names
``model.state_dict()`` gives for the unsplit model on one device, so a checkpoint saved
from a pipeline loads into the unsplit model, and one saved from the unsplit model loads
into a pipeline::

    model.state_dict():   0.weight  0.bias  2.weight  2.bias
    stage 0 (rank 0):     0.weight  0.bias                      (the same names)
    stage 1 (rank 1):                       0.weight  0.bias    (named 2.weight, 2.bias)

Stages are matched to the model by tensor identity, before any stage is moved or
materialised (``.to()`` gives buffers, and a meta model's ``to_empty`` gives every
tensor, a new identity). Stages given as a list without a whole model (to
``DistributedPipeline``, as modules or factories) are named as ``nn.Sequential(*stages)``
names them: ``"{stage}.{key}"``. State that no stage holds (a parameter the traced
forward never uses) is left out of a pipeline's ``state_dict`` and skipped on loading.

On the torch.distributed backend a rank trains only its own stages, so the whole model's
own ``state_dict()`` there holds meta (never materialised) or stale (never trained here)
tensors for the other ranks' stages: :func:`guard_split` makes it fail, saying what to
call instead.
"""

from __future__ import annotations

import contextvars
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

from torch import Tensor, nn
from torch.nn.parameter import is_lazy

__all__ = ["CheckpointMethods", "IncompatibleKeys", "SplitGuard", "StateNames", "guard_split"]

# Set while this module reads a guarded module's state on purpose (by identity, with
# keep_vars=True): the guard stops only the user's saves.
_INSPECTING: contextvars.ContextVar[bool] = contextvars.ContextVar("inspecting", default=False)


@contextmanager
def _inspecting() -> Iterator[None]:
    token = _INSPECTING.set(True)
    try:
        yield
    finally:
        _INSPECTING.reset(token)


def _state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state_dict entries, the tensors themselves (not detached views)."""
    with _inspecting():
        return dict(module.state_dict(keep_vars=True))


def _size_mismatch(name: str, given: Any, own: Any, stage: int) -> list[str]:
    """``nn.Module.load_state_dict``'s size check of one entry, worded with the model's
    name (a lazy parameter takes any shape, as there)."""
    if not isinstance(given, Tensor) or not isinstance(own, Tensor) or is_lazy(own):
        return []
    if given.shape == own.shape or (own.dim() == 0 and given.shape == (1,)):
        return []  # torch takes a 1-element tensor for a 0-d one (old checkpoints)
    return [
        f"size mismatch for {name}: copying a param with shape {given.shape} from "
        f"checkpoint, the shape in stage {stage} is {own.shape}"
    ]


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict(..., strict=False)`` skipped, like ``nn.Module``'s."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _listed(keys: Sequence[str], most: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


class StateNames:
    """Each stage's ``state_dict`` keys, and the unsplit model's names for the same tensors.

    Build it with :meth:`by_identity` (a whole model and its stage modules, before they
    are moved) or :meth:`by_position` (a list of stages: ``"{stage}.{key}"``).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> stages = [nn.Sequential(net[0], net[1]), nn.Sequential(net[2])]
        >>> names = StateNames.by_identity(net, stages)
        >>> list(names.state_dict({1: stages[1]}))
        ['2.weight', '2.bias']
        >>> names.load_state_dict({0: stages[0]}, {"0.weight": net[0].weight})
        Traceback (most recent call last):
        ...
        RuntimeError: Error(s) in loading a state_dict into stage 0: missing key(s): '0.bias'. Give the state_dict of the same model (the unsplit model's state_dict(), or the pipeline's), or pass strict=False to load only the keys that match
    """

    def __init__(
        self,
        by_stage: Mapping[int, Mapping[str, tuple[str, ...]]] | None,
        model_keys: Sequence[str] | None,
        stages: int,
    ) -> None:
        self._by_stage = by_stage
        self._order = None if model_keys is None else {k: i for i, k in enumerate(model_keys)}
        self._stages = stages

    @classmethod
    def by_identity(
        cls, model: nn.Module | Sequence[nn.Module], stages: Sequence[nn.Module]
    ) -> StateNames:
        """Names of ``model`` (a list is named like ``nn.Sequential(*model)``) for the
        tensors of ``stages``, matched by identity: call it before the stages move."""
        root = model if isinstance(model, nn.Module) else nn.Sequential(*model)
        model_state = _state(root)
        names: dict[int, list[str]] = {}
        for name, value in model_state.items():
            names.setdefault(id(value), []).append(name)
        by_stage = {
            s: {k: tuple(names[id(v)]) for k, v in _state(m).items() if id(v) in names}
            for s, m in enumerate(stages)
        }
        return cls(by_stage, list(model_state), len(stages))

    @classmethod
    def of_given(cls, given: object, stages: Sequence[object] | None, total: int) -> StateNames:
        """For what a ``DistributedPipeline`` was given: a whole model with its stage
        modules (:meth:`by_identity`), else a list of stages (:meth:`by_position`)."""
        if isinstance(given, nn.Module) and stages is not None:
            modules = [s for s in stages if isinstance(s, nn.Module)]
            if len(modules) == len(stages):
                return cls.by_identity(given, modules)
        return cls.by_position(total)

    @classmethod
    def by_position(cls, stages: int) -> StateNames:
        """Stage ``s``'s key ``k`` is named ``"{s}.{k}"``, as in ``nn.Sequential(*stages)``."""
        return cls(None, None, stages)

    def names_of(self, stage: int, module: nn.Module) -> dict[str, tuple[str, ...]]:
        """``module``'s (stage ``stage``'s) state_dict keys -> the model's names for them
        (several where the model holds one tensor under several names: tied weights)."""
        if self._by_stage is not None:
            return dict(self._by_stage[stage])
        return {k: (f"{stage}.{k}",) for k in _state(module)}

    def ordered(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """``state`` in the order the unsplit model's ``state_dict()`` has (stage order
        when the model is not known here)."""
        order = self._order
        if order is not None:
            return {k: state[k] for k in sorted(state, key=lambda k: order.get(k, len(order)))}
        return {k: state[k] for k in sorted(state, key=lambda k: int(k.split(".", 1)[0]))}

    def state_dict(self, modules: Mapping[int, nn.Module]) -> dict[str, Any]:
        """The entries of the stages in ``modules`` (``{stage: module}``) under the model's
        names, detached as ``nn.Module.state_dict`` gives them."""
        out: dict[str, Any] = {}
        for s in sorted(modules):
            state = _state(modules[s])
            for key, names in self.names_of(s, modules[s]).items():
                value = state[key]
                for name in names:
                    out.setdefault(name, value.detach() if isinstance(value, Tensor) else value)
        return self.ordered(out)

    def _unexpected(
        self, name: str, own: Mapping[int, Mapping[str, tuple[str, ...]]], known: set[str]
    ) -> bool:
        """Whether no stage of the model has ``name`` (as far as this process can tell);
        ``known``: the names of the stages in ``own``."""
        if name in known:
            return False
        if self._order is not None:
            return name not in self._order
        head = name.split(".", 1)[0]
        # Another rank's stage: its keys are known only there.
        return not (head.isdigit() and int(head) < self._stages and int(head) not in own)

    def load_state_dict(
        self,
        modules: Mapping[int, nn.Module],
        state_dict: Mapping[str, Any],
        strict: bool = True,
    ) -> IncompatibleKeys:
        """Copy the entries of the stages in ``modules`` from ``state_dict`` (a whole
        model's, or only these stages').

        Raises:
            RuntimeError: with ``strict``, before anything is copied, if a name of these
                stages is missing or a key belongs to no stage of the model.
        """
        own = {s: self.names_of(s, m) for s, m in modules.items()}
        wanted = [n for s in sorted(own) for names in own[s].values() for n in names]
        missing = [n for n in dict.fromkeys(wanted) if n not in state_dict]
        known = set(wanted)  # once, not per key: a large model has thousands
        unexpected = [k for k in state_dict if self._unexpected(k, own, known)]
        if strict and (missing or unexpected):
            where = ", ".join(map(str, sorted(own)))
            errors = [f"missing key(s): {_listed(missing)}"] if missing else []
            if unexpected:
                errors.append(f"unexpected key(s), of no stage: {_listed(unexpected)}")
            raise RuntimeError(
                f"Error(s) in loading a state_dict into stage{'s' if len(own) > 1 else ''} "
                f"{where}: {'; '.join(errors)}. Give the state_dict of the same model (the "
                "unsplit model's state_dict(), or the pipeline's), or pass strict=False to "
                "load only the keys that match"
            )
        locals_: dict[int, dict[str, Any]] = {}
        mismatched: list[str] = []
        for s, keys in own.items():
            state = _state(modules[s])
            local = locals_[s] = {}
            for key, names in keys.items():
                found = next((n for n in names if n in state_dict), None)
                if found is not None:
                    local[key] = state_dict[found]
                    mismatched += _size_mismatch(found, state_dict[found], state.get(key), s)
        if mismatched:
            # Before anything is copied, under the model's names: the stage's own error
            # would name its local key (stage 1's "0.weight" for the model's "2.weight").
            raise RuntimeError(
                "Error(s) in loading a state_dict into the pipeline's stages: "
                f"{'; '.join(mismatched)}. Give the state_dict of the same model (the unsplit "
                "model's state_dict(), or the pipeline's)"
            )
        for s, local in locals_.items():
            modules[s].load_state_dict(local, strict=False)
        return IncompatibleKeys(missing, unexpected)


class CheckpointMethods(ABC):
    """``state_dict``, ``load_state_dict`` and ``gather_state_dict`` of a pipeline
    (``Pipeline``, ``DistributedPipeline``), from its ``_names``, ``own_modules`` and
    ``gather_state``."""

    _names: StateNames

    @property
    @abstractmethod
    def own_modules(self) -> dict[int, nn.Module]:
        """This process's stage modules, by stage index."""

    @abstractmethod
    def gather_state(self, part: dict[str, Any], dst: int = 0) -> dict[str, Any] | None:
        """Every process's ``part`` merged on process ``dst`` (None on the others)."""

    def state_dict(self) -> dict[str, Any]:
        """The stages' parameters and buffers under the names ``model.state_dict()``
        gives for the unsplit model on one device (a list of layers or stages is named
        like ``nn.Sequential(*list)``): a checkpoint that loads into the unsplit model.

        With ``backend="torch.distributed"`` (and ``DistributedPipeline``): this rank's
        stages' entries only, real tensors; :meth:`gather_state_dict` gives the whole
        model's on one rank. (There the model's own ``state_dict()`` would hold meta or
        stale tensors for the other ranks' stages, and raises, naming these methods.)
        Optimizer state is not included.

        Example:
            >>> import torch
            >>> from torch import nn
            >>> from batchgraph.pipeline import Pipeline
            >>> net = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
            >>> with Pipeline(net, stages=2, microbatches=2, loss_fn=nn.MSELoss()) as pipe:
            ...     _ = pipe.train_step(torch.randn(4, 2), torch.randn(4, 1))
            ...     checkpoint = pipe.state_dict()
            >>> list(checkpoint)
            ['0.weight', '0.bias', '2.weight', '2.bias']
            >>> fresh = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
            >>> fresh.load_state_dict(checkpoint)
            <All keys matched successfully>
        """
        return self._names.state_dict(self.own_modules)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy the stages' parameters and buffers from a state_dict of the unsplit model
        (or of this pipeline: the names :meth:`state_dict` gives).

        On the distributed backend each rank takes its own stages' entries (not a
        collective): give every rank the whole model's state_dict, or its own part.

        Args:
            state_dict: the entries, by the unsplit model's names.
            strict: refuse a state_dict that lacks an entry of this process's stages or
                has one that no stage of the model has.

        Returns:
            The keys skipped: ``missing_keys`` (of this process's stages) and
            ``unexpected_keys``.

        Raises:
            RuntimeError: with ``strict``, before anything is copied, naming the keys.
        """
        return self._names.load_state_dict(self.own_modules, state_dict, strict)

    def gather_state_dict(self, dst: int = 0) -> dict[str, Any] | None:
        """The whole model's :meth:`state_dict` on rank ``dst``, ``None`` on the others.

        On the distributed backend it is a collective (call it on every rank) and the
        tensors arrive on the CPU; on threads it is :meth:`state_dict`.
        """
        merged = self.gather_state(self.state_dict(), dst)
        return None if merged is None else self._names.ordered(merged)


class SplitGuard:
    """A ``state_dict`` post-hook that refuses: the module's stages train on other ranks."""

    def __init__(self, own: Sequence[int], stages: int) -> None:
        self.own, self.stages = tuple(own), stages

    def __call__(self, module: nn.Module, *args: Any) -> None:
        if _INSPECTING.get():
            return
        own = ", ".join(map(str, self.own)) or "none"
        raise RuntimeError(
            f"this {type(module).__name__} is (part of) a model split into {self.stages} "
            f"pipeline stages that run on several ranks, and this rank runs only stage(s) "
            f"{own}: here the other stages' parameters and buffers are meta tensors (never materialised) or "
            "stale copies (never trained on this rank), so its state_dict() would be a "
            "broken checkpoint. Save pipe.state_dict() on every rank (this rank's stages, "
            "under this model's names) or pipe.gather_state_dict() (the whole model, on "
            "rank 0); load with pipe.load_state_dict(state_dict)"
        )


def guard_split(items: Iterable[object], own: Mapping[int, nn.Module], stages: int) -> None:
    """Make ``state_dict()`` of each module of ``items`` (the model given to a pipeline,
    or its listed parts; factories are skipped) fail where this rank does not run all of
    it; once per module.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> guard_split([net], {0: nn.Sequential(net[0])}, stages=2)
        >>> net[0].state_dict()["weight"].shape     # what rank 0 runs
        torch.Size([2, 2])
        >>> net.state_dict()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: this Sequential is (part of) a model split into 2 pipeline stages that run on several ranks, ...
    """
    if len(own) == stages:
        return
    held = {id(m) for module in own.values() for m in module.modules()}
    for item in items:
        if not isinstance(item, nn.Module):
            continue
        hooks = item._state_dict_hooks.values()
        if id(item) not in held and not any(isinstance(h, SplitGuard) for h in hooks):
            item.register_state_dict_post_hook(SplitGuard(sorted(own), stages))  # type: ignore[no-untyped-call]
