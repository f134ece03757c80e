"""Unbound tensor methods on handles: those written in Python reach
``__torch_function__`` and record as bound ones do; those written in C
(``torch.Tensor.add``) check their first argument's type in CPython itself, before any
dispatch, so they cannot record, and no batchgraph code runs to say why: this pins the
error users get (the README names it and says what to write instead)."""

from __future__ import annotations

import pytest
import torch

import batchgraph as bg


@pytest.mark.parametrize("name", ["add", "sum", "__add__", "to"])
def test_a_c_tensor_method_called_unbound_on_a_handle_fails_in_python_itself(name: str) -> None:
    method = getattr(torch.Tensor, name)
    args = {"add": (1,), "sum": (), "__add__": (1,), "to": (torch.float64,)}[name]
    with bg.BatchingPolicy():
        h = bg.batched_value(torch.arange(4.0))
        with pytest.raises(TypeError, match=rf"descriptor '{name}' .* doesn't apply to a "
                                            r"'ResultHandle' object"):
            method(h, *args)
        # What to write instead records and computes as eagerly.
        bound = getattr(h, name)(*args)
    assert torch.equal(bg.compute(bound), method(torch.arange(4.0), *args))


def test_python_tensor_methods_called_unbound_on_a_handle_record() -> None:
    x = torch.arange(6.0).reshape(3, 2)
    with bg.BatchingPolicy() as policy:
        h = bg.batched_value(x)
        parts = torch.Tensor.split(h, 2)
        norm = torch.Tensor.norm(h)
        rsub = torch.Tensor.__rsub__(h, 1.0)
    assert policy.graph.calls_recorded == 3
    got = bg.compute([list(parts), norm, rsub])
    assert all(torch.equal(g, w) for g, w in zip(got[0], torch.Tensor.split(x, 2)))
    assert torch.equal(got[1], torch.Tensor.norm(x))
    assert torch.equal(got[2], 1.0 - x)
