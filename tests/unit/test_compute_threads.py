"""Pool threads that compute for the caller take its intra-op thread count and, for a
CUDA device, make that device their current one (the current CUDA device is per
thread: a pipeline stage's thread otherwise launched its device-less kernels on GPU 0)."""

from __future__ import annotations

import threading

import pytest
import torch

from batchgraph.threads import compute_pool


def test_threads_take_the_callers_intra_op_thread_count() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with compute_pool("test-threads", workers=2) as pool:
            assert {pool.submit(torch.get_num_threads).result() for _ in range(4)} == {1}
    finally:
        torch.set_num_threads(before)


def test_a_cuda_device_becomes_each_threads_current_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No GPU here: torch's setter is replaced by one noting which thread set what.
    seen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: seen.append((threading.current_thread().name, d)))
    with compute_pool("test-cuda", workers=2, device=torch.device("cuda", 1)) as pool:
        names = {pool.submit(lambda: threading.current_thread().name).result()
                 for _ in range(8)}
    assert {name for name, _ in seen} == names  # every thread that ran, at its start
    assert {d for _, d in seen} == {torch.device("cuda", 1)}


@pytest.mark.parametrize("device", [None, torch.device("cpu"), torch.device("meta")])
def test_other_devices_leave_the_current_cuda_device_alone(
    monkeypatch: pytest.MonkeyPatch, device: torch.device | None
) -> None:
    seen: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    with compute_pool("test-cpu", device=device) as pool:
        pool.submit(int).result()
    assert seen == []
