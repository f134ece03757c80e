"""The ``batchgraph`` command.

Each subcommand lives in its own ``_add_<name>`` function that registers its arguments
and its handler (``func``), so adding a subcommand touches only this registry::

    batchgraph schedule 1f1b --stages 4 --microbatches 8 --png out.png
    python -m batchgraph schedule zb-h1 -p 4 -m 8 --costs 1,1,1,1 --trace out.json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgraph.pipeline import ActionCosts, PipelineSchedule

__all__ = ["at_least", "build_parser", "main"]

_Handler = Callable[[argparse.Namespace], int]


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=`` for an int flag that must be ``>= minimum``.

    A value out of range then fails as argparse fails any bad value: the usage, the
    flag and the value, exit status 2, instead of a traceback from deep inside the
    run (``range() arg 3 must not be zero`` for a batch size of 0).

    Args:
        minimum: the smallest value accepted.

    Returns:
        A converter for ``add_argument(..., type=at_least(1))``.

    Example:
        >>> parser = argparse.ArgumentParser(prog="demo")
        >>> _ = parser.add_argument("--examples", type=at_least(1), default=4)
        >>> parser.parse_args(["--examples", "2"]).examples
        2
        >>> at_least(1)("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an integer >= 1, got 0
    """

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    # argparse names the type in its own messages ("invalid at_least value").
    convert.__name__ = f"integer >= {minimum}"
    return convert


def _run_schedule(args: argparse.Namespace) -> int:
    # Imported here so `batchgraph --help` and other subcommands do not pay for the
    # pipeline imports.
    from batchgraph.pipeline import ActionCosts, make_schedule

    try:
        costs = ActionCosts.parse(args.costs) if args.costs else ActionCosts()
        for option, path in (("--png", args.png), ("--trace", args.trace)):
            if path and os.path.isdir(path):
                raise ValueError(f"{option} {path!r} is a folder; name the file to write in it")
        schedule = make_schedule(
            args.name, stages=args.stages, microbatches=args.microbatches, chunks=args.chunks
        )
    except ValueError as exc:
        print(f"batchgraph schedule: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _report(args, schedule, costs)
    except OSError as exc:  # a path that cannot be written: say so, without a traceback
        print(f"batchgraph schedule: error: cannot write {exc.filename!r}: {exc.strerror}",
              file=sys.stderr)
        return 1


def _report(args: argparse.Namespace, schedule: PipelineSchedule, costs: ActionCosts) -> int:
    """Print the schedule and its simulation; write the trace and picture asked for."""
    from batchgraph.pipeline import draw_timeline, format_schedule, simulate, write_chrome_trace

    result = simulate(schedule, costs)
    print(format_schedule(schedule))
    print()
    print(
        f"simulated with costs F={costs.forward} B={costs.backward} I={costs.backward_input} "
        f"W={costs.backward_weight} transfer={costs.transfer}"
    )
    print(result.summary())
    if args.trace:
        path = write_chrome_trace(args.trace, result.events, scale=1e3, name=schedule.name)
        print(f"wrote Chrome/Perfetto trace to {path} (1 cost unit shows as 1 ms)")
    if args.png:
        title = f"{schedule.name}: p={schedule.devices}, m={schedule.microbatches}"
        if schedule.chunks > 1:
            title += f", v={schedule.chunks}"
        try:
            path = draw_timeline(result.events, args.png, title=title, time_unit="cost units")
        except ImportError as exc:
            print(f"batchgraph schedule: error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote timeline to {path}")
    return 0


def _add_schedule(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from batchgraph.pipeline.schedules import SCHEDULE_NAMES

    p = sub.add_parser(
        "schedule",
        help="print a pipeline schedule's grid and simulated stats",
        description="Build a pipeline schedule, print its step x device grid, simulate it "
        "and print makespan, bubble and peak in-flight microbatches per stage.",
    )
    p.add_argument("name", choices=SCHEDULE_NAMES, help="the schedule")
    p.add_argument("-p", "--stages", type=at_least(1), default=4, help="devices (default 4)")
    p.add_argument("-m", "--microbatches", type=at_least(1), default=8, help="microbatches (default 8)")
    p.add_argument(
        "-v", "--chunks", type=at_least(1), default=1, help="stages per device (interleaved-1f1b only)"
    )
    p.add_argument(
        "--costs",
        metavar="F,B,I,W[,T]",
        help="action costs, T the transfer cost (default 1,2,1,1,0)",
    )
    p.add_argument("--png", metavar="PATH", help="also draw the timeline to this PNG")
    p.add_argument("--trace", metavar="PATH", help="also write a Chrome/Perfetto trace JSON")
    p.set_defaults(func=_run_schedule)


# The registry: one entry per subcommand.
_COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    _add_schedule,
)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand.

    Returns:
        The parser; each subcommand sets ``func``, its handler.

    Example:
        >>> build_parser().parse_args(["schedule", "1f1b", "-p", "2"]).stages
        2
    """
    parser = argparse.ArgumentParser(prog="batchgraph", description="batchgraph tools")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


_NEGATIVE_STARTS = frozenset({"-.", *(f"-{d}" for d in range(10))})


def _costs_joined(argv: list[str]) -> list[str]:
    """``--costs -1,2,1,1`` as ``--costs=-1,2,1,1``: argparse takes a value starting
    with ``-`` for an option ("expected one argument"); joined, the value reaches the
    costs' own check, which says what is wrong with it."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--costs" and arg[:2] in _NEGATIVE_STARTS:
            out[-1] = f"--costs={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``batchgraph`` command.

    Args:
        argv: the arguments (without the program name); ``sys.argv[1:]`` when None.

    Returns:
        The exit status: 0 on success (and after ``--help``), 2 for bad arguments
        (argparse's among them, after it printed the usage), 1 when an optional extra
        is missing or an output file cannot be written.

    Example:
        >>> main(["schedule", "gpipe", "--stages", "2", "--microbatches", "1"])  # doctest: +ELLIPSIS
        gpipe: 2 devices, 2 stages, 1 microbatches ...
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(_costs_joined(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as exc:
        # argparse exits on a bad value (2, after printing the usage) and after --help
        # (0): return that status, as for every other outcome, so that a caller of
        # main() gets the status the docstring promises instead of an exception.
        return exc.code if isinstance(exc.code, int) else 2
    func: _Handler | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)
