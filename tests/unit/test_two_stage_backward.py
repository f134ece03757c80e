"""Two-stage backprop (I then W) gives exactly the gradients of a normal backward."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from batchgraph.pipeline.backward import TwoStageBackward, find_units


def _grads(module: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def _compare(
    module: nn.Module,
    make_input: Callable[[], Tensor],
    *,
    input_grad: bool = True,
    reducer: Callable[[Tensor], Tensor] = lambda y: (y * y).sum(),
) -> None:
    """Run a normal backward and a split one from the same state; grads must match."""
    torch.manual_seed(1)
    x = make_input()
    if input_grad:
        x.requires_grad_(True)
    state = {k: v.clone() for k, v in module.state_dict().items()}

    module.zero_grad(set_to_none=True)
    y = module(x)
    reducer(y).backward()
    ref_params = _grads(module)
    ref_input = None if x.grad is None else x.grad.clone()

    module.load_state_dict(state)
    module.zero_grad(set_to_none=True)
    x2 = x.detach().clone().requires_grad_(input_grad)
    with TwoStageBackward(module) as split:
        with split.record() as tape:
            y2 = module(x2)
            loss = reducer(y2)
        (dx,) = tape.backward_input([loss], [torch.ones_like(loss)], [x2])
        # Nothing may reach .grad before W.
        assert all(p.grad is None for p in module.parameters())
        tape.backward_weight()
    got = _grads(module)
    assert len(got) == len(ref_params)
    for g, r in zip(got, ref_params):
        assert (g is None) == (r is None)
        if g is not None and r is not None:
            torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)
    if input_grad:
        assert dx is not None and ref_input is not None
        torch.testing.assert_close(dx, ref_input, rtol=1e-10, atol=1e-10)
    else:
        assert dx is None


def test_mlp_gradients_equal_autograd() -> None:
    net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.ReLU(), nn.Linear(7, 3))
    _compare(net.double(), lambda: torch.randn(6, 5, dtype=torch.float64))


def test_first_stage_without_input_gradient() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    _compare(net, lambda: torch.randn(3, 4, dtype=torch.float64), input_grad=False)


def test_conv_batchnorm_exact() -> None:
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 3, 3),
        nn.Flatten(),
        nn.LayerNorm(3 * 4 * 4),
    ).double()
    _compare(net, lambda: torch.randn(3, 2, 6, 6, dtype=torch.float64))


def test_batchnorm_running_stats_updated_once() -> None:
    bn = nn.BatchNorm1d(3).double()
    x = torch.randn(8, 3, dtype=torch.float64)
    with TwoStageBackward(bn) as split, split.record() as tape:
        y = bn(x)
    assert int(bn.num_batches_tracked) == 1
    tape.backward_input([y.sum()], [torch.ones((), dtype=torch.float64)])
    tape.backward_weight()
    assert int(bn.num_batches_tracked) == 1


def test_shared_module_called_twice_is_not_double_counted() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(torch.tanh(self.lin(x)))

    net = Twice().double()
    _compare(net, lambda: torch.randn(5, 4, dtype=torch.float64))


def test_tied_weights_between_modules() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 10, bias=False)
            self.proj.weight = self.embed.weight

        def forward(self, tokens: Tensor) -> Tensor:
            return self.proj(torch.tanh(self.embed(tokens)))

    net = Tied().double()
    assert len(find_units(net)) == 2
    _compare(net, lambda: torch.randint(0, 10, (7,)), input_grad=False)


def test_parameter_used_outside_its_owner() -> None:
    class Loose(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            # The weight is used directly in the chain as well as through the Linear.
            return self.lin(x) @ self.lin.weight

    _compare(Loose().double(), lambda: torch.randn(4, 3, dtype=torch.float64))


def test_module_with_own_parameter_and_children() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.lin = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.scale * self.lin(x)

    net = nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(3, 2)).double()
    assert [type(u).__name__ for u in find_units(net)] == ["Scaled", "Linear"]
    _compare(net, lambda: torch.randn(4, 3, dtype=torch.float64))


def test_multi_output_unit_lstm() -> None:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 4, batch_first=True)
            self.out = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            seq, (h, _c) = self.lstm(x)
            return self.out(seq + h[-1].unsqueeze(1))

    _compare(Tagger().double(), lambda: torch.randn(2, 5, 3, dtype=torch.float64))


def test_unit_output_not_reaching_loss() -> None:
    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            self.unused(x)
            return self.used(x)

    _compare(Branch().double(), lambda: torch.randn(4, 3, dtype=torch.float64))


def test_accumulates_into_existing_grad() -> None:
    lin = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    lin(x).sum().backward()
    once = lin.weight.grad.clone()  # type: ignore[union-attr]
    with TwoStageBackward(lin) as split:
        with split.record() as tape:
            y = lin(x)
        tape.backward_input([y.sum()], [torch.ones((), dtype=torch.float64)])
        tape.backward_weight()
    torch.testing.assert_close(lin.weight.grad, 2 * once)


def test_hooks_are_inert_outside_record_and_removed_by_close() -> None:
    lin = nn.Linear(3, 2)
    split = TwoStageBackward(lin)
    y = lin(torch.randn(2, 3))
    assert y.grad_fn is not None and "Junction" not in type(y.grad_fn).__name__
    split.close()
    assert not lin._forward_hooks and not lin._forward_pre_hooks
    assert "forward" not in lin.__dict__  # the class's forward again


def test_close_restores_an_instance_forward() -> None:
    lin = nn.Linear(3, 2)
    own = lin.forward
    lin.forward = lambda x: own(x) * 2  # type: ignore[method-assign]
    patched = lin.forward
    x = torch.randn(2, 3)
    with TwoStageBackward(lin) as split:
        with split.record() as tape:
            y = lin(x)
        torch.testing.assert_close(y, own(x) * 2)  # the instance's forward, split
        tape.backward_input([y.sum()], [torch.ones(())])
        tape.backward_weight()
    assert lin.forward is patched


def test_order_is_enforced() -> None:
    lin = nn.Linear(2, 2)
    with TwoStageBackward(lin) as split:
        with split.record() as tape:
            y = lin(torch.randn(1, 2))
        with pytest.raises(RuntimeError, match="needs backward_input"):
            tape.backward_weight()
        tape.backward_input([y.sum()], [torch.ones(())])
        with pytest.raises(RuntimeError, match="already called"):
            tape.backward_input([y.sum()], [torch.ones(())])
        tape.backward_weight()
        with pytest.raises(RuntimeError, match="already called"):
            tape.backward_weight()


def test_stale_after_freezing_or_unfreezing() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with TwoStageBackward(net) as split:
        assert not split.stale()
        net[0].weight.requires_grad_(False)
        assert split.stale()
        net[0].weight.requires_grad_(True)
        assert not split.stale()


def test_prepared_module_deepcopies_and_pickles_as_a_plain_one() -> None:
    # EMA copies and checkpoints taken while a zb-h1 pipeline is open: the wrapper once
    # held a threading.local, which neither copy nor pickle can handle.
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    with TwoStageBackward(net) as split:
        for copy_of in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
            twin = copy_of(net)
            torch.testing.assert_close(twin(x), net(x))
            with split.record() as tape:
                y = twin(x)  # a copy is not prepared: nothing is recorded on the tape
            assert tape.calls == 0 and "Junction" not in type(y.grad_fn).__name__
            twin(x).sum().backward()
            assert twin[0].weight.grad is not None and net[0].weight.grad is None


def test_module_prepared_twice_is_restored_by_either_close_order() -> None:
    # One module used by two stages: each stage's TwoStageBackward prepares it.
    for first_closed in (0, 1):
        shared = nn.Linear(3, 3)
        splits = [TwoStageBackward(nn.Sequential(shared)), TwoStageBackward(shared)]
        with splits[1].record() as tape:
            shared(torch.randn(2, 3))
        assert tape.calls == 1  # recorded once, not by two stacked wrappers
        splits[first_closed].close()
        with splits[1 - first_closed].record() as tape:
            shared(torch.randn(2, 3))
        assert tape.calls == 1  # still prepared for the other one
        splits[1 - first_closed].close()
        assert "forward" not in shared.__dict__
