"""Recording and scheduling minibatches in ``torch.utils.data`` worker processes.

```
DataLoader worker (one of N)                         main process
  items ─▶ GraphCollate.build:                         for batch in loader:
           record forward(structure, item) per item        out = binder.run(batch)   # execute
           under a BatchingPolicy, prune, schedule          loss(out, batch.targets).backward()
           (or reuse a cached schedule), export ──pickle──▶
```

The worker holds the model's *structure* only (see ``structure.py``): the collate is
made from the live model, keeps a weightless pickle of it, and loads that once per
worker process. The main process binds the batch's named callables to its live
modules, so the parameters used, and the gradients, are the real ones.

Two ways to plug it in, both ordinary ``DataLoader``s:

* ``DataLoader(dataset, batch_size=64, collate_fn=collate, num_workers=1)``;
* ``graph_loader(dataset, collate, batch_sampler, num_workers=1)``: the worker gets the
  batch's dataset *indices* (so errors name them) and any batch sampler, e.g.
  ``BucketBatchSampler``.

An example whose code raises stops the batch with ``ExampleError`` naming the example
(position and dataset index) and carrying the original traceback; with
``skip_errors=True`` it is left out and listed in ``batch.skipped`` instead.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from batchgraph.errors import BatchgraphError
from batchgraph.policy import BatchingPolicy
from batchgraph.portable import Exporter, PortableBatch, SkippedExample, grad_mode
from batchgraph.rules import KeyFactory, rule_table
from batchgraph.schedule_cache import ScheduleCache
from batchgraph.structure import load_structure, model_structure

__all__ = ["ExampleError", "GraphCollate", "GraphDataset", "graph_loader"]

Forward = Callable[[Any, Any], Any]


class ExampleError(BatchgraphError, RuntimeError):
    """Recording one example raised; the message names it and holds the traceback.

    Takes a single message so that ``DataLoader`` can re-raise it in the main process.
    """


class GraphCollate:
    """A collate function that records and schedules a minibatch; returns a ``PortableBatch``.

    Args:
        model: the live model (only its structure is kept, see ``structure.py``), or a
            function of no arguments that builds a model of the same structure (for
            models that do not pickle; it runs once per worker process).
        forward: the per-example code: a method name of the model (``"logits"``:
            ``model.logits(item)``) or a function ``forward(model, item)``; it returns a
            handle or a nesting of handles.
        target: what to collate as targets: an attribute name, an index into the item,
            a function of the item, or None.
        scheduler, dedupe, rules: the worker's ``BatchingPolicy`` settings (pass the
            same ``rules`` to the main process's ``Binder``).
        skip_errors: skip (and count) examples whose recording raises, instead of
            raising ``ExampleError``.
        cache: reuse schedules of structures seen before (per worker): True, False,
            or a ``ScheduleCache``.

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 3)
        ...     def score(self, x):
        ...         return self.lin(bg.batched_value(torch.full((2,), float(x))))
        >>> model = M()
        >>> collate = GraphCollate(M, "score")   # a class made here does not pickle: a factory
        >>> loader = torch.utils.data.DataLoader(range(8), batch_size=4, collate_fn=collate)
        >>> [bg.bind(batch, model, stack=True).shape for batch in loader]
        [torch.Size([4, 3]), torch.Size([4, 3])]
    """

    def __init__(
        self,
        model: nn.Module | Callable[[], nn.Module],
        forward: str | Forward,
        *,
        target: str | int | Callable[[Any], Any] | None = None,
        scheduler: str = "agenda",
        dedupe: bool = True,
        rules: Mapping[Any, KeyFactory] | None = None,
        skip_errors: bool = False,
        cache: bool | ScheduleCache = True,
    ) -> None:
        if isinstance(model, nn.Module):
            try:
                self._structure: bytes | None = model_structure(model)
            except (pickle.PicklingError, TypeError, AttributeError) as err:
                raise TypeError(
                    f"{type(model).__name__} does not pickle ({type(err).__name__}: {err}), "
                    "so its structure cannot reach the worker processes. Pass a function "
                    "of no arguments that builds the model instead: "
                    f"GraphCollate(make_model, ...), where make_model() returns a "
                    f"{type(model).__name__} (it runs once per worker)"
                ) from err
            self._factory: Callable[[], nn.Module] | None = None
        elif callable(model):
            self._structure, self._factory = None, model
        else:
            raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
        if not isinstance(forward, str) and not callable(forward):
            raise TypeError(f"forward must be a method name or a function, got {forward!r}")
        _check_forward(model, forward)
        self.forward = forward
        self.target = target
        self.scheduler = scheduler
        self.dedupe = dedupe
        self.rules: dict[Any, KeyFactory] = rule_table(rules)
        mine = next((k for k in self.rules if isinstance(k, nn.Module)), None)
        if mine is not None:
            name = type(mine).__name__
            raise TypeError(
                f"rules has a key that is one {name} module: a worker records with its "
                "own copy of the model, where a rule for this instance would never apply. "
                f"Key the rule by its class (rules={{{name}: ...}}), or set it on the "
                f"module itself (module.batch_key = ...), which travels with the model."
            )
        self.skip_errors = skip_errors
        if cache is True:
            cache = ScheduleCache()
        self._cache_template = cache if isinstance(cache, ScheduleCache) else None
        self._state: tuple[int, nn.Module, Exporter] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The loaded structure and the exporter are per process (made on first use).
        state = dict(self.__dict__)
        state["_state"] = None
        return state

    def _worker(self) -> tuple[nn.Module, Exporter]:
        pid = os.getpid()
        state = self._state
        if state is None or state[0] != pid:
            if self._structure is not None:
                model = load_structure(self._structure)
            else:
                assert self._factory is not None
                model = self._factory()
            # Each process gets its own cache (a forked copy would start shared-looking).
            template = self._cache_template
            cache = ScheduleCache(template.max_entries) if template is not None else None
            state = self._state = (pid, model, Exporter(model, cache))
        return state[1], state[2]

    @property
    def cache(self) -> ScheduleCache | None:
        """This process's schedule cache (hits and misses), once a batch was built."""
        return self._state[2].cache if self._state is not None else None

    def __call__(self, items: Sequence[Any]) -> PortableBatch:
        """Collate ``items`` (a ``DataLoader`` calls this): see ``build``."""
        return self.build(items)

    def build(self, items: Sequence[Any], indices: Sequence[int] | None = None) -> PortableBatch:
        """Record ``forward`` over ``items`` in one policy, schedule, and export.

        Args:
            items: the examples of the minibatch.
            indices: their dataset indices (named in errors), if known.

        Returns:
            The ``PortableBatch`` with targets and any skipped examples.

        Raises:
            ExampleError: an example raised while recording (unless ``skip_errors``).
        """
        model, exporter = self._worker()
        start = time.perf_counter()
        # The mode the recording runs in (grad on, in a worker): calls the per-example
        # code records in another (inside torch.no_grad()) keep theirs when bound.
        recorded_in = grad_mode()
        forward = self.forward
        call: Forward = (
            (lambda m, item: getattr(m, forward)(item)) if isinstance(forward, str) else forward
        )
        policy = BatchingPolicy(scheduler=self.scheduler, dedupe=self.dedupe, rules=self.rules)
        outputs: list[Any] = []
        ends: list[int] = []
        kept: list[int] = []
        targets: list[Any] = []
        skipped: list[SkippedExample] = []
        with policy:
            for position, item in enumerate(items):
                index = indices[position] if indices is not None else position
                try:
                    target = self._target(item)
                    out = call(model, item)
                except Exception as err:
                    skipped.append(self._failed(position, index, indices is not None, err))
                    continue
                outputs.append(out)
                targets.append(target)
                ends.append(len(policy.graph))
                kept.append(index)
        recorded = time.perf_counter()
        batch = exporter.export(
            policy, outputs, example_ends=ends, indices=kept, recorded_in=recorded_in
        )
        batch.targets = default_collate(targets) if self.target is not None and targets else None
        batch.skipped = skipped
        batch.record_seconds = recorded - start
        return batch

    def _target(self, item: Any) -> Any:
        target = self.target
        if target is None:
            return None
        if isinstance(target, str):
            return getattr(item, target)
        if isinstance(target, int):
            return item[target]
        return target(item)

    def _failed(self, position: int, index: int, known: bool, err: Exception) -> SkippedExample:
        where = f"example {position} of the batch" + (f" (dataset index {index})" if known else "")
        formatted = traceback.format_exc()
        if not self.skip_errors:
            raise ExampleError(
                f"{where} raised {type(err).__name__}: {err} while being recorded (in process "
                f"{os.getpid()}). Fix the example or the per-example code, or pass "
                f"skip_errors=True to skip and count such examples.\n"
                f"Original traceback:\n{formatted}"
            ) from err
        return SkippedExample(position, index, f"{type(err).__name__}: {err}", formatted)


