"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and the synchronous baseline.

Each generator returns a :class:`PipelineSchedule`: for each device, its actions in the
order it runs them. ``stages`` (p) is the number of *devices*; with ``chunks=v`` there
are ``p * v`` model stages and device ``d`` runs stages ``d, d + p, d + 2p, ...``.

1F1B for p = 3, m = 4, as :func:`format_schedule` draws it (rows are unit time
steps, blank cells are bubbles)::

    step  dev0  dev1  dev2
       0  0F0
       1  0F1   1F0
       2  0F2   1F1   2F0
       3              2B0
       4        1B0   2F1
       5  0B0   1F2   2B1
       6  0F3   1B1   2F2
       7  0B1   1F3   2B2
       8        1B2   2F3
       9  0B2         2B3
      10        1B3
      11  0B3

Which values are allowed:

* every schedule: ``stages >= 1``, ``microbatches >= 1``;
* ``"gpipe"``, ``"1f1b"``, ``"zb-h1"``, ``"sync"``: ``chunks == 1``;
* ``"interleaved-1f1b"``: any ``chunks >= 1`` and any ``microbatches >= 1`` (see
  :func:`interleaved_1f1b_schedule` for how a last, smaller group of microbatches is
  handled); ``chunks == 1`` is plain 1F1B.
"""

from __future__ import annotations

from collections.abc import Callable

from batchgraph.pipeline.actions import Action, ActionKind, PipelineSchedule

__all__ = [
    "SCHEDULE_NAMES",
    "gpipe_schedule",
    "interleaved_1f1b_schedule",
    "make_schedule",
    "one_f_one_b_schedule",
    "sync_schedule",
    "zb_h1_schedule",
]

_F = ActionKind.FORWARD
_B = ActionKind.BACKWARD
_I = ActionKind.BACKWARD_INPUT
_W = ActionKind.BACKWARD_WEIGHT


def _check_counts(name: str, stages: int, microbatches: int) -> None:
    for arg, value in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{name}: {arg} must be an int >= 1, got {value!r}; "
                "pass the number of devices as stages= and of microbatches as microbatches="
            )


def _schedule(
    name: str, p: int, m: int, v: int, order: dict[int, list[Action]]
) -> PipelineSchedule:
    return PipelineSchedule(name, stages=p * v, devices=p, microbatches=m, chunks=v, order=order)


def gpipe_schedule(stages: int, microbatches: int) -> PipelineSchedule:
    """GPipe: every device runs all its forwards, then all its backwards (seed 001).

    Fill, steady and drain fall out of the dependencies: stage ``s`` starts after ``s``
    steps. The backward runs in reverse microbatch order, so the last stage turns around
    on the microbatch it has just finished. Peak in-flight microbatches: ``m`` on every
    stage; bubble with costs F, B: ``(p-1)/(m+p-1)``.

    Args:
        stages: number of devices p (one model stage each), >= 1.
        microbatches: number of microbatches m, >= 1.

    Returns:
        The schedule.

    Raises:
        ValueError: if a count is not an int >= 1.

    Example:
        >>> s = gpipe_schedule(2, 2)
        >>> [str(a) for a in s.order[1]]
        ['1F0', '1F1', '1B1', '1B0']
    """
    _check_counts("gpipe", stages, microbatches)
    order = {
        s: [Action(s, _F, mb) for mb in range(microbatches)]
        + [Action(s, _B, mb) for mb in reversed(range(microbatches))]
        for s in range(stages)
    }
    return _schedule("gpipe", stages, microbatches, 1, order)


def sync_schedule(stages: int, microbatches: int) -> PipelineSchedule:
    """Seed 000's baseline: all forwards of all microbatches, then the whole backward.

    Per device this is GPipe's shape with the backward in ascending microbatch order, the
    order a plain loop over the batch takes. Expressed as per-microbatch actions, the
    backward of one microbatch can still overlap another's on the next device; a runtime
    that wants seed 000's unpipelined backward runs each device's B's as one call.

    Args:
        stages: number of devices p, >= 1.
        microbatches: number of microbatches m, >= 1.

    Returns:
        The schedule.

    Raises:
        ValueError: if a count is not an int >= 1.

    Example:
        >>> [str(a) for a in sync_schedule(2, 2).order[0]]
        ['0F0', '0F1', '0B0', '0B1']
    """
    _check_counts("sync", stages, microbatches)
    order = {
        s: [Action(s, _F, mb) for mb in range(microbatches)]
        + [Action(s, _B, mb) for mb in range(microbatches)]
        for s in range(stages)
    }
    return _schedule("sync", stages, microbatches, 1, order)


def _one_f_one_b_order(s: int, p: int, m: int) -> list[tuple[ActionKind, int]]:
    """1F1B's (kind, microbatch) order on stage ``s``: warm-up, steady 1F1B, cool-down."""
    warmup = min(p - s - 1, m)
    seq: list[tuple[ActionKind, int]] = [(_F, mb) for mb in range(warmup)]
    for i in range(m - warmup):
        seq += [(_F, warmup + i), (_B, i)]
    seq += [(_B, mb) for mb in range(m - warmup, m)]
    return seq


