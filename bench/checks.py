"""Output checks for the speed benches: a fast path that computes the wrong thing fails loudly instead of winning.
Each compares the FP8 path with the high-precision path on the same input; on failure the bench exits non-zero
with one sentence and prints no ratio for it."""

from __future__ import annotations

import sys

import torch


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `got` against `ref`, in dB (FP8 E4M3 on one Linear: about 25-30)."""
    ref, got = ref.float(), got.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum().clamp_min(1e-30)))


def require_sqnr(what: str, ref: torch.Tensor, got: torch.Tensor, min_db: float = 20.0) -> float:
    db = sqnr_db(ref, got)
    if not db >= min_db:
        sys.exit(f"{what}: output SQNR {db:.1f} dB against the high-precision output, under {min_db:g} dB: the path "
                 f"computes the wrong thing, so its speed is not reported.")
    return db


def require_top5(what: str, ref_logits: torch.Tensor, got_logits: torch.Tensor, min_rate: float = 0.9) -> float:
    """The share of positions whose FP8 argmax is in the high-precision top 5; exits under `min_rate`."""
    top5 = ref_logits.float().topk(5, dim=-1).indices
    rate = float((top5 == got_logits.float().argmax(-1, keepdim=True)).any(-1).float().mean())
    if rate < min_rate:
        sys.exit(f"{what}: the FP8 model's top token is in the high-precision top 5 at only {100 * rate:.0f}% of "
                 f"positions (need {100 * min_rate:.0f}%): the path computes the wrong thing, so its speed is not "
                 f"reported.")
    return rate
