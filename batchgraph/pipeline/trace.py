"""Timelines: what ran (measured) or what a schedule plans (simulated), as pictures.

Both sources produce the same list of :class:`TimelineEvent` (device, action, start,
end): the runtime records measured ones, :func:`batchgraph.pipeline.simulate` returns
planned ones in ``SimulationResult.events``. They export to

* Chrome / Perfetto trace JSON (:func:`to_chrome_trace`, :func:`write_chrome_trace`):
  one process, one thread per device, one complete ("X") event per action; open it in
  ``chrome://tracing`` or https://ui.perfetto.dev;
* a PNG timeline (:func:`draw_timeline`): a row per device, F/B/I/W in distinct
  colours, bubbles left as empty space, a legend. matplotlib is an optional extra
  (``pip install batchgraph[viz]``) and is imported only here, only when drawing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgraph.pipeline.actions import Action, ActionKind

__all__ = ["KIND_COLORS", "TimelineEvent", "draw_timeline", "to_chrome_trace", "write_chrome_trace"]

#: Colour per action kind (forward blue, backward green, I orange, W purple).
KIND_COLORS: dict[ActionKind, str] = {
    ActionKind.FORWARD: "#4C72B0",
    ActionKind.BACKWARD: "#55A868",
    ActionKind.BACKWARD_INPUT: "#DD8452",
    ActionKind.BACKWARD_WEIGHT: "#8172B3",
}

_KIND_NAMES = {
    ActionKind.FORWARD: "forward (F)",
    ActionKind.BACKWARD: "backward (B)",
    ActionKind.BACKWARD_INPUT: "input grad (I)",
    ActionKind.BACKWARD_WEIGHT: "weight grad (W)",
}


@dataclass(frozen=True)
class TimelineEvent:
    """One action that ran (or is planned) on ``device`` from ``start`` to ``end``.

    Times are in any one unit per timeline: seconds for measured events, cost units
    for simulated ones.

    Example:
        >>> e = TimelineEvent(0, Action.parse("0F0"), 0.0, 1.0)
        >>> e.duration
        1.0
    """

    device: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def to_chrome_trace(
    events: Iterable[TimelineEvent], *, scale: float = 1e6, name: str = "batchgraph pipeline"
) -> dict[str, Any]:
    """Build a Chrome/Perfetto trace (the JSON object format) from ``events``.

    Args:
        events: the events.
        scale: multiplies event times to get microseconds, the trace's unit; the default
            suits times in seconds (for unit-cost simulations 1 unit shows as 1 s).
        name: the process name shown in the viewer.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms"}``: metadata events naming the
        process and a thread per device, then one ``"ph": "X"`` event per action with
        ``name`` (``"2F0"``), ``cat`` (the kind letter), ``ts``, ``dur``, ``pid`` 0,
        ``tid`` (the device) and ``args`` (stage, kind, microbatch).

    Example:
        >>> t = to_chrome_trace([TimelineEvent(1, Action.parse("1B0"), 2.0, 4.0)], scale=1.0)
        >>> t["traceEvents"][-1]["name"], t["traceEvents"][-1]["dur"]
        ('1B0', 2.0)
    """
    events = list(events)
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": name}}
    ]
    for device in sorted({e.device for e in events}):
        trace.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": device,
                "args": {"name": f"device {device}"},
            }
        )
    for e in sorted(events, key=lambda e: (e.start, e.device)):
        trace.append(
            {
                "name": str(e.action),
                "cat": e.action.kind.value,
                "ph": "X",
                "ts": e.start * scale,
                "dur": e.duration * scale,
                "pid": 0,
                "tid": e.device,
                "args": {
                    "stage": e.action.stage,
                    "kind": e.action.kind.value,
                    "microbatch": e.action.microbatch,
                },
            }
        )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | Path,
    events: Iterable[TimelineEvent],
    *,
    scale: float = 1e6,
    name: str = "batchgraph pipeline",
) -> Path:
    """Write :func:`to_chrome_trace` of ``events`` to ``path`` as JSON.

    Args:
        path: the file to write (parent folders are created).
        events: the events.
        scale: as in :func:`to_chrome_trace`.
        name: as in :func:`to_chrome_trace`.

    Returns:
        The path written.

    Example:
        >>> import tempfile, os
        >>> p = write_chrome_trace(os.path.join(tempfile.mkdtemp(), "t.json"), [])
        >>> p.exists()
        True
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_chrome_trace(events, scale=scale, name=name), indent=1))
    return out


def _require_matplotlib() -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "draw_timeline needs matplotlib, an optional extra: pip install batchgraph[viz]"
        ) from exc
    return Figure, FigureCanvasAgg, Patch


def draw_timeline(
    events: Sequence[TimelineEvent],
    path: str | Path,
    *,
    title: str | None = None,
    time_unit: str = "time",
) -> Path:
    """Draw ``events`` as a PNG timeline: a row per device, a box per action.

    F, B, I and W have distinct colours (:data:`KIND_COLORS`) and a legend; time with no
    box on a row is a bubble. Each box is labelled with its microbatch (and stage when a
    device runs several stages) when it is wide enough.

    Args:
        events: the events (measured or simulated).
        path: the PNG file to write (parent folders are created).
        title: the figure title.
        time_unit: the x-axis label, e.g. ``"seconds"`` or ``"cost units"``.

    Returns:
        The path written.

    Raises:
        ImportError: if matplotlib is not installed (``pip install batchgraph[viz]``).

    Example:
        >>> import tempfile, os
        >>> ev = [TimelineEvent(0, Action.parse("0F0"), 0.0, 1.0)]
        >>> draw_timeline(ev, os.path.join(tempfile.mkdtemp(), "t.png")).exists()
        True
    """
    figure_cls, canvas_cls, patch_cls = _require_matplotlib()
    devices = sorted({e.device for e in events}) or [0]
    several = len({e.action.stage for e in events}) > len(devices)
    end = max((e.end for e in events), default=1.0) or 1.0
    # Figure + Agg canvas directly (not pyplot): no global backend or figure state.
    fig = figure_cls(
        figsize=(min(24.0, 4.0 + 0.25 * len(events) / len(devices)), 1.0 + 0.6 * len(devices))
    )
    canvas_cls(fig)
    ax = fig.add_subplot(1, 1, 1)
    for e in events:
        row = devices.index(e.device)
        ax.broken_barh(
            [(e.start, e.duration)],
            (row - 0.4, 0.8),
            facecolors=KIND_COLORS[e.action.kind],
            edgecolors="white",
            linewidth=0.5,
        )
        if e.duration >= end / 60:
            label = (
                f"{e.action.stage}:{e.action.microbatch}" if several else str(e.action.microbatch)
            )
            ax.text(
                e.start + e.duration / 2,
                row,
                label,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
    ax.set_yticks(range(len(devices)))
    ax.set_yticklabels([f"device {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(time_unit)
    kinds = [k for k in ActionKind if any(e.action.kind is k for e in events)]
    # Legend above the axes, right-aligned, so it never covers boxes or the x label.
    ax.legend(
        handles=[patch_cls(facecolor=KIND_COLORS[k], label=_KIND_NAMES[k]) for k in kinds],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=max(1, len(kinds)),
        frameon=False,
        fontsize=8,
    )
    if title:
        ax.set_title(title, loc="left")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
