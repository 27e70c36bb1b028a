"""Freeing a thread's OpenMP workers before the engine's own thread takes over the model (runtime/threads.py)."""

import os
import sys
import threading
import time

import pytest
import torch

from hqtflow.runtime.threads import release_openmp_pool


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _settle(expected: int) -> int:
    """The thread count, once it reaches `expected` or after 2 s (a freed worker exits just after the pause)."""
    deadline = time.monotonic() + 2
    while _tasks() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _tasks()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's")
def test_release_frees_the_calling_threads_workers_and_they_come_back_on_demand():
    assert "OpenMP" in torch.__config__.parallel_info()
    seen = {}

    def on_a_fresh_thread():
        saved = torch.get_num_threads()
        torch.set_num_threads(3)
        try:
            x = torch.ones(1 << 22)
            assert x.sum().item() == 1 << 22  # a parallel reduction: this thread's pool now has 2 workers
            time.sleep(0.1)
            with_pool = _tasks()
            seen["released"] = release_openmp_pool()
            seen["freed"] = with_pool - _settle(with_pool - 2)
            assert x.sum().item() == 1 << 22  # and a new pool serves the next parallel op
            seen["again"] = _settle(with_pool) - (with_pool - 2)
            release_openmp_pool()
        finally:
            torch.set_num_threads(saved)

    t = threading.Thread(target=on_a_fresh_thread)
    t.start()
    t.join()
    assert seen == {"released": 1, "freed": 2, "again": 2}
