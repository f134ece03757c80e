"""The schedule IR: actions on stages, and a schedule as plain data.

An action is one unit of work for one stage and one microbatch::

    F  forward
    B  full backward (input and weight gradients together)
    I  input-gradient half of the backward (dL/d input; keeps what W needs)
    W  weight-gradient half of the backward (dL/d parameters)

Its compact string form is ``f"{stage}{kind}{microbatch}"``: ``"2F0"`` is stage 2,
forward, microbatch 0. ``Action.parse`` reads it back, so schedules round-trip through
text (handy in error messages and tests).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

__all__ = ["Action", "ActionKind", "PipelineSchedule"]


class ActionKind(str, enum.Enum):
    """What an action does; the value is its one-letter code."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``kind`` on ``stage`` for ``microbatch``.

    Example:
        >>> a = Action(2, ActionKind.FORWARD, 0)
        >>> str(a)
        '2F0'
        >>> Action.parse("2F0") == a
        True
    """

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the compact form ``"<stage><F|B|I|W><microbatch>"``.

        Raises:
            ValueError: if ``text`` is not of that form.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected '<stage><F|B|I|W><microbatch>', e.g. '2F0'"
            )
        stage, kind, mb = match.groups()
        return cls(int(stage), ActionKind(kind), int(mb))


@dataclass
class PipelineSchedule:
    """A whole schedule as data: for each device, its actions in the order it runs them.

    ``stages`` is the number of pipeline stages (model chunks in total), ``devices`` the
    number of devices (ranks or threads) and ``chunks`` the number of stages per device
    (``stages == devices * chunks``). With ``chunks=v`` device ``d`` runs stages
    ``d, d + devices, d + 2 * devices, ...``.

    Example:
        >>> s = PipelineSchedule("demo", stages=1, devices=1, microbatches=1, chunks=1,
        ...                      order={0: [Action.parse("0F0"), Action.parse("0B0")]})
        >>> [str(a) for a in s.order[0]]
        ['0F0', '0B0']
    """

    name: str
    stages: int
    devices: int
    microbatches: int
    chunks: int
    order: dict[int, list[Action]] = field(default_factory=dict)

    def device_of(self, stage: int) -> int:
        """The device that runs ``stage`` (stages are dealt round-robin over devices)."""
        return stage % self.devices

    def stages_of(self, device: int) -> list[int]:
        """The stages ``device`` runs, in increasing order."""
        return list(range(device, self.stages, self.devices))

    @property
    def split_backward(self) -> bool:
        """True when the backward is split into I and W actions."""
        return any(
            a.kind is ActionKind.BACKWARD_WEIGHT for actions in self.order.values() for a in actions
        )
