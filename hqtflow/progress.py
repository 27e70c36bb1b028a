"""A tqdm bar counting samples (or requests, or windows) with tokens and tokens/s; tqdm is imported lazily."""

from __future__ import annotations

import time


class Progress:
    """One bar at a time: `start` a bar (closing the previous one), `update` it, `add_total` when more work is
    announced (lm-eval hands requests over in batches of unknown count), `close` it. Disabled: every call is a no-op."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        self.tokens = 0
        self.t0 = time.perf_counter()

    def start(self, desc: str, total: int | None, unit: str = "sample") -> None:
        self.close()
        if self.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
            self.tokens, self.t0 = 0, time.perf_counter()

    def add_total(self, n: int) -> None:
        if self.bar is not None:
            self.bar.total = (self.bar.total or 0) + n
            self.bar.refresh()

    def update(self, samples: int, tokens: int) -> None:
        if self.bar is not None:
            self.tokens += tokens
            self.bar.update(samples)
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(tokens=self.tokens, tok_s=f"{rate:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