def _check_forward(model: nn.Module | Callable[[], nn.Module], forward: str | Forward) -> None:
    """Refuse a ``forward`` that would fail on every example, where it is given: in a
    worker each example would raise alike (and ``skip_errors`` would skip them all)."""
    if isinstance(forward, str):
        if isinstance(model, nn.Module) and not callable(getattr(model, forward, None)):
            raise AttributeError(
                f"forward={forward!r} names no method of {type(model).__name__}; pass the "
                "name of its per-example method (or a function forward(model, item))"
            )
        return
    owner = getattr(forward, "__self__", None)
    if isinstance(owner, nn.Module):
        name = getattr(forward, "__name__", "forward")
        raise TypeError(
            f"forward is the method {name!r} bound to a {type(owner).__name__} instance: "
            "a worker records with its own copy of the model and calls "
            "forward(model_copy, item), which a bound method would take as two arguments "
            f"of its own. Pass the method's name (forward={name!r}) or a function "
            "forward(model, item)"
        )


class GraphDataset(Dataset[PortableBatch]):
    """A dataset of minibatches: ``dataset[indices]`` records the items at ``indices``.

    Use with a batch sampler and ``batch_size=None`` (``graph_loader`` does this), so a
    worker receives the indices and errors can name them.

    Args:
        dataset: any map-style dataset.
        collate: the ``GraphCollate`` that records a minibatch.

    Example:
        >>> import batchgraph as bg, torch
        >>> class M(bg.BatchedModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(1, 1)
        ...     def f(self, x):
        ...         return self.lin(bg.batched_value(torch.tensor([float(x)])))
        >>> len(GraphDataset(list(range(5)), GraphCollate(M, "f"))[[0, 3]])
        2
    """

    def __init__(self, dataset: Any, collate: GraphCollate) -> None:
        self.dataset = dataset
        self.collate = collate

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> PortableBatch:  # type: ignore[override]
        if not isinstance(indices, Iterable):
            # A DataLoader over it without a batch sampler hands it one index at a time.
            raise TypeError(
                f"GraphDataset takes the list of indices of a whole batch, got {indices!r}; "
                "give the DataLoader a batch sampler as its sampler, with batch_size=None "
                "(graph_loader(dataset, collate, batch_sampler) does this)"
            )
        indices = [int(i) for i in indices]
        return self.collate.build([self.dataset[i] for i in indices], indices)


def graph_loader(
    dataset: Any,
    collate: GraphCollate,
    batch_sampler: Sampler[list[int]] | Iterable[list[int]],
    *,
    num_workers: int = 1,
    **kwargs: Any,
) -> DataLoader[PortableBatch]:
    """A ``DataLoader`` whose workers record and schedule each minibatch.

    Args:
        dataset: a map-style dataset.
        collate: what to record per minibatch.
        batch_sampler: yields lists of dataset indices (e.g. ``BucketBatchSampler``).
        num_workers: worker processes (0 records in the main process).
        **kwargs: passed to ``DataLoader`` (``timeout``, ``prefetch_factor``, ...).

    Returns:
        A ``DataLoader`` yielding ``PortableBatch``es.

    Example:
        >>> loader = graph_loader(trees, GraphCollate(model, "logits", target="label"),
        ...                       BucketBatchSampler(sizes, 64), num_workers=1)  # doctest: +SKIP
    """
    return DataLoader(
        GraphDataset(dataset, collate),
        sampler=batch_sampler,
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_identity,
        **kwargs,
    )


def _identity(batch: Any) -> Any:
    # With batch_size=None each "sample" is already a whole PortableBatch.
    return batch
