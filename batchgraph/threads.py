"""Threads that compute: they must use the caller's number of intra-op threads.

PyTorch's intra-op thread count (``torch.set_num_threads``) is kept per thread by
OpenMP and MKL: a thread started later runs its kernels with the library default (all
cores) instead. With one intra-op thread asked for on a 2-core machine, a matrix
product on such a thread measured 2.3x slower than on the main thread (two threads
fighting over the cores the rest of the program also uses). Every pool that runs
tensor work on behalf of the caller is therefore made here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["compute_pool", "usable_cores"]


def compute_pool(
    prefix: str, workers: int = 1, device: torch.device | None = None
) -> ThreadPoolExecutor:
    """A thread pool whose threads use the calling thread's intra-op thread count.

    Args:
        prefix: the threads' name prefix (shown by debuggers and ``py-spy``).
        workers: the number of threads.
        device: a CUDA device the threads make their current one (as torchgpipe's
            device threads do): the current device is per thread, and kernels a
            stage's code launches without naming a device (``torch.zeros(3,
            device="cuda")``, a custom kernel), its allocations and its default
            stream then belong to the stage's GPU, not GPU 0. Other devices: ignored.

    Example:
        >>> torch.set_num_threads(1)
        >>> with compute_pool("example") as pool:
        ...     pool.submit(torch.get_num_threads).result()
        1
    """
    cuda = device if device is not None and device.type == "cuda" else None
    return ThreadPoolExecutor(
        max_workers=workers,
        thread_name_prefix=prefix,
        initializer=_start_thread,
        initargs=(torch.get_num_threads(), cuda),
    )


def _start_thread(intra_op_threads: int, cuda: torch.device | None) -> None:
    torch.set_num_threads(intra_op_threads)
    if cuda is not None:
        torch.cuda.set_device(cuda)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one).

    Example:
        >>> usable_cores() >= 1
        True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
