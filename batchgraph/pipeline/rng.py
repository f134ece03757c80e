"""Reproducible random numbers for stages that run on threads of one process.

``torch``'s CPU generator is one per process, and dropout (any ``torch.rand*``,
``bernoulli``, ...) draws from it. Stage threads that draw at the same time take each
other's numbers in whatever order the threads happen to run, so two runs with the same
``torch.manual_seed`` differed. Here each stage forward of a microbatch draws from a
generator state of its own::

    caller thread:  step seed s = one draw from the CPU generator (only when needed)
    stage k, F(mb): with LOCK: save state; manual_seed(mix(s, k, mb)); forward (+ loss);
                               restore state

The lock is needed because there is only one generator: a stage that draws runs its
actions one at a time with the other drawing stages' (its backward too, once it is seen
drawing, as activation checkpointing sets the generator state there to recompute). Stages that draw nothing
should not pay that. Whether a stage draws is known per configuration (training step or
not, and every submodule's ``training`` flag, since ``eval()`` turns dropout off): a
stage of ``torch.nn`` layers that never draw (no dropout, ``RReLU`` or attention) runs
unlocked at once; any other runs locked in a configuration's first step, which compares
the generator state before and after each forward, and unlocked from then on if it drew
nothing. A stage that draws where it was found quiet (a data-dependent draw) changes the
caller's generator state, which the coordinator checks after every step: it warns, and
every stage runs locked from then on.

CUDA stages draw from their own device's generator, one thread per device, in schedule
order: they are reproducible as they are and never locked.

A stage whose forward runs another pipeline (a pipeline inside a pipeline) holds the
lock while it waits for that pipeline's step, whose stages, on threads of their own,
waited for the same lock: the step hung. A step planned in a thread holding a generator
lock gives its stages a lock of their own (:func:`begin_step`): the holder waits for
them, so they are alone with the generator but for each other.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["StageRandom", "begin_step", "end_step", "microbatch_seed"]

# The CPU generator is one per process, so is the lock, whichever pipeline runs (but
# one inside a stage holding it: begin_step).
_LOCK = threading.Lock()
# The generator locks this thread holds (``locks``: a stage's action, innermost last).
_HELD = threading.local()


@contextmanager
def _holding(lock: threading.Lock) -> Iterator[None]:
    with lock:
        held: list[threading.Lock] = _HELD.__dict__.setdefault("locks", [])
        held.append(lock)
        try:
            yield
        finally:
            held.pop()
_MASK = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated seeds."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def microbatch_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """The CPU generator seed of ``stage``'s forward of ``microbatch`` in a step.

    Example:
        >>> microbatch_seed(7, 0, 1) != microbatch_seed(7, 1, 0)
        True
    """
    value = step_seed
    for part in (stage, microbatch):
        value = _mix((value + 0x9E3779B97F4A7C15 * (part + 1)) & _MASK)
    return value


# torch.nn layers that may draw random numbers (in training mode).
_DRAWING: tuple[type[nn.Module], ...] = (
    nn.modules.dropout._DropoutNd,
    nn.RReLU,
    nn.MultiheadAttention,
)


def _may_draw(module: nn.Module) -> bool:
    """Whether ``module`` may draw: it has a drawing layer, or code that is not torch.nn's."""
    for m in module.modules():
        if isinstance(m, _DRAWING) or not type(m).__module__.startswith("torch.nn."):
            return True
    return False


class StageRandom:
    """One stage's random-number discipline (see the module docstring)."""

    def __init__(self, stage: int, device: torch.device) -> None:
        self.stage = stage
        self.cpu = device.type == "cpu"
        self.locked = False
        self.always = False  # set once a stage drew where it was found quiet
        self._draws: dict[tuple[bool, ...], bool] = {}  # per configuration, once learned
        self._config: tuple[bool, ...] = ()
        self._seed = 0
        self._drew = False
        self.lock = _LOCK  # another for a pipeline run by a locked stage (begin_step)

    def plan(self, module: nn.Module, train: bool) -> bool:
        """Whether this step's actions run locked (a CPU stage that may draw)."""
        if not self.cpu:
            return False
        self._config = (train, *(m.training for m in module.modules()))
        draws = self._draws.get(self._config)
        if draws is None:
            draws = _may_draw(module)
        self.locked = self.always or draws
        self._drew = False
        return self.locked

    def start(self, step_seed: int) -> None:
        self._seed = step_seed

    def finish(self) -> None:
        """After a step that completed: a locked stage learns whether its forwards drew."""
        if self.locked:
            self._draws[self._config] = self._drew

    @contextmanager
    def forward(self, microbatch: int) -> Iterator[None]:
        """A locked forward of ``microbatch`` on its own generator state."""
        generator = torch.default_generator
        with _holding(self.lock):
            saved = generator.get_state()
            generator.manual_seed(microbatch_seed(self._seed, self.stage, microbatch))
            seeded = generator.get_state()
            try:
                yield
            finally:
                self._drew = self._drew or not torch.equal(generator.get_state(), seeded)
                generator.set_state(saved)

    @property
    def drew(self) -> bool:
        """Whether the stage draws: learned so, or seen drawing in this step's forwards."""
        return self._drew or bool(self._draws.get(self._config))

    @contextmanager
    def hold(self) -> Iterator[None]:
        """A locked backward: no new numbers, but it may set the state and restore it."""
        with _holding(self.lock):
            yield


def begin_step(stages: Sequence[StageRandom], modules: Sequence[nn.Module], train: bool) -> Tensor:
    """Plan a step in the caller's thread; returns the generator state to check at its end.

    Example:
        >>> from batchgraph.pipeline import rng  # the module as imported (one lock)
        >>> random, drop = rng.StageRandom(0, torch.device("cpu")), nn.Dropout()
        >>> _ = rng.begin_step([random], [drop], train=True)
        >>> outer = random.lock
        >>> with random.forward(0):  # a stage's forward, running a pipeline
        ...     _ = rng.begin_step([random], [drop], train=True)
        ...     random.lock is not outer
        True
    """
    held = _HELD.__dict__.get("locks")
    lock = threading.Lock() if held else _LOCK
    for r in stages:
        r.lock = lock
    if any([r.plan(m, train) for r, m in zip(stages, modules)]):
        # One draw per step, in the caller's thread: a fixed seed fixes every stage's numbers.
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        for r in stages:
            r.start(seed)
    return torch.default_generator.get_state()


def end_step(stages: Sequence[StageRandom], before: Tensor) -> None:
    """After a completed step: learn the quiet stages; warn if an unlocked stage drew."""
    for r in stages:
        r.finish()
    if torch.equal(torch.default_generator.get_state(), before):
        return
    cpu = [r.stage for r in stages if r.cpu and not r.locked]
    warnings.warn(
        f"a pipeline stage (one of {cpu}) drew random numbers in a step where it had drawn "
        "none before (a data-dependent draw?): that step's random numbers depended on "
        "thread timing. From now on every stage runs with its own generator state, one at "
        "a time",
        RuntimeWarning,
        stacklevel=5,  # the caller of Pipeline.train_step
    )
    for r in stages:
        r.always = True
