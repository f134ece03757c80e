"""Which of the model's layers the stages hold, and a check that the model still has them.

A pipeline's stages hold the model's layer objects (an ``nn.Sequential``'s layers, a
traced model's submodules and its own parameters), taken when the pipeline is built.
Whatever changes inside those objects reaches the stages (parameter values, a layer's
replaced parameter, ``requires_grad``), but a layer replaced in the model itself
(``model[4] = nn.Linear(...)``, ``model.head = ...``) does not: the stages kept the old
one, and went on training it (and ``pipe.state_dict()`` saving it) while ``model(x)``
used the new, untrained one. :class:`HeldLayers` notes, for each outermost object a stage
holds, where the model has it, and :meth:`HeldLayers.check` refuses a step once the model
has something else there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from torch import nn

from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["HeldLayers"]


def _at(model: nn.Module, path: str) -> object:
    """What ``model`` has at the dotted ``path`` now (``None`` if nothing)."""
    value: object = model
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value


class HeldLayers:
    """The model's layers (and its own parameters and buffers) that the stages hold.

    Args:
        model: the whole model the stages were split from.
        stages: the stage modules, holding the model's objects (not copies).

    Example:
        >>> from batchgraph.pipeline.partition import partition_sequential
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> held = HeldLayers(net, partition_sequential(net, 2))
        >>> held.check()
        >>> net[2] = nn.Linear(2, 1)
        >>> held.check()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        batchgraph.pipeline.errors.PipelineConfigError: the model's layer '2' was replaced after the pipeline was built ...
    """

    def __init__(self, model: nn.Module, stages: Sequence[nn.Module]) -> None:
        self.model = model
        modules = {id(m) for stage in stages for m in stage.modules()}
        tensors = {
            id(t) for stage in stages for t in itertools.chain(stage.parameters(), stage.buffers())
        }
        held_paths: set[str] = set()
        self._held: list[tuple[str, str, object]] = []
        for path, module in model.named_modules():
            if id(module) not in modules:
                continue
            held_paths.add(path)
            parent = path.rpartition(".")[0]
            if path and parent not in held_paths:  # outermost: the stage holds it itself
                self._held.append((path, "layer", module))
        named = itertools.chain(model.named_parameters(), model.named_buffers())
        for path, tensor in named:
            owner = path.rpartition(".")[0]
            if id(tensor) in tensors and owner not in held_paths:
                kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
                self._held.append((path, kind, tensor))

    def check(self) -> None:
        """Refuse a step when the model has another object where a stage's was.

        Raises:
            PipelineConfigError: naming the path, the old and the new object's types.
        """
        for path, kind, held in self._held:
            now = _at(self.model, path)
            if now is not held:
                raise PipelineConfigError(
                    f"the model's {kind} {path!r} was replaced after the pipeline was built "
                    f"({type(held).__name__} -> {type(now).__name__}): the stages hold the "
                    "one it had then, so this step would train it (and pipe.state_dict() "
                    "save it), not the model's new one. Build a new Pipeline after replacing "
                    "layers; changes inside a layer (its parameters' values, a parameter of "
                    "the layer replaced, requires_grad) reach the stages as they are"
                )
