"""Freeing a thread's OpenMP workers before the engine's own thread takes over the model (runtime/threads.py)."""

import os
import sys
import threading
import time

import pytest
import torch

from hqtflow.runtime.threads import release_openmp_pool


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _gone(tids: set[int]) -> bool:
    """Whether none of `tids` is alive, waiting up to 2 s (a freed worker exits just after the pause)."""
    deadline = time.monotonic() + 2
    while tids & _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not tids & _threads()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's")
def test_release_frees_the_calling_threads_workers_and_they_come_back_on_demand():
    assert "OpenMP" in torch.__config__.parallel_info()
    seen = {}

    def on_a_fresh_thread():
        saved = torch.get_num_threads()
        torch.set_num_threads(3)
        try:
            before = _threads()
            x = torch.ones(1 << 22)  # a parallel fill: this fresh thread's pool starts 2 workers
            assert x.sum().item() == 1 << 22
            workers = _threads() - before
            seen["workers"] = len(workers)
            seen["released"] = release_openmp_pool()
            seen["gone"] = _gone(workers)
            before = _threads()
            assert x.sum().item() == 1 << 22  # a parallel reduction: a new pool serves it
            again = _threads() - before
            seen["again"] = len(again)
            release_openmp_pool()
            seen["gone again"] = _gone(again)
        finally:
            torch.set_num_threads(saved)

    t = threading.Thread(target=on_a_fresh_thread)
    t.start()
    t.join()
    assert seen == {"workers": 2, "released": 1, "gone": True, "again": 2, "gone again": True}
