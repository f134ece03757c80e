"""Portable batches: the exported path equals the in-process path; bad batches are refused."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import batchgraph as bg
from tests.property.models import DagModel, LeafCell, TreeModel
from tests.property.tensor_programs import SHAPES, Modules, catalog, run_program
from tests.property.test_batched_equals_eager import dags, trees
from tests.property.test_tensor_ops_property import programs as tensor_programs
from tests.unit.schedules import same_schedule


def run_dag(model: Any, item: tuple[torch.Tensor, Any]) -> Any:
    return model.run(*item)


def in_process(model: Any, forward: Any, items: list[Any]) -> tuple[Any, bg.Schedule]:
    with bg.BatchingPolicy() as policy:
        handles = [forward(model, item) for item in items]
    return policy.compute(handles), policy.last_schedule


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros(0) for p in model.parameters()]


def _weighted_loss(outputs: list[torch.Tensor]) -> torch.Tensor:
    # Example i weighs i + 1: under a plain sum, gradients handed to another example's
    # rows would give the same parameter gradients.
    return torch.stack([(i + 1.0) * o.sum() for i, o in enumerate(outputs)]).sum()


def assert_same_outputs_and_grads(
    model: nn.Module, collate: bg.GraphCollate, forward: Any, items: list[Any]
) -> None:
    """In-process compute vs GraphCollate (structure copy) + bind: bitwise equal."""
    model.zero_grad()
    expected, schedule = in_process(model, forward, items)
    _weighted_loss(expected).backward()
    expected_grads = grads(model)
    model.zero_grad()
    batch = collate(items)
    assert same_schedule(batch.schedule, schedule)
    got = bg.bind(batch, model)
    _weighted_loss(got).backward()
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    for e, g in zip(expected_grads, grads(model), strict=True):
        assert torch.equal(e, g)


# One model and collate per test (not per hypothesis example): signature caches warm.
torch.manual_seed(1)
DAG_MODEL = DagModel().double()
DAG_COLLATE = bg.GraphCollate(DAG_MODEL, run_dag)
TREE_MODEL = TreeModel().double()
TREE_COLLATE = bg.GraphCollate(TREE_MODEL, "logits")


@given(examples=st.lists(dags(), min_size=1, max_size=5), seed=st.integers(0, 3))
def test_dag_model_portable_equals_in_process(examples: list[Any], seed: int) -> None:
    torch.manual_seed(seed)
    items = [(torch.randn(4, dtype=torch.float64), dag) for dag in examples]
    assert_same_outputs_and_grads(DAG_MODEL, DAG_COLLATE, run_dag, items)


@given(batch=st.lists(trees(), min_size=1, max_size=8))
def test_tree_model_portable_equals_in_process(batch: list[Any]) -> None:
    assert_same_outputs_and_grads(TREE_MODEL, TREE_COLLATE, lambda m, t: m.logits(t), batch)


def test_stacked_outputs_equal_the_list() -> None:
    model = TreeModel()
    batch = bg.GraphCollate(model, "logits")([((1, 2), 3), (4, 5), 6])
    stacked = bg.bind(batch, model, stack=True)
    assert torch.equal(stacked, torch.stack(bg.bind(batch, model)))
    with pytest.raises(ValueError, match="stack=True needs every example's output"):
        bg.bind(bg.GraphCollate(model, "encode")([(1, 2)]), model, stack=True)


def test_tuple_outputs_keep_their_structure() -> None:
    model = TreeModel()
    batch = bg.GraphCollate(model, "encode")([(1, 2), 3])
    (h, c), _ = bg.bind(batch, model)
    assert h.shape == c.shape == (6,)


def _encoded_as_defaultdict(model: Any, item: Any) -> Any:
    h, c = model.encode(item)
    out: defaultdict[str, Any] = defaultdict(list)
    out["h"], out["c"] = h, c
    return out


def test_dict_subclass_outputs_keep_their_kind() -> None:
    # A defaultdict was rebuilt by calling it with the items, which it takes for its
    # default_factory: "first argument must be callable or None" at export and bind.
    model = TreeModel()
    batch = bg.GraphCollate(model, _encoded_as_defaultdict)([(1, 2), 3])
    got = bg.bind(batch, model)
    with bg.BatchingPolicy() as policy:
        handles = [_encoded_as_defaultdict(model, item) for item in [(1, 2), 3]]
    want = policy.compute(handles)
    assert [type(g) for g in got] == [defaultdict, defaultdict]
    for g, w in zip(got, want, strict=True):
        assert g.default_factory is list and sorted(g) == ["c", "h"]
        assert torch.equal(g["h"], w["h"]) and torch.equal(g["c"], w["c"])


def test_nothing_in_a_batch_requires_grad_or_holds_a_module() -> None:
    model = TreeModel()
    batch = bg.GraphCollate(model, "logits")([(1, (2, 3)), 4])
    seen: list[Any] = []

    def walk(obj: Any) -> None:
        seen.append(obj)
        if isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x)
        elif hasattr(obj, "__dataclass_fields__"):
            for name in obj.__dataclass_fields__:
                walk(getattr(obj, name))

    walk(batch)
    assert not any(isinstance(x, nn.Module) for x in seen)
    assert not any(isinstance(x, torch.Tensor) and x.requires_grad for x in seen)
    assert not any(callable(x) and not isinstance(x, type) for x in seen)


class RealCalls:
    """Counts module calls on real (not fake) tensors: actual computation."""

    def __init__(self, model: nn.Module) -> None:
        self.count = 0
        for m in model.modules():
            m.register_forward_pre_hook(self.hook)

    def hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if any(isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) for a in args):
            self.count += 1


class Renamed(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 6)


class OtherCell(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * dim, 2 * dim)

    def forward(self, hl: Any, cl: Any, hr: Any, cr: Any) -> tuple[Any, Any]:
        h = self.proj(torch.cat([hl, hr], dim=-1))
        return h[: hl.shape[-1]], cl


@pytest.mark.parametrize(
    ("live", "match"),
    [
        (Renamed, r"has no submodule of that name \(it has 'embedding'\)"),
        (lambda: TreeModel(dim=8), r"does not accept the recorded per-example inputs|returns"),
        (lambda: TreeModel(classes=4),
         r"StackKey\[out\] returns \(4,\) float32 on cpu per example.*for another model"),
        # The collate keeps the model as it was made from: not converted since.
        (lambda: TreeModel().double(), r"float64 .* float32 .*converted \(\.double\(\)"),
    ],
)
# RealCalls counts with hooks, which run once per batched call by design.
@pytest.mark.filterwarnings("ignore::batchgraph.BatchedHooksWarning")
def test_batch_for_another_model_is_refused_before_computing(live: Any, match: str) -> None:
    batch = bg.GraphCollate(TreeModel(), "logits")([(1, 2), (3, (4, 5))])
    model = live()
    calls = RealCalls(model)
    with pytest.raises(bg.ScheduleMismatchError, match=match):
        bg.bind(batch, model)
    assert calls.count == 0


def test_module_of_another_class_is_refused() -> None:
    batch = bg.GraphCollate(TreeModel(), "logits")([(1, 2)])
    model = TreeModel()
    model.cell = OtherCell(6)
    with pytest.raises(bg.ScheduleMismatchError, match=r"submodule 'cell' is a .*OtherCell"):
        bg.bind(batch, model)


def test_key_class_other_than_the_live_rules_give_is_refused() -> None:
    rules = {LeafCell: bg.StackKey}
    batch = bg.GraphCollate(TreeModel(), "logits", rules=rules)([(1, 2)])
    model = TreeModel()
    with pytest.raises(
        bg.ScheduleMismatchError, match=r"recorded with key class .*StackKey.*rules give .*VmapKey"
    ):
        bg.bind(batch, model)
    assert len(bg.bind(batch, model, rules=rules)) == 1


class Dropping(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.drop = nn.Dropout(0.5)

    def f(self, x: float) -> Any:
        return self.drop(self.lin(bg.batched_value(torch.full((3,), float(x)))))


def test_dropout_mode_mismatch_is_refused() -> None:
    model = Dropping().eval()
    batch = bg.GraphCollate(model, "f")([1.0, 2.0])
    with pytest.raises(bg.ScheduleMismatchError, match="deterministic=True but is deterministic=False"):
        bg.bind(batch, model.train())


def test_constant_that_requires_grad_is_refused_at_export() -> None:
    lin = nn.Linear(2, 2)

    class M(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

    model = M()
    with bg.BatchingPolicy() as policy:
        h = model.lin(torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match=r"constant node 0 is a tensor that requires grad"):
        bg.export(policy, [h], model)


def test_function_without_an_importable_name_is_refused_at_export() -> None:
    model = TreeModel()
    double = bg.batched_func(lambda x: x * 2)
    with bg.BatchingPolicy() as policy:
        h = double(model.embed(bg.batched_value(3)))
    with pytest.raises(LookupError, match="has no importable name"):
        bg.export(policy, [h], model)


def test_example_error_names_the_example_and_keeps_the_traceback() -> None:
    def forward(model: Any, tree: Any) -> Any:
        if tree == 99:
            raise KeyError("token 99 is not in the vocabulary")
        return model.logits(tree)

    collate = bg.GraphCollate(TreeModel(), forward)
    dataset = bg.GraphDataset([1, 2, (3, 4), 99, 5], collate)
    with pytest.raises(bg.ExampleError, match=r"(?s)example 3 of the batch \(dataset index 3\) "
                       r"raised KeyError.*Original traceback.*in forward"):
        dataset[[0, 1, 2, 3, 4]]
    skipping = bg.GraphCollate(TreeModel(), forward, skip_errors=True)
    batch = bg.GraphDataset([1, 2, (3, 4), 99, 5], skipping)[[4, 3, 0]]
    assert batch.indices == [4, 0]
    assert [(s.position, s.index) for s in batch.skipped] == [(1, 3)]
    assert "token 99" in batch.skipped[0].error and "in forward" in batch.skipped[0].traceback
    binder = bg.Binder(TreeModel())
    assert len(binder.run(batch)) == 2
    assert (binder.stats.examples, binder.stats.skipped) == (2, 1)


def test_a_forward_that_would_fail_on_every_example_is_refused_where_given() -> None:
    # Before, each example raised in the worker (with skip_errors, all were skipped).
    model = TreeModel()
    with pytest.raises(TypeError, match=r"method 'logits' bound to a TreeModel.*forward='logits'"):
        bg.GraphCollate(model, model.logits, skip_errors=True)
    with pytest.raises(AttributeError, match="forward='logit' names no method of TreeModel"):
        bg.GraphCollate(model, "logit", skip_errors=True)
    assert len(bg.GraphCollate(model, "logits").build([1, (2, 3)]).outputs) == 2


def test_a_model_that_does_not_pickle_is_refused_with_what_to_pass_instead() -> None:
    model = TreeModel()
    model.act = lambda x: x  # a lambda does not pickle
    with pytest.raises(TypeError, match=r"TreeModel does not pickle \(.*lambda.*\).*"
                       r"GraphCollate\(make_model, \.\.\.\)"):
        bg.GraphCollate(model, "logits")
    assert len(bg.GraphCollate(TreeModel, "logits").build([1, (2, 3)]).outputs) == 2


def test_a_graph_dataset_given_one_index_says_it_wants_a_batch() -> None:
    dataset = bg.GraphDataset([1, (2, 3)], bg.GraphCollate(TreeModel(), "logits"))
    with pytest.raises(TypeError, match=r"indices of a whole batch, got 0; .*batch sampler"):
        dataset[0]  # as a DataLoader without a batch sampler asks
    assert len(dataset[[0, 1]].outputs) == 2


def test_failing_batched_call_names_the_dataset_index() -> None:
    class Picky(nn.Module):
        batch_key = bg.StackKey  # sees the batch, so only the batched call fails

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 1 and not isinstance(x, FakeTensor) and bool((x < 0).any()):
                raise ValueError("negative input")
            return x * 2

    class M(bg.BatchedModule):
        def __init__(self) -> None:
            super().__init__()
            self.picky = Picky()

        def f(self, x: float) -> Any:
            return self.picky(bg.batched_value(torch.tensor([x])))

    model = M()
    # A local class does not pickle: the worker builds its structure with a factory.
    batch = bg.GraphDataset([5.0, 1.0, 2.0, -3.0], bg.GraphCollate(M, "f"))[[3, 1]]
    with pytest.raises(bg.BatchedCallError, match=r"examples 1, 3\)"):
        bg.bind(batch, model)


# Random tensor programs (the catalog of tests/property/tensor_programs.py) recorded in
# the worker's way: every function they record must be nameable there.
PROGRAM_MODEL = Modules().double()


def _run_tensor_program(model: Any, item: tuple[torch.Tensor, Any]) -> Any:
    x, program = item
    return run_program(catalog(model), bg.batched_value(x), program)


PROGRAM_COLLATE = bg.GraphCollate(PROGRAM_MODEL, _run_tensor_program)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@given(program=tensor_programs, shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_tensor_programs_portable_equal_in_process(
    program: list[tuple[str, int, int, int]], shapes: list[tuple[int, ...]], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    items = [(torch.randn(s, generator=gen, dtype=torch.float64), program) for s in shapes]
    with bg.BatchingPolicy() as policy:
        handles = [_run_tensor_program(PROGRAM_MODEL, item) for item in items]
    want = policy.compute(handles)
    got = bg.bind(PROGRAM_COLLATE(items), PROGRAM_MODEL)
    for w, g in zip(want, got):
        assert len(w) == len(g)
        for a, b in zip(w, g):
            assert a.shape == b.shape and torch.equal(a, b)


def test_tensor_properties_record_in_portable_batches() -> None:
    # h.T and h.mT record a getter function, which a worker's batch must name.
    items = [(torch.randn(2, 4, dtype=torch.float64), [("mT", 0, 0, 0), ("transpose", 1, 0, 0)])]
    got = bg.bind(PROGRAM_COLLATE(items), PROGRAM_MODEL)
    torch.testing.assert_close(got[0][1], items[0][0].mT)
    for name in ("T", "mT", "H", "mH", "real", "imag"):
        getter = bg.attribute_reads.property_getter(name)
        assert bg.naming.resolve_function(bg.naming.function_name(getter)) is getter
