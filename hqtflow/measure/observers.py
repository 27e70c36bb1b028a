"""maxabs observers: running max of |x| per tensor, or per channel, accumulated in float32.

Neural Compressor keeps per-tensor state in hp_dtype (bf16 by default); the max of |x| over bf16 values is a
bf16 value, so for a bf16 model both agree exactly, while an fp32 model keeps full precision here.
Padding is excluded by passing a boolean `mask` over the leading (token) dimensions.
"""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """Restrict `x` (..., C) to the valid tokens; None when no token is valid."""
    if mask is None:
        return x
    if x.shape[:-1] == mask.shape:
        rows = x[mask]
    elif x.dim() == 2 and x.shape[0] == mask.numel():  # flattened tokens (MoE blocks)
        rows = x[mask.reshape(-1)]
    else:  # a shape the mask does not describe (e.g. decode steps): every position is real
        return x
    return rows if rows.numel() else None


def _maxabs(x: torch.Tensor) -> torch.Tensor:
    """max |x| in one pass with no temporary (aminmax), instead of abs() (a copy) then amax."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, lo.neg())


class MaxAbs:
    """Per-tensor maxabs; state is a float32 (1, 1) tensor like INC's."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.state = torch.zeros((1, 1), dtype=torch.float32, device=device)
        self.used = False

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None, lengths: list[int] | None = None) -> None:
        """`lengths`: with right padding, the valid prefix of each row (views, no gather)."""
        x = x.detach()
        if lengths is not None and mask is not None and x.shape[:-1] == mask.shape:
            parts = [_maxabs(x[row, :n]) for row, n in enumerate(lengths) if n]
            if not parts:
                return
            m = torch.stack(parts).max()
        else:
            x = _rows(x, mask)
            if x is None or x.numel() == 0:
                return
            m = _maxabs(x)
        torch.maximum(self.state, m.float().reshape(1, 1), out=self.state)
        self.used = True


class MaxAbsPerChannel:
    """Per-channel maxabs along `dim`; state is a float32 (C, 1) tensor like INC's."""

    def __init__(self, dim: int = -1):
        self.dim = dim
        self.state: torch.Tensor | None = None
        self.used = False

    def update(self, x: torch.Tensor, mask: torch.Tensor | None = None, lengths: list[int] | None = None) -> None:
        x = x.detach()
        if self.dim in (-1, x.dim() - 1):
            x = _rows(x, mask)
            if x is None:
                return
            m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0)
        else:  # weights: channel dim 0, reduce over the rest
            m = x.reshape(x.shape[0], -1).abs().amax(dim=1)
        m = m.float().reshape(-1, 1)
        if self.state is None:
            self.state = m.clone()
        else:
            torch.maximum(self.state, m, out=self.state)
        self.used = True


def make_observer(per_channel: bool, *, dim: int = -1, device: torch.device | str = "cpu"):
    return MaxAbsPerChannel(dim) if per_channel else MaxAbs(device)


def weight_stat(w: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """maxabs of a weight [out, in]: (1, 1), or per output channel (out, 1)."""
    obs = make_observer(per_channel, dim=0, device=w.device)
    with torch.no_grad():
        obs.update(w.detach())
    return obs.state