def one_f_one_b_schedule(stages: int, microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-Flush, seed 004): warm-up, one forward one backward, cool-down.

    Stage ``s`` runs ``min(p-s-1, m)`` warm-up forwards, then alternates one forward and
    one backward, then finishes the remaining backwards. At most ``min(m, p-s)``
    microbatches are in flight on stage ``s`` (GPipe holds ``m``) while the bubble stays
    GPipe's ``(p-1)/(m+p-1)``.

    Args:
        stages: number of devices p, >= 1.
        microbatches: number of microbatches m, >= 1.

    Returns:
        The schedule.

    Raises:
        ValueError: if a count is not an int >= 1.

    Example:
        >>> [str(a) for a in one_f_one_b_schedule(2, 3).order[0]]
        ['0F0', '0F1', '0B0', '0F2', '0B1', '0B2']
    """
    _check_counts("1f1b", stages, microbatches)
    order = {
        s: [Action(s, k, mb) for k, mb in _one_f_one_b_order(s, stages, microbatches)]
        for s in range(stages)
    }
    return _schedule("1f1b", stages, microbatches, 1, order)


def zb_h1_schedule(stages: int, microbatches: int) -> PipelineSchedule:
    """ZB-H1 (after the zero-bubble paper's handcrafted schedule 1): 1F1B, backward split.

    Each backward ``B`` becomes ``I`` (input gradient, on the critical path) and ``W``
    (weight gradient, deferred). The F/I skeleton is exactly 1F1B's, so at most
    ``min(m, p-s)`` microbatches are between F and I on stage ``s``, as in 1F1B. Stage
    ``s`` runs each W ``s`` microbatches late (``W(j)`` right after ``I(j+s)``): the first
    stage runs ``I W`` back to back, the last stage holds ``p-1`` W's back. Why this
    way round: the last microbatch's gradient still has to travel down ``p-1`` stages
    after the last stage computes it, so the last stage has the most time to fill at the
    end and the first stage the least; the held-back W's fill exactly that time, where
    1F1B's stages wait for gradients.

    With F = I = W = 1 (and free transfers) the makespan is ``max(3m+p-1, 2m+2p-1)``:
    for ``m >= p`` each device idles ``p-1`` units against 1F1B's ``3(p-1)`` with
    F = 1, B = 2 (a third); for ``m < p`` the makespan is the lower bound
    ``2p-1 + 2m`` (the first I cannot start before ``2p-1``, then ``m`` I's and ``m``
    W's remain on the first stage).

    Memory: what 1F1B bounds (F done, I not) is unchanged; microbatches waiting for
    their W (F done, W not; they keep only what W needs) peak at ``min(m, p)`` on every
    stage, which is 1F1B's peak on its first stage.

    Args:
        stages: number of devices p, >= 1.
        microbatches: number of microbatches m, >= 1.

    Returns:
        The schedule.

    Raises:
        ValueError: if a count is not an int >= 1.

    Example:
        >>> [str(a) for a in zb_h1_schedule(2, 2).order[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
    """
    _check_counts("zb-h1", stages, microbatches)
    p, m = stages, microbatches
    order: dict[int, list[Action]] = {}
    for s in range(p):
        delay = s
        actions: list[Action] = []
        next_w = 0
        for kind, mb in _one_f_one_b_order(s, p, m):
            if kind is _F:
                actions.append(Action(s, _F, mb))
                continue
            actions.append(Action(s, _I, mb))
            # After I(mb), run the W that is ``delay`` microbatches old, if any.
            if mb - next_w >= delay:
                actions.append(Action(s, _W, next_w))
                next_w += 1
        actions += [Action(s, _W, mb) for mb in range(next_w, m)]
        order[s] = actions
    return _schedule("zb-h1", p, m, 1, order)


def _interleaved_groups(p: int, m: int) -> list[int]:
    """Sizes of the microbatch groups that interleaved 1F1B walks chunk by chunk.

    Megatron uses groups of exactly ``p`` (so it needs ``m % p == 0``). A group smaller
    than ``p`` deadlocks: a device would come back for the next chunk of a microbatch
    before that microbatch has gone round the other ``p - 1`` devices, while the device
    it waits for is itself waiting on a backward. So: ``m <= p`` is one group of ``m``
    (the round trip then simply waits), and ``m > p`` is ``m // p`` groups as even as
    possible (every group has ``p`` or more microbatches, larger ones first).
    """
    if m <= p:
        return [m]
    k = m // p
    return [m // k + (1 if i < m % k else 0) for i in range(k)]


def interleaved_1f1b_schedule(stages: int, microbatches: int, chunks: int) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM): ``chunks`` model stages per device, 1F1B over them.

    Device ``d`` runs stages ``d, d+p, ..., d+(v-1)p``. Microbatches are taken in groups;
    within a group the device runs chunk 0 of every microbatch, then chunk 1, and so on
    (the backward walks the chunks in reverse). Device ``d`` warms up with
    ``2(p-d-1) + (v-1)g`` forwards (``g`` the first group's size), then alternates one
    forward and one backward, then drains. With costs F, B per chunk and ``m >= p`` each
    device idles ``(p-1)(F+B)``, so the bubble is ``(p-1)/(v*m + p-1)``: v times smaller
    than 1F1B's for the same per-device work.

    Any ``m >= 1`` is allowed. Megatron requires ``m % p == 0``; here ``m > p`` that is
    not a multiple of ``p`` is split into ``m // p`` groups of sizes as even as possible
    (each at least ``p``, e.g. p=4, m=10: groups 5, 5), and ``m <= p`` is one group (it
    runs, with a larger bubble: a microbatch's round trip over the devices cannot be
    hidden). ``chunks=1`` is exactly :func:`one_f_one_b_schedule`.

    Args:
        stages: number of devices p, >= 1.
        microbatches: number of microbatches m, >= 1.
        chunks: model stages per device v, >= 1 (``p * v`` stages in total).

    Returns:
        The schedule (its ``stages`` is ``p * v``).

    Raises:
        ValueError: if a count is not an int >= 1.

    Example:
        >>> s = interleaved_1f1b_schedule(2, 2, 2)
        >>> [str(a) for a in s.order[1]]
        ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1']
    """
    _check_counts("interleaved-1f1b", stages, microbatches)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"interleaved-1f1b: chunks must be an int >= 1, got {chunks!r}")
    p, m, v = stages, microbatches, chunks
    if v == 1:
        base = one_f_one_b_schedule(p, m)
        return _schedule("interleaved-1f1b", p, m, 1, base.order)
    groups = _interleaved_groups(p, m)
    forward: list[tuple[int, int]] = []  # (microbatch, chunk) in the order every device runs F
    first = 0
    for size in groups:
        for chunk in range(v):
            forward += [(mb, chunk) for mb in range(first, first + size)]
        first += size
    backward = [(mb, v - 1 - chunk) for mb, chunk in forward]
    total = m * v
    order: dict[int, list[Action]] = {}
    for d in range(p):
        warmup = min(2 * (p - d - 1) + (v - 1) * groups[0], total)
        actions = [Action(c * p + d, _F, mb) for mb, c in forward[:warmup]]
        for (fmb, fc), (bmb, bc) in zip(forward[warmup:], backward, strict=False):
            actions += [Action(fc * p + d, _F, fmb), Action(bc * p + d, _B, bmb)]
        actions += [Action(c * p + d, _B, mb) for mb, c in backward[total - warmup :]]
        order[d] = actions
    return _schedule("interleaved-1f1b", p, m, v, order)


_GENERATORS: dict[str, Callable[[int, int], PipelineSchedule]] = {
    "gpipe": gpipe_schedule,
    "1f1b": one_f_one_b_schedule,
    "zb-h1": zb_h1_schedule,
    "sync": sync_schedule,
}

#: The names :func:`make_schedule` accepts.
SCHEDULE_NAMES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "sync")


def make_schedule(
    name: str, *, stages: int, microbatches: int, chunks: int = 1
) -> PipelineSchedule:
    """Build the named schedule.

    Args:
        name: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``,
            ``"sync"`` (case-insensitive; ``_`` may stand for ``-``).
        stages: number of devices p, >= 1.
        microbatches: number of microbatches m, >= 1.
        chunks: model stages per device v; only ``"interleaved-1f1b"`` takes ``v > 1``.

    Returns:
        The schedule; ``.order[d]`` is device ``d``'s action list.

    Raises:
        ValueError: for an unknown name, a count below 1, or ``chunks != 1`` with a
            schedule that has one stage per device; the message lists the allowed values.

    Example:
        >>> s = make_schedule("1f1b", stages=2, microbatches=2)
        >>> [str(a) for a in s.order[0]]
        ['0F0', '0F1', '0B0', '0B1']
    """
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    if key == "interleaved-1f1b":
        return interleaved_1f1b_schedule(stages, microbatches, chunks)
    if chunks != 1:
        raise ValueError(
            f"{key} runs one stage per device, so chunks must be 1 (got chunks={chunks!r}); "
            "use 'interleaved-1f1b' for several chunks per device"
        )
    return _GENERATORS[key](stages, microbatches)
