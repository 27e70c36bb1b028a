"""A tqdm bar counting samples (or requests, or windows) with tokens and tokens/s, or any work (layers, bytes) with
`advance`; tqdm is imported lazily."""

from __future__ import annotations

import time


class Progress:
    """One bar at a time: `start` a bar (closing the previous one), `update` it, `add_total` when more work is
    announced (lm-eval hands requests over in batches of unknown count), `close` it. A bar of unknown total shows from
    its first `add_total` or `update` (not as an empty bar above lm-eval's own lines). Disabled: every call is a no-op;
    `enabled` None: shown only when stderr is a terminal (tqdm's own rule)."""

    def __init__(self, enabled: bool | None = True):
        self.enabled = enabled
        self.bar = None
        self.pending = None  # (desc, total, unit) of a started bar not shown yet
        self.tokens = 0
        self.t0 = time.perf_counter()

    def start(self, desc: str, total: int | None, unit: str = "sample") -> None:
        self.close()
        if self.enabled:
            self.pending = (desc, total, unit)
            self.tokens, self.t0 = 0, time.perf_counter()  # the rate counts from here, shown or not
            if total:
                self._show()

    def _show(self) -> None:
        from tqdm.auto import tqdm

        desc, total, unit = self.pending
        self.bar, self.pending = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, unit_scale=unit == "B",
                                      disable=None if self.enabled is None else False), None

    def add_total(self, n: int) -> None:
        if self.pending:  # shown with its first total
            desc, total, unit = self.pending
            self.pending = (desc, (total or 0) + n, unit)
            self._show()
        elif self.bar is not None:
            self.bar.total = (self.bar.total or 0) + n
            self.bar.refresh()

    def update(self, samples: int, tokens: int) -> None:
        if self.pending:
            self._show()
        if self.bar is not None:
            self.tokens += tokens
            self.bar.update(samples)
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(tokens=self.tokens, tok_s=f"{rate:.0f}", refresh=False)

    def advance(self, n: int) -> None:
        """Count `n` units of work done (no token counts)."""
        if self.pending:
            self._show()
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        self.pending = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None
