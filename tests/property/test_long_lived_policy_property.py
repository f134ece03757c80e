"""One policy kept open across many computes gives eager values and gradients.

A state machine records random tensor programs (``tensor_programs``) into one open
``BatchingPolicy``, step by step, on inputs made along the way, and computes random
subsets of what it recorded at random moments, as an interactive session or a server
holding a policy open would. Later calls take values computed earlier (and merge with
calls computed earlier) as inputs. Each compute's values must equal the eager run; at
the end, so must the gradients of a weighted sum of every value with respect to the
inputs and the modules' parameters.

This exercises what one compute per policy does not: planning in place after earlier
computes, merging a new call into a node computed earlier, reading stores of earlier
computes in gathers, and backward through values computed at different times.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import batchgraph as bg
from tests.property.tensor_programs import SHAPES, Modules, catalog

_MODULES = Modules().double()
_OPS = catalog(_MODULES)
# Float32 copies, for the variant that also records inside torch.autocast (which
# leaves float64 alone).
_MODULES32 = Modules()
_OPS32 = catalog(_MODULES32)

_GRAD_MODES: dict[str, Any] = {
    "grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode,
}

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


class LongLivedPolicy(RuleBasedStateMachine):
    # The float64 machine compares values and gradients exactly; the autocast one
    # (below) what must match exactly in bfloat16: shapes, dtypes, real tensors.
    modules, ops, dtype, autocast = _MODULES, _OPS, torch.float64, False

    def __init__(self) -> None:
        super().__init__()
        for p in self.modules.parameters():
            p.grad = None
        self.inputs: list[torch.Tensor] = []
        self.handles: list[Any] = []
        self.eager: list[torch.Tensor] = []
        self.computed: dict[int, torch.Tensor] = {}  # position -> batched value
        self.recipes: list[tuple[str, int, int, int, str, bool]] = []  # what record made, in order
        self.without_grad: set[int] = set()  # positions recorded without grad
        self.wrapped: set[int] = set()  # positions whose values became constants
        self.saved: set[int] = set()  # ids of eager values taken by calls with grad
        self.computes = 0

    @initialize(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16),
                scheduler=st.sampled_from(["agenda", "depth"]), dedupe=st.integers(0, 3))
    def open_policy(self, shape: tuple[int, ...], seed: int, scheduler: str,
                    dedupe: int) -> None:
        """Either scheduler; merging identical calls mostly on (as by default)."""
        self.policy = bg.BatchingPolicy(scheduler=scheduler, dedupe=dedupe > 0)
        self.policy.__enter__()
        self.new_input(shape, seed, 1)

    @rule(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**16),
          repeat=st.integers(0, 64))
    def new_input(self, shape: tuple[int, ...], seed: int, repeat: int) -> None:
        if self.inputs and repeat % 3 == 0:  # an earlier input's values: calls merge
            x = self.inputs[repeat % len(self.inputs)].detach().clone()
        else:
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(shape, generator=gen, dtype=self.dtype)
        x.requires_grad_()
        self.inputs.append(x)
        self.handles.append(bg.batched_value(x))
        self.eager.append(x)

    @rule(name=st.sampled_from(sorted(_OPS)), a=st.integers(0, 64), b=st.integers(0, 64),
          c=st.integers(0, 64), mode=st.integers(0, 6))
    def record(self, name: str, a: int, b: int, c: int, mode: int) -> None:
        """Record ``name`` on values ``a`` and ``b``: mostly with grad, sometimes under
        ``no_grad`` (mode 0), in inference mode (6) and, in the autocast machine,
        inside autocast (5)."""
        i, j = a % len(self.handles), b % len(self.handles)
        grad = {0: "no_grad", 6: "inference"}.get(mode, "grad")
        self._record(name, i, j, c, grad, self.autocast and mode == 5)

    @rule(k=st.integers(0, 64))
    def record_again(self, k: int) -> None:
        """The same call on the same values as an earlier one (maybe computed by now):
        it merges into that node."""
        if self.recipes:
            self._record(*self.recipes[k % len(self.recipes)])

    @rule(k=st.integers(0, 64), wrap=st.booleans())
    def reuse_computed(self, k: int, wrap: bool) -> None:
        """A value computed earlier comes back as an input, history and all: as the
        tensor itself, or wrapped by ``batched_value``, as an example passes on what it
        read."""
        if not self.computed:
            return
        p = sorted(self.computed)[k % len(self.computed)]
        value = self.computed[p]
        self.handles.append(bg.batched_value(value) if wrap else value)
        self.eager.append(self.eager[p])
        # Either way it may become a constant, which must stay as it is until computed
        # (ConstantChangedError): neither position is changed from now on.
        self.wrapped.update((p, len(self.handles) - 1))

    @rule(k=st.integers(0, 64), whole=st.booleans(),
          then=st.none() | st.sampled_from(sorted(_OPS)), b=st.integers(0, 64),
          c=st.integers(0, 64))
    def change_computed(self, k: int, whole: bool, then: str | None, b: int, c: int) -> None:
        """Change a computed value in place, as an example masking its scores does, and
        its eager twin alike; then maybe record a call on it and compute that. Calls
        recorded on it before the change (pending or not) must not see the change;
        those recorded after must."""
        candidates = [p for p in sorted(self.computed) if self._changeable(p)]
        if not candidates:
            return
        p = candidates[k % len(candidates)]
        self._change(p, whole)
        if then is not None:
            made = len(self.handles)
            self._record(then, p, b % len(self.handles), c, "grad", False)
            if len(self.handles) > made:  # recorded: compute it now, for a short example
                self.compute([made])

    def _change(self, p: int, whole: bool) -> None:
        for value in (self.computed[p], self.eager[p]):
            inference = torch.inference_mode() if value.is_inference() else torch.no_grad()
            with inference:
                target = value if whole or value.dim() == 0 else value[..., :1]
                if value.dtype is torch.bool:
                    target.logical_not_()
                elif value.is_floating_point() or value.is_complex():
                    target.mul_(-0.5).add_(1.0)
                else:
                    target.add_(1)

    def _changeable(self, p: int) -> bool:
        value, want = self.computed[p], self.eager[p]
        if value.requires_grad or want.requires_grad or p in self.wrapped:
            return False
        if id(want) in self.saved:
            return False  # a call with grad may have saved it: backward would fail eagerly
        # Eager values that share memory (a view and its base, or one tensor at two
        # positions) change together, where batched values never share memory: not
        # compared.
        storage = want.untyped_storage().data_ptr()
        return sum(t.untyped_storage().data_ptr() == storage
                   for t in [*self.inputs, *self.eager]) == 1

    def _record(self, name: str, i: int, j: int, c: int, grad: str, cast: bool) -> None:
        """Record ``name`` on values ``i`` and ``j``, eagerly too, in one grad mode
        (``"grad"``, ``"no_grad"``, ``"inference"``) and autocast state (a call keeps
        both, whenever it computes)."""
        applies, op = self.ops[name]
        if not applies(self.eager[i]):
            return
        region = (torch.autocast("cpu", dtype=torch.bfloat16) if cast
                  else contextlib.nullcontext())
        with _GRAD_MODES[grad](), region:
            try:
                want = op(self.eager[i], self.eager[j], c)
            except (RuntimeError, IndexError, ValueError):
                return  # an input this op cannot take (eagerly too): not recorded
            if not isinstance(want, torch.Tensor):
                return
            self.handles.append(op(self.handles[i], self.handles[j], c))
        if grad == "grad":
            self.saved.update((id(self.eager[i]), id(self.eager[j])))
        if grad != "grad" and not any(want is self.eager[k] for k in (i, j)):
            # (An op returning its input itself, dropout in eval mode, keeps the batched
            # input's history, which may need grad for rows of other calls gathered
            # with it: a flag no gradient flows through, left alone.)
            self.without_grad.add(len(self.eager))
        self.eager.append(want)
        self.recipes.append((name, i, j, c, grad, cast))

    @rule(picks=st.lists(st.integers(0, 64), min_size=1, max_size=6),
          ambient=st.sampled_from(["grad", "grad", "no_grad", "inference"]))
    def compute(self, picks: list[int], ambient: str = "grad") -> None:
        """Compute some values, with grad on, under ``no_grad`` or in inference mode:
        each call still runs in the mode it was recorded in."""
        positions = sorted({p % len(self.handles) for p in picks})
        with _GRAD_MODES[ambient]():
            got = self.policy.compute([self.handles[p] for p in positions])
        self.computes += 1
        for p, value in zip(positions, got):
            self.computed[p] = value

    @invariant()
    def computed_values_equal_eager(self) -> None:
        for p, value in self.computed.items():
            want = self.eager[p]
            where = f"value {p} of {len(self.handles)}, after {self.computes} computes"
            assert type(value) is torch.Tensor, where  # not a FakeTensor
            assert (value.shape, value.dtype) == (want.shape, want.dtype), where
            if p in self.without_grad and not want.requires_grad:
                # Recorded under no_grad, from values that need no grad either: the
                # batched value must not require grad, although its gather may have
                # carried rows that do (a view of it would, with no history). Eagerly,
                # a view of a value that needs grad requires grad under no_grad too;
                # whether gradients flow is checked at the end.
                assert not value.requires_grad, where
            if self.dtype is not torch.float64:
                continue  # bfloat16 values differ in their last bits batched
            torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-10, equal_nan=True,
                                       msg=where)

    def teardown(self) -> None:
        try:
            if not self.handles:
                return
            self.compute(list(range(len(self.handles))))
            self.computed_values_equal_eager()
            if self.dtype is torch.float64:
                self._check_gradients()
        finally:
            if hasattr(self, "policy"):  # opened by the first step
                self.policy.__exit__(None, None, None)

    def _check_gradients(self) -> None:
        gen = torch.Generator().manual_seed(len(self.handles))
        weights = [torch.randn(v.shape, generator=gen, dtype=torch.float64)
                   if v.is_floating_point() else None for v in self.eager]
        want = self._grads(self.eager, weights)
        got = self._grads([self.computed[p] for p in range(len(self.handles))], weights)
        for k, (w, g) in enumerate(zip(want, got)):
            assert (w is None) == (g is None), f"gradient {k}: {w} vs {g}"
            if w is not None and g is not None:
                torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9, equal_nan=True,
                                           msg=f"gradient {k}")

    def _grads(self, values: list[torch.Tensor], weights: list[Any]) -> list[Any]:
        tensors = [*self.inputs, *self.modules.parameters()]
        terms = [(v * w).sum() for v, w in zip(values, weights)
                 if w is not None and v.requires_grad]
        if not terms:
            return [None] * len(tensors)
        grads = torch.autograd.grad(torch.stack(terms).sum(), tensors, allow_unused=True,
                                    retain_graph=True)
        return list(grads)


LongLivedPolicy.TestCase.settings = settings(
    max_examples=settings.default.max_examples, stateful_step_count=25, deadline=None,
)
TestLongLivedPolicy = LongLivedPolicy.TestCase


class LongLivedPolicyInAndOutOfAutocast(LongLivedPolicy):
    modules, ops, dtype, autocast = _MODULES32, _OPS32, torch.float32, True


LongLivedPolicyInAndOutOfAutocast.TestCase.settings = LongLivedPolicy.TestCase.settings
TestLongLivedPolicyInAndOutOfAutocast = LongLivedPolicyInAndOutOfAutocast.TestCase
