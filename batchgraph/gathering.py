"""Gather plans: how a step's batched inputs are taken from earlier outputs.

Every value lives where the step that made it left it: row ``r`` of output leaf ``l``
of store ``s`` (one store per step), packed in one int ``code``. A step's inputs are
rows of many stores, in its own node order. Gathering them store by store costs one
``index_select`` per store, a ``cat`` and a permutation, forward and backward; for a
TreeLSTM's deep levels that is a dozen or more sources per step.

So values travel in *pools*, one per per-example spec (the hand-batched TreeLSTM's
frontier, generalized). When a step gathers from a pool, its one ``index_select``
takes the rows the step needs *and* every row of the pool that a later step still
gathers (the survivors); the survivors' slice is *carried* to the pool's next
gather, together with the outputs made in between::

    cat([carry, outputs since]) ──index_select──▶ [ this step's inputs | survivors ]
                                                     │                    │
                                                     ▼                    ▼
                                                the batched call    the next carry

A gather then reads one carry and the few stores made since its pool was last
gathered: two ops in the usual case, however deep the step. Rows read only much later
(more than ``CARRY_HORIZON`` steps ahead) stay in their stores once they are more than
a few: carried, they would be copied at every gather until then. Where nothing survives
and each input position's rows lie in one source (a decoder step: the embedded
tokens, and the state rows of the examples still running), the plan may be *direct*:
each position takes a view of its source where its rows are one run of it, else an
``index_select`` of its rows, with no ``cat`` (copying both sources into one tensor
only to split it again). It is taken when it launches no more copies than the cat and
permutation would. And an output that later steps read whole (an input that q, k and
v projections all read) is not carried when the gather copies nothing without it: it
stays in place, a view for each step that reads it.

Rows of older stores (earlier computes of a coroutine run, per-example lists) come
as a slice, the whole store when at least half of it is used (to share the cat; a
direct plan has none, so it copies only the rows), else an ``index_select`` of its
rows.

Plans are plain data (ints, ranges and lists), so schedules pickle.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import repeat
from math import prod
from typing import Any

from batchgraph.graph import LEAF_SHIFT, ROW_MASK, STORE_SHIFT
from batchgraph.specs import OutSpec, TensorSpec

__all__ = ["CARRY", "GatherPlan", "GatherPlanner", "plan_gather"]

LEAF_MASK = (1 << (STORE_SHIFT - LEAF_SHIFT)) - 1

# A part of a gather: (store id, leaf, rows), rows a range (a slice of the source) or
# an explicit list of rows; or (CARRY, pool, range) for the rows a pool carries.
Part = tuple[int, int, Any]
CARRY = -1
# A direct plan: per input position, its part and either the first of its run of rows
# (a view) or its rows (an index_select of that part).
Direct = list[tuple[int, "int | list[int]"]]

# Carrying a row costs a copy at every gather of its pool until its last use (and, in
# backward, one more); leaving it in its store costs one more part (an op) where it is
# used. Rows used within CARRY_HORIZON steps ride along; rows used later are left in
# their stores once they hold more than CARRY_FAR_ELEMENTS elements in all. Without
# that bound a BiLSTM tagger carried every word's states (read once, by the output
# layer, after both directions) through every step: gathers moved 588k rows for one
# batch of 64 sentences, 31k with it (benchmarks/tagger.py).
CARRY_HORIZON = 16
CARRY_FAR_ELEMENTS = 1 << 12


@dataclass
class GatherPlan:
    """Gather the inputs at ``positions`` (same per-example spec) in one go.

    The gathered tensor is ``cat(parts)[perm]`` (no ``perm`` when already in order):
    ``len(positions) * B`` rows, position by position, each in node order, then
    ``keep`` surviving rows that become the new carry of ``pool``. A ``direct`` plan
    has no ``perm`` and no cat: with ``(part, rows) = direct[i]``, position ``i`` is
    rows ``rows:rows + B`` of part ``part`` (a view) or, for a list, those rows of it.
    """

    positions: list[int]
    parts: list[Part]
    perm: list[int] | None
    keep: int = 0
    pool: int = -1
    direct: Direct | None = None


def _store_parts(
    distinct: list[int], sizes: list[int], offset: int, whole: bool = True
) -> tuple[list[Part], dict[int, int], int]:
    """Parts that hold the sorted ``distinct`` codes, where each lands, and the new offset.

    Sorting groups codes by (store, leaf) and orders rows within each group. Each
    group becomes one part: a slice when its rows are contiguous; the whole source (a
    free view; the permutation picks rows) when it uses at least half of it and
    ``whole`` allows it; else an ``index_select`` of its rows.
    """
    parts: list[Part] = []
    where: dict[int, int] = {}
    start = 0
    total = len(distinct)
    while start < total:
        column = distinct[start] >> LEAF_SHIFT
        stop = bisect_left(distinct, (column + 1) << LEAF_SHIFT, start)
        first = distinct[start] & ROW_MASK
        last = distinct[stop - 1] & ROW_MASK
        store, leaf = column >> (STORE_SHIFT - LEAF_SHIFT), column & LEAF_MASK
        used = stop - start
        group = distinct[start:stop]
        if last - first + 1 == used:  # distinct and sorted: contiguous
            parts.append((store, leaf, range(first, last + 1)))
            where.update(zip(group, range(offset, offset + used)))
            offset += used
        elif whole and sizes[store] > 0 and 2 * used >= sizes[store]:
            parts.append((store, leaf, range(0, sizes[store])))
            where.update(zip(group, [offset + (c & ROW_MASK) for c in group]))
            offset += sizes[store]
        else:
            parts.append((store, leaf, [c & ROW_MASK for c in group]))
            where.update(zip(group, range(offset, offset + used)))
            offset += used
        start = stop
    return parts, where, offset


def plan_gather(positions: list[int], codes: list[int], sizes: list[int]) -> GatherPlan:
    """A gather of ``codes`` straight from their stores (no pool).

    ``sizes[s]`` is the row count of store ``s`` (-1 for per-example lists).
    """
    distinct = sorted(set(codes))
    parts, where, total = _store_parts(distinct, sizes, 0)
    perm = list(map(where.__getitem__, codes))
    return GatherPlan(positions, parts, None if _identity(perm, total) else perm)


def _identity(perm: list[int], total: int) -> bool:
    return len(perm) == total and perm == list(range(total))


class GatherPlanner:
    """Plans the gathers of one schedule, step by step, with carried pools.

    Args:
        sizes: rows per store (earlier stores and this schedule's), -1 for lists.
        last_use: for each value code, the last step of the schedule that gathers it.
        pool_specs: the per-example specs some gather of the schedule reads.
    """

    def __init__(
        self, sizes: list[int], last_use: dict[int, int], pool_specs: dict[TensorSpec, int]
    ) -> None:
        self.sizes = sizes
        self.last_use = last_use
        self.pools = pool_specs
        self.row_numel = {pool: prod(spec.shape) for spec, pool in pool_specs.items()}
        self.carry: dict[int, list[int]] = {}  # pool -> codes of its carried rows
        self.fresh: dict[int, list[tuple[int, int]]] = {}  # pool -> outputs since

    def produced(self, store: int, leaf_specs: list[OutSpec]) -> None:
        """Store ``store`` (a stacked step's outputs) joins the pools of its leaves."""
        pools = self.pools
        for leaf, spec in enumerate(leaf_specs):
            pool = pools.get(spec) if type(spec) is TensorSpec else None
            if pool is not None:
                self.fresh.setdefault(pool, []).append((store, leaf))

    def gather(self, step: int, positions: list[int], codes: list[int], spec: Any) -> GatherPlan:
        """The plan for ``codes`` (rows of ``spec``) needed by step ``step``."""
        pool = self.pools[spec]
        carried = self.carry.pop(pool, None)
        fresh = self.fresh.pop(pool, [])
        used_until = self.last_use.get
        # A carried row a later step reads is carried on, so that plan would copy: not
        # tried (a BiLSTM tagger's gathers tried it 116 times in a batch, in vain).
        if fresh and not (carried and any(used_until(c, -1) > step for c in carried)):
            # Fresh outputs that later steps need whole are left for them, not carried,
            # when this gather then copies nothing: carried, they would cost a select
            # (and a cat) here. Those this step reads it takes in place; the others it
            # leaves out (q, k and v projections of one input: three views).
            whole = self._needed_whole(step, fresh)
            if whole:
                read = {c >> LEAF_SHIFT for c in codes}
                taken = [f for f in fresh if _column(f) not in whole or _column(f) in read]
                plan, survivors = self._plan(step, positions, codes, pool, carried, taken,
                                             whole)
                if not survivors and self._copy_free(plan):
                    self.fresh[pool] = [f for f in fresh if _column(f) in whole]
                    return plan
        plan, survivors = self._plan(step, positions, codes, pool, carried, fresh, set())
        if survivors:
            self.carry[pool] = survivors
        return plan

    def _needed_whole(self, step: int, fresh: list[tuple[int, int]]) -> set[int]:
        """The columns (``code >> LEAF_SHIFT``) of the ``fresh`` outputs every row of
        which a step after ``step`` reads."""
        used_until = self.last_use.get
        whole = set()
        for store, leaf in fresh:
            column = _column((store, leaf))
            first = column << LEAF_SHIFT
            if all(used_until(c, -1) > step for c in range(first, first + self.sizes[store])):
                whole.add(column)
        return whole

    def _copy_free(self, plan: GatherPlan) -> bool:
        """Whether ``plan`` passes views only (no cat, select or stack)."""
        if plan.perm is not None or _copies(plan.parts) or any(
            sid != CARRY and self.sizes[sid] < 0 for sid, _, _ in plan.parts
        ):
            return False
        if plan.direct is None:
            return len(plan.parts) == 1
        return all(type(rows) is int for _, rows in plan.direct)

    def _plan(
        self, step: int, positions: list[int], codes: list[int], pool: int,
        carried: list[int] | None, fresh: list[tuple[int, int]], whole: set[int],
    ) -> tuple[GatherPlan, list[int]]:
        """The plan from the ``carried`` rows, the ``fresh`` outputs and older stores,
        and the rows it carries on (the survivors, but for the columns in ``whole``)."""
        parts: list[Part] = []
        row_of: dict[int, int] = {}
        offset = 0
        if carried:
            offset = len(carried)
            parts.append((CARRY, pool, range(0, offset)))
            row_of.update(zip(carried, range(offset)))
        for store, leaf in fresh:
            size = self.sizes[store]
            first = (store << STORE_SHIFT) | (leaf << LEAF_SHIFT)
            parts.append((store, leaf, range(0, size)))
            row_of.update(zip(range(first, first + size), range(offset, offset + size)))
            offset += size
        pooled, total = len(parts), offset
        older: list[int] = []
        try:
            perm = list(map(row_of.__getitem__, codes))
        except KeyError:  # rows of older stores
            older = sorted({c for c in codes if c not in row_of})
            more, where, total = _store_parts(older, self.sizes, offset)
            parts.extend(more)
            row_of.update(where)
            perm = list(map(row_of.__getitem__, codes))
        used_until = self.last_use.get
        survivors = [c for c in row_of if used_until(c, -1) > step
                     and (not whole or c >> LEAF_SHIFT not in whole)]
        if survivors and len(survivors) * self.row_numel[pool] > CARRY_FAR_ELEMENTS:
            horizon = step + CARRY_HORIZON
            near = [c for c in survivors if used_until(c, -1) <= horizon]
            if (len(survivors) - len(near)) * self.row_numel[pool] > CARRY_FAR_ELEMENTS:
                survivors = near
        if survivors:
            perm.extend(map(row_of.__getitem__, survivors))
            return GatherPlan(positions, parts, perm, len(survivors), pool), survivors
        identity = _identity(perm, total)
        if len(parts) > 1 or not identity:
            # A direct plan is taken when it launches no more copies than this one (its
            # parts' selects, a cat, a perm); it never copies more rows.
            launches = _copies(parts) + (len(parts) > 1) + (not identity)
            size = len(codes) // len(positions)
            direct = _direct(parts, perm, size, launches - _copies(parts))
            if direct is not None:
                return GatherPlan(positions, parts, None, 0, pool, direct), []
            if older:
                # An older store taken whole shares the cat with the other parts; in a
                # plan with no cat, only its rows are copied.
                more, where, _ = _store_parts(older, self.sizes, offset, whole=False)
                row_of.update(where)
                rows = parts[:pooled] + more
                direct = _direct(rows, list(map(row_of.__getitem__, codes)), size,
                                 launches - _copies(rows))
                if direct is not None:
                    return GatherPlan(positions, rows, None, 0, pool, direct), []
        return GatherPlan(positions, parts, None if identity else perm, 0, pool), []


def _column(output: tuple[int, int]) -> int:
    """The column of a (store, leaf) output: the high bits its value codes share."""
    return (output[0] << (STORE_SHIFT - LEAF_SHIFT)) | output[1]


def _copies(parts: list[Part]) -> int:
    """Launches that take ``parts`` (an ``index_select`` for each explicit row list)."""
    return sum(type(rows) is list for _, _, rows in parts)


def _direct(parts: list[Part], perm: list[int], size: int, selects: int) -> Direct | None:
    """Per block of ``size`` rows of ``perm`` (one input position): ``(part, start)``
    when it is one run of rows, in order, of one part (a view), or ``(part, rows)``
    when its rows all lie in one part (an ``index_select`` of them). None when a block
    spans parts, or more than ``selects`` blocks need an ``index_select`` (no plan when
    ``selects`` is negative: taking the parts alone would already launch too many)."""
    if selects < 0:
        return None
    starts: list[int] = []
    offset = 0
    for _, _, rows in parts:
        starts.append(offset)
        offset += len(rows)
    starts.append(offset)
    plan: Direct = []
    for begin in range(0, len(perm), size):
        block = perm[begin : begin + size]
        first = block[0]
        part = bisect_right(starts, first) - 1
        base, end = starts[part], starts[part + 1]
        if first + size <= end and block == list(range(first, first + size)):
            plan.append((part, first - base))
        elif selects > 0 and base <= min(block) and max(block) < end:
            selects -= 1
            plan.append((part, [r - base for r in block]))
        else:
            return None
    return plan


def record_uses(last_use: dict[int, int], codes: list[int], step: int) -> None:
    """Note that ``step`` gathers ``codes`` (later steps overwrite earlier ones)."""
    last_use.update(zip(codes, repeat(step)))
