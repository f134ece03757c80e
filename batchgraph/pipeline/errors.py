"""Exceptions raised by the pipeline runtime.

Each subclasses the builtin a caller would naturally catch (``ValueError`` for bad
configuration, ``RuntimeError`` for failures while running) and batchgraph's own base
class, so ``except BatchgraphError`` catches everything batchgraph raises on purpose.
"""

from __future__ import annotations

from batchgraph.errors import BatchgraphError, ShapeMismatchError

__all__ = [
    "PipelineAbortedError",
    "PipelineClosedError",
    "PipelineConfigError",
    "PipelineReentrantError",
    "PipelineTimeoutError",
    "StageError",
    "StageMismatchError",
]


class PipelineConfigError(BatchgraphError, ValueError):
    """The pipeline was built with values that cannot work together (stages, microbatches, ...)."""


class StageMismatchError(ShapeMismatchError):
    """What one stage produces does not fit the next stage; found before training starts."""


class StageError(BatchgraphError, RuntimeError):
    """A stage's task raised. The message names the stage, the action and the microbatch.

    The original exception is chained as ``__cause__``; ``stage``, ``action`` (its compact
    form, e.g. ``"1F3"``) and ``microbatch`` are kept as attributes for programmatic use.
    """

    def __init__(self, message: str, *, stage: int, action: str, microbatch: int) -> None:
        super().__init__(message)
        self.stage = stage
        self.action = action
        self.microbatch = microbatch


class PipelineAbortedError(BatchgraphError, RuntimeError):
    """Raised inside the runtime to wake a task blocked on a message after another task failed."""


class PipelineTimeoutError(BatchgraphError, TimeoutError):
    """A task waited longer than the pipeline's timeout for a message."""


class PipelineClosedError(BatchgraphError, RuntimeError):
    """The pipeline (or its communicator) was used after ``close()``."""


class PipelineReentrantError(BatchgraphError, RuntimeError):
    """A pipeline was called from inside one of its own running steps (its loss function,
    a stage's forward or a hook), where the call would wait for itself forever."""
