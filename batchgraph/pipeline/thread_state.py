"""The caller's per-thread torch state, carried to the stage threads of a step.

Some of torch's state belongs to the thread that sets it, and the threads backend runs
every stage on a device thread of its own, so a ``with`` block around
``pipe.train_step(...)`` would reach none of the stages. What the caller's thread has in
force is captured at the start of each step (:meth:`ThreadState.capture`) and entered
on the device threads::

    caller's thread                      device thread
    ───────────────                      ─────────────
    ThreadState.capture():               ThreadState.job(), around the whole step:
      autocast, inference mode,            saved-tensors hooks (or their disabled
      saved-tensors hooks (top pair),      state), inference mode, the step's grad
      disabled-hooks message,              mode, intra-op threads: forwards, the
      intra-op thread count                loss and backwards
                                         Stage.autocast, around each forward and the
                                           loss only (backwards follow autograd, as
                                           on one device)

Carried: ``torch.autocast``; ``torch.inference_mode()`` (``forward`` only: a training
step refuses it); the innermost ``torch.autograd.graph.saved_tensors_hooks`` pair (e.g.
``save_on_cpu``: only the innermost pair applies, on one device too) and
``disable_saved_tensors_hooks``; the intra-op thread count (``torch.set_num_threads``,
per thread under OpenMP). Global already (nothing to carry): anomaly detection,
deterministic algorithms, the default dtype, ``torch.backends`` flags. Not carried: the
grad mode (a training step records gradients, ``forward`` records none); torch function
and dispatch modes (``with torch.device(...)``, ``FlopCounterMode``: a mode object is
not safe to enter on several threads at once, so a step in one warns); the current CUDA
stream and device.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from batchgraph.autocasting import AutocastState, autocast_state
from batchgraph.pipeline.errors import PipelineConfigError

__all__ = ["ThreadState", "innermost_hooks", "saved_tensors_hooks", "saved_tensors_hooks_enabled"]

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]

_autograd_c: Any = torch._C._autograd


def _hooks_reader() -> Callable[[], Hooks | None] | None:
    """How this torch reads the innermost saved-tensors hooks, or None if it cannot.

    ``_top_saved_tensors_default_hooks(ignore_is_tracing)`` (torch 2.8 and later; the
    argument came with it or shortly after): its own function so a test can stand in for
    a torch without it.
    """
    top = getattr(_autograd_c, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    try:
        top(True)
    except TypeError:  # an older signature, without the argument
        return lambda: top()  # type: ignore[no-any-return]
    return lambda: top(True)  # type: ignore[no-any-return]


_read_hooks = _hooks_reader()


def _disabled_message() -> str | None:
    """The message of ``disable_saved_tensors_hooks`` in force in this thread, or None."""
    read = getattr(_autograd_c, "_saved_tensors_hooks_get_disabled_error_message", None)
    return None if read is None else read()  # type: ignore[no-any-return]


def _hooks_in_force() -> bool:
    """Whether this thread has saved-tensors hooks, for a torch that cannot read them.

    Disabling the hooks fails while a pair is in force (``fail_if_non_empty``); the
    thread's disabled state is restored either way.
    """
    disable = getattr(_autograd_c, "_saved_tensors_hooks_disable", None)
    enable = getattr(_autograd_c, "_saved_tensors_hooks_enable", None)
    if disable is None or enable is None or _disabled_message() is not None:
        return False  # disabled: no pair can be in force
    try:
        disable("batchgraph probe")
    except RuntimeError:
        return True
    finally:
        enable()
    return False


def innermost_hooks() -> Hooks | None:
    """The innermost saved-tensors hooks pair in force in the calling thread, or None
    (also where this torch cannot read them: see :func:`saved_tensors_hooks`).

    Example:
        >>> innermost_hooks() is None
        True
    """
    return None if _read_hooks is None else _read_hooks()


def saved_tensors_hooks() -> Hooks | None:
    """The innermost ``saved_tensors_hooks`` pair in force in the calling thread, or None.

    Raises:
        PipelineConfigError: if a pair is in force but this torch cannot read it (then it
            could not be applied on the stage threads).

    Example:
        >>> saved_tensors_hooks() is None
        True
        >>> pack, unpack = (lambda t: t), (lambda t: t)
        >>> with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ...     saved_tensors_hooks() == (pack, unpack)
        True
    """
    if _read_hooks is not None:
        hooks = innermost_hooks()
        return None if hooks is None else (hooks[0], hooks[1])
    if _hooks_in_force():
        raise PipelineConfigError(
            "the step was called inside torch.autograd.graph.saved_tensors_hooks (or "
            f"save_on_cpu), but this torch ({torch.__version__}) cannot read the hooks to "
            "apply them on the stage threads (it has no "
            "torch._C._autograd._top_saved_tensors_default_hooks; torch 2.8 and later "
            "have it): upgrade torch, or enter the hooks inside the stage modules' "
            "forward (a wrapper module), or call the step outside them"
        )
    return None


def _dispatch_modes() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def _warn_modes() -> None:
    from torch.overrides import _get_current_function_mode_stack

    modes = [*_get_current_function_mode_stack(), *_dispatch_modes()]  # type: ignore[no-untyped-call]
    names = ", ".join(sorted({type(m).__name__ for m in modes}))
    warnings.warn(
        f"torch modes are in force in the thread that runs the pipeline step ({names}: "
        "e.g. with torch.device(...), FlopCounterMode), but the threads backend runs the "
        "stages on threads of their own, where these modes are not: they see none of the "
        "stages' work. Enter the mode inside the stage modules' forward, or use "
        "backend='torch.distributed', whose stages run in the calling thread",
        RuntimeWarning,
        stacklevel=6,  # the caller of Pipeline.train_step / forward
    )


@contextlib.contextmanager
def saved_tensors_hooks_enabled() -> Iterator[None]:
    """Lift ``disable_saved_tensors_hooks`` for the block (restored afterwards).

    Example:
        >>> with torch.autograd.graph.disable_saved_tensors_hooks("off"):
        ...     with saved_tensors_hooks_enabled():
        ...         print(_disabled_message())
        ...     print(_disabled_message())
        None
        off
    """
    message = _disabled_message()
    if message is None:
        yield
        return
    _autograd_c._saved_tensors_hooks_enable()
    try:
        yield
    finally:
        _autograd_c._saved_tensors_hooks_disable(message)


@dataclass(frozen=True)
class ThreadState:
    """What one step carries from the calling thread to the stage threads.

    Attributes:
        autocast: the caller's autocast state (None: off).
        inference: whether the caller is in ``torch.inference_mode()``.
        hooks: the innermost saved-tensors hooks pair in force, or None.
        hooks_disabled: the message of ``disable_saved_tensors_hooks`` in force, or None.
        num_threads: the caller's intra-op thread count (``torch.get_num_threads()``).
    """

    autocast: AutocastState | None = None
    inference: bool = False
    hooks: Hooks | None = None
    hooks_disabled: str | None = None
    num_threads: int | None = None

    @classmethod
    def capture(cls) -> ThreadState:
        """The calling thread's state (cheap: a few C calls).

        Warns (``RuntimeWarning``) when torch function or dispatch modes are in force:
        they stay in the calling thread and the stages run without them.
        """
        if torch._C._len_torch_function_stack() or _dispatch_modes():
            _warn_modes()
        return cls(
            autocast=autocast_state(),
            inference=torch.is_inference_mode_enabled(),
            hooks=saved_tensors_hooks(),
            hooks_disabled=_disabled_message(),
            num_threads=torch.get_num_threads(),
        )

    @contextlib.contextmanager
    def job(self, *, grad: bool) -> Iterator[None]:
        """Around a device thread's whole step: grad mode, inference mode and the
        saved-tensors hooks (packed in forwards and the loss; a backward that records,
        e.g. a reentrant checkpoint's recomputation, packs too, as on one device), and
        the caller's intra-op thread count (per thread too: ``torch.set_num_threads``
        called after the pipeline was built reaches its threads at the next step)."""
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            stack.enter_context(torch.inference_mode(self.inference))
            if self.hooks is not None:
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))
            elif self.hooks_disabled is not None:
                stack.enter_context(
                    torch.autograd.graph.disable_saved_tensors_hooks(self.hooks_disabled)
                )
            yield
