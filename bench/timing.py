"""Timing shared by the benches: every column timed in the same rounds, interleaved call by call, so a host whose
speed drifts (shared machines swing by 2-3x for seconds at a time) slows every column alike; the median of each."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable


def interleaved_medians(calls: dict[str, Callable[[], object]], rounds: int, *, desc: str | None = None,
                        before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds per call of each of `calls` over `rounds` rounds (one call of each per round, in order);
    `before` runs untimed ahead of every call (e.g. gc.collect); `desc`: a tqdm bar on stderr with that label."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    bar = None
    if desc:
        from tqdm import tqdm

        bar = tqdm(total=rounds * len(calls), desc=desc, file=sys.stderr)
    try:
        for _ in range(rounds):
            for name, fn in calls.items():
                if before is not None:
                    before()
                t = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - t)
                del out  # freed outside the timed span
                if bar is not None:
                    bar.update()
    finally:
        if bar is not None:
            bar.close()
    return {name: statistics.median(v) for name, v in times.items()}
