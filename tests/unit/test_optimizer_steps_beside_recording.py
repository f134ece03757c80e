"""An optimizer stepping on one thread while another records (an actor-learner: the
learner steps, actors record with batchgraph).

After each step the graphs that noted parameters' versions note them anew
(``batchgraph.key_reads``); the step listed them while a recording thread could add
one, and raised ``RuntimeError: Set changed size during iteration`` from
``optimizer.step()``. Threads switch as often as the interpreter lets them here, so
the old code failed within about 1,500 steps (in each of 5 runs); no interleaving
can fail now.
"""

from __future__ import annotations

import sys
import threading

import torch

import batchgraph as bg

_STEPS = 4000


def test_an_optimizer_steps_while_another_thread_records() -> None:
    lin = torch.nn.Linear(2, 2)
    layer = bg.batched_func(lin)
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    lin(torch.randn(2)).sum().backward()
    stop = threading.Event()
    failures: list[BaseException] = []

    def record() -> None:
        kept: list[bg.BatchingPolicy] = []  # alive: the listed set stays large
        x = torch.randn(2)
        try:
            while not stop.is_set():
                policy = bg.BatchingPolicy()
                with policy:
                    layer(x)  # notes the parameters' versions: its graph is listed
                kept = [*kept[-200:], policy]
        except BaseException as err:  # reported below
            failures.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    recorder = threading.Thread(target=record)
    recorder.start()
    try:
        for _ in range(_STEPS):
            opt.step()
    finally:
        stop.set()
        recorder.join(30)
        sys.setswitchinterval(interval)
    assert not recorder.is_alive()
    assert not failures, failures
