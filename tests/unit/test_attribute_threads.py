"""Plain module attributes (``batchgraph.attributes``) where recording and computing
run on different threads: ``bg.run_all(groups=2, overlap="thread")`` computes one
lane's step on an executor thread while the driver records another lane's examples.

A setting the driver's example code makes while a step computes must not be taken
for state the step's forward keeps itself (``note_own_state``): it was, so it stopped
being watched, and calls recorded before the change computed with the new value,
silently. The interleavings are forced with events inside a forward, not by timing.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from torch import nn

import batchgraph as bg
from tests.unit.test_module_attributes import Counting  # found on fake tensors

_WAIT = 20.0  # seconds: a missed event fails the test instead of hanging it


_MAIN = threading.main_thread()


def _wait(event: threading.Event) -> None:
    assert event.wait(_WAIT), "the other thread never got there"


class Gated(nn.Module):
    """Reads its temperature before (or, with read_after, after) its first real run
    off the main thread (a lane's step on the executor) says so and waits until the
    driver let it go."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.temperature = 1.0
        self.entered = threading.Event()
        self.go_on = threading.Event()
        # Flags in a dict (not watched), the forward's own: armed is unset on the executor.
        self.flags = {"armed": False, "read_after": False}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        read_after = self.flags["read_after"]
        if not read_after:
            out = out / self.temperature
        real = not isinstance(x, torch._subclasses.FakeTensor)
        if self.flags["armed"] and real and threading.current_thread() is not _MAIN:
            self.flags["armed"] = False
            self.entered.set()
            _wait(self.go_on)
        return out / self.temperature if read_after else out


class Model(bg.BatchedModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = Gated()


@pytest.mark.parametrize("read_after", [False, True])
def test_a_setting_made_while_another_lane_computes_is_still_refused(read_after: bool) -> None:
    model = Model()
    layer = model.layer
    layer.flags["read_after"] = read_after
    double = bg.batched_func(torch.mul)
    xs = [torch.randn(4), torch.randn(4)]
    eager_before = layer(xs[0])  # temperature 1.0
    layer.flags["armed"] = True

    async def setter(x: torch.Tensor) -> Any:
        # Lane 0. Its first step reads no Gated, so lane 1's step (which does) runs
        # on the executor while this resumes.
        await bg.value(double(x, 1.0))
        h = model.layer(x)  # recorded under temperature 1.0
        _wait(layer.entered)  # lane 1's step is computing (its forward waits)
        model.layer.temperature = 2.0  # eagerly: after h, which ran with 1.0
        layer.go_on.set()
        return await bg.value(h)

    async def other(x: torch.Tensor) -> Any:
        return await bg.value(model.layer(x))  # lane 1: computes with 1.0

    results = bg.run_all([setter(xs[0]), other(xs[1])], groups=2, overlap="thread",
                         return_exceptions=True)
    # h, recorded before the change, is refused as with one group (it computed with
    # 2.0: half the eager value). Lane 1's step, computing while the setting changed,
    # may have read either value (with read_after it read the new one, where eagerly,
    # and inline, it ran before the change: half the eager value): refused too.
    layer.temperature = 1.0
    for result, eager in zip(results, [eager_before, layer(xs[1])]):
        assert isinstance(result, bg.ModuleAttributeChangedError), (
            f"computed {result!r}, eagerly {eager!r}")
        assert "temperature: 1.0 -> 2.0" in str(result)
    # And the setting is still watched afterwards, on the driver's own computes.
    with bg.BatchingPolicy():
        h = model.layer(xs[0])
    layer.temperature = 3.0
    with pytest.raises(bg.ModuleAttributeChangedError, match="temperature"):
        bg.compute(h)


def test_a_setting_made_beside_an_async_batcher_step_stays_watched() -> None:
    # The batcher computes on its executor thread while the event loop runs other
    # code, here a task setting the temperature: it was taken for the forward's own
    # state, and from then on never refused.
    model = Model()
    layer = model.layer
    layer.flags["armed"] = True
    x = torch.randn(4)

    async def example() -> Any:
        return await bg.value(model.layer(x))

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        async with bg.AsyncBatcher(max_latency=0.0) as batcher:
            task = asyncio.ensure_future(batcher.run(example()))
            await loop.run_in_executor(None, _wait, layer.entered)
            model.layer.temperature = 2.0
            layer.go_on.set()
            return await task

    with pytest.raises(bg.ModuleAttributeChangedError, match=r"temperature: 1\.0 -> 2\.0"):
        asyncio.run(main())  # it may have read either value
    with bg.BatchingPolicy():
        h = model.layer(x)
    layer.temperature = 3.0
    with pytest.raises(bg.ModuleAttributeChangedError, match=r"temperature: 2\.0 -> 3\.0"):
        bg.compute(h)


@pytest.mark.parametrize("overlap", ["thread", "parallel", "inline"])
def test_state_a_forward_keeps_is_not_refused_in_lanes_on_threads(overlap: str) -> None:
    counting = Counting()

    async def example(x: torch.Tensor, steps: int) -> Any:
        for _ in range(steps):
            x = await bg.value(bg.batched_func(counting)(x))
        return x

    xs = [torch.randn(4) for _ in range(6)]
    eager = []
    for i, x in enumerate(xs):
        for _ in range(1 + i % 3):
            x = counting(x)
        eager.append(x)
    out = bg.run_all([example(x, 1 + i % 3) for i, x in enumerate(xs)], groups=2,
                     overlap=overlap)
    for value, expected in zip(out, eager):
        torch.testing.assert_close(value, expected)


class Hashed(nn.Module):
    """A module of the user's with a hash of its own, which waits once, on a thread
    that is not the main one, while the main thread looks at the attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.entered = threading.Event()
        self.go_on = threading.Event()
        self.armed = False

    def __hash__(self) -> int:
        if self.armed and threading.current_thread() is not threading.main_thread():
            self.armed = False
            self.entered.set()
            _wait(self.go_on)
        return id(self)


def test_a_look_while_own_state_is_noted_on_another_thread_is_not_kept() -> None:
    # note_own_state moved its generation before its table: a look in between (on
    # the recording thread, a compute noting on an executor) was cached under the new
    # generation with the old table, so `steps` stayed listed as a setting, and
    # calls noted without it were refused as changed ('steps: (not set) -> 1').
    module = Hashed()
    cache = bg.attributes.attribute_cache([module])
    before = cache.now()
    module.steps = 1
    after = cache.now()
    module.armed = True
    noting = threading.Thread(target=bg.attributes.note_own_state,
                              args=([module], before, after))
    noting.start()
    _wait(module.entered)  # the other thread is noting `steps`
    cache.now()
    module.go_on.set()
    noting.join(_WAIT)
    assert not noting.is_alive()
    # `steps` is the module's own state now: no setting.
    assert [name for _, name, _ in cache.now() or ()] == ["armed"]


class Proxy:
    """A value standing for another (as wrapt's proxies do): its ``__class__`` is
    Python, which waits once on a thread that is not the main one."""

    def __init__(self, module: Hashed) -> None:
        self.module = module

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        module = self.module
        if module.armed and threading.current_thread() is not _MAIN:
            module.armed = False
            module.entered.set()
            _wait(module.go_on)
        return Proxy


def test_attributes_are_read_while_another_thread_sets_a_new_one() -> None:
    # The loop over a module's __dict__ ran Python for a proxy's type: a new attribute
    # set meanwhile on another thread raised RuntimeError ('dictionary changed size
    # during iteration') in the thread reading them (recording, or a compute).
    module = Hashed()
    module.config = Proxy(module)
    module.armed = True
    found: list[Any] = []
    reading = threading.Thread(
        target=lambda: found.append(bg.attributes.plain_attributes([(0, module)])))
    reading.start()
    _wait(module.entered)
    module.scale = 2.0  # a new attribute, set while the other thread reads
    module.go_on.set()
    reading.join(_WAIT)
    assert not reading.is_alive()
    assert found, "reading the attributes raised"
    assert "config" not in [name for _, name, _ in found[0]]  # no plain value
