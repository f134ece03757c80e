"""What batchgraph caches for a module, a function or a model goes when that object goes."""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from batchgraph.sites import module_site


class Net(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def f(self, x: Any) -> Any:
        return self.lin(x)


def _gone(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


def test_a_module_recorded_with_is_freed_with_its_model() -> None:
    # Before, the module's call site (in a WeakKeyDictionary whose value called the
    # module) kept every module ever recorded with, and its parameters, alive for good.
    net = Net()
    with bg.BatchingPolicy():
        h = net.f(torch.ones(3))
    bg.compute(h)
    lin = weakref.ref(net.lin)
    del net, h
    assert _gone(lin)


def test_a_model_bound_by_bind_is_freed() -> None:
    net = Net()
    batch = bg.GraphCollate(net, "f").build([torch.ones(3)])
    assert len(bg.bind(batch, net)) == 1
    model, lin = weakref.ref(net), weakref.ref(net.lin)
    del net
    assert _gone(model) and _gone(lin)


def _scaled() -> tuple[Any, weakref.ref[torch.Tensor]]:
    scale = torch.full((3,), 2.0)
    return bg.batched_func(lambda x: x * scale), weakref.ref(scale)


def test_what_a_lambda_captured_is_freed_with_it() -> None:
    f, captured = _scaled()
    with bg.BatchingPolicy():
        h = f(torch.ones(3))
    assert torch.equal(bg.compute(h), torch.full((3,), 2.0))
    del f, h
    assert _gone(captured)


class WithHelper(Net):
    def helper(self, x: Any) -> Any:
        return self.lin(x).tanh()


def test_a_model_whose_method_was_batched_is_freed() -> None:
    net = WithHelper()
    helper = bg.batched_func(net.helper)
    assert bg.batched_func(net.helper) is helper  # one site per model and method
    with bg.BatchingPolicy():
        h = helper(torch.ones(3))
    assert torch.equal(bg.compute(h), net.helper(torch.ones(3)))
    model = weakref.ref(net)
    del net, helper, h
    assert _gone(model)


def test_copies_of_a_module_get_sites_of_their_own() -> None:
    net = Net()
    with bg.BatchingPolicy():
        h = net.f(torch.ones(3))
    for other in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert module_site(other.lin).__wrapped__ is other.lin
        with bg.BatchingPolicy():
            g = other.f(torch.ones(3))
        assert torch.equal(bg.compute(g), other.f(torch.ones(3)))
    shallow = copy.copy(net.lin)  # shares the original's __dict__ entries
    assert module_site(shallow).__wrapped__ is shallow and module_site(net.lin).__wrapped__ is net.lin
    assert torch.equal(bg.compute(h), net.f(torch.ones(3)))


def _scale(w: torch.Tensor, x: Any) -> Any:
    return x * w


class _Scaler:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def __call__(self, x: Any) -> Any:
        return x * self.w

    def apply(self, x: Any) -> Any:
        return x * self.w


# Callables a loop may make anew per batch, each holding its own tensor.
_PER_BATCH = {
    "functools.partial": lambda w: functools.partial(_scale, w),
    "callable object": _Scaler,
    "bound method of an object": lambda w: _Scaler(w).apply,
    "a tensor's own method": lambda w: w.mul,
}


@pytest.mark.parametrize("kind", sorted(_PER_BATCH))
def test_callables_made_per_batch_are_freed_with_what_they_hold(kind: str) -> None:
    # Before, every such callable's site went into the global table of functions,
    # which kept it (and its tensors: a GPU memory leak over a long run) for good.
    make = _PER_BATCH[kind]
    held: list[weakref.ref[torch.Tensor]] = []
    for step in range(20):
        w = torch.full((3,), float(step))
        x = torch.arange(3.0)
        fn = make(w)
        with bg.BatchingPolicy():
            h = bg.batched_func(fn)(x)
        assert torch.equal(bg.compute(h), fn(x))  # as eagerly
        held.append(weakref.ref(w))
        del w, fn, h
    gc.collect()
    assert [r for r in held if r() is not None] == []


def test_a_callable_object_keeps_its_signatures_while_it_lives() -> None:
    scaler = _Scaler(torch.ones(3))
    first = bg.batched_func(scaler)
    assert bg.batched_func(scaler) is first  # cached on the object itself
    assert bg.batched_func(scaler.apply) is bg.batched_func(scaler.apply)
