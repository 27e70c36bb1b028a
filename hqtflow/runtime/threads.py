"""The engine's own thread and OpenMP: giving the loading thread's OpenMP workers back before the engine starts.

PyTorch's CPU ops (and hqtflow's kernel, through `at::parallel_for`) run on libgomp, which keeps one pool of worker
threads per thread that opened a parallel region. A server loads its model on the main thread and steps the engine
on another, so two pools exist; libgomp counts every pooled thread as busy, and when that count exceeds the CPUs
its workers sleep after 100 spins instead of 300,000 (GCC's documented `GOMP_SPINCOUNT` defaults). Each of a
decode step's ~300 parallel ops then waits for a worker to wake up: measured on a 2-core AVX2 EPYC, the step for
32 sequences took 150-169 ms on the engine's thread against 102-125 ms on the loading thread, and 105-119 ms once
the loading thread's pool was freed. `omp_pause_resource_all(omp_pause_hard)` (OpenMP 5.0) frees the calling
thread's pool in libgomp; a later parallel op on that thread builds a new one, so this only costs speed, never
correctness.
"""

from __future__ import annotations

import ctypes
import os
import sys

OMP_PAUSE_HARD = 2


def _loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies mapped in this process (PyTorch wheels bundle their own)."""
    if not sys.platform.startswith("linux"):
        return []
    paths = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                path = fields[5].strip()
                if os.path.basename(path).startswith("libgomp") and path not in paths:
                    paths.append(path)
    return paths


def release_openmp_pool() -> int:
    """Free the calling thread's OpenMP worker threads in every loaded libgomp; how many runtimes did so.

    Call it on the thread that loaded the model, before another thread takes over the model's compute. Other OpenMP
    runtimes (LLVM's libomp, Intel's libiomp5) are left alone: their hard pause shuts the whole runtime down.
    """
    released = 0
    for path in _loaded_libgomp():
        try:
            pause = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL).omp_pause_resource_all
        except (OSError, AttributeError):  # gone since the maps were read, or older than OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released += pause(OMP_PAUSE_HARD) == 0
    return released
