"""Giving freed heap memory back to the OS during long serving runs.

The engine allocates KV tensors of a new shape at nearly every step (the batch's cache grows by one column per
step and changes rows as requests join and leave), so glibc's arenas fragment: freed blocks stay mapped and the
server's RSS creeps up although nothing is leaked. `malloc_trim(0)` returns every free page of every arena
(`madvise(MADV_DONTNEED)` inside arenas since glibc 2.8). The engine calls `trim()` at most once per interval and
when it goes idle. Elsewhere than glibc (musl, macOS) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Release free heap pages to the OS; True when glibc's malloc_trim ran."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
