"""GPTQ rounding of a weight onto its FP8 grid (Frantar et al., 2022), the scales left as the method chose them.

Round-to-nearest casts each weight to the nearest FP8 value on its own. GPTQ rounds one input column at a time and
spreads each column's rounding error over the columns not yet rounded, weighted by the calibration inputs' second
moment H = E[x xᵀ], so that the layer's *output* error ||X (W - Q)ᵀ|| is small rather than each weight's. The
result is a weight on the same grid (same scales, same checkpoint layout); only which FP8 code each weight gets
changes. Columns are taken in order of decreasing H diagonal ("act order"), in blocks of `block` columns with
the lazy batch update, from the Cholesky factor of H⁻¹ with `damp` x mean(diag H) added to the diagonal.
"""

from __future__ import annotations

import torch

from hqtflow.scales import FP8_DTYPES


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)⁻¹. Float32 rounding can leave a measured H a hair short
    of positive definite: the damping grows tenfold, twice; an H that needs more is not a second moment."""
    mean = float(h.diagonal().mean()) or 1.0
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(3):
        chol, info = torch.linalg.cholesky_ex(h + damp * mean * eye)
        if int(info) == 0:
            inv_chol, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
            if int(info) == 0:
                return inv_chol
        damp *= 10
    raise ValueError("the Hessian is not positive definite even with damping")


@torch.no_grad()
def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, fp8: str = "E4M3", *,
               fullscale: float | None = None, damp: float = 0.01, block: int = 128,
               act_order: bool = True) -> torch.Tensor:
    """`weight` [out, in] moved onto its FP8 grid `q * scale` (scale 0-d or [out], as `quantize_linear` applies it)
    by GPTQ with `hessian` [in, in]; returned in weight's dtype, so that quantizing it with `scale` gives the
    chosen codes exactly. `fullscale`: the largest code magnitude (default: the FP8 dtype's maximum).

    A diagonal Hessian gives round-to-nearest's codes exactly (no error is spread)."""
    fp8_dtype = FP8_DTYPES[fp8]
    F = float(torch.finfo(fp8_dtype).max) if fullscale is None else float(fullscale)
    out_features, n = weight.shape
    s = scale.detach().to(weight.dtype).float().reshape(1, -1).expand(1, out_features).reshape(-1)
    wt = weight.detach().float().t().contiguous()  # [in, out]: one input column per contiguous row
    h = hessian.detach().float().clone()
    top = float(h.diagonal().max())
    if top > 0:
        h /= top  # GPTQ does not depend on H's scale; normalized, tiny inputs keep float32 precision
    dead = h.diagonal() <= 0  # inputs never seen in calibration: rounded to nearest, spreading nothing
    h[dead, :] = 0
    h[:, dead] = 0
    h.diagonal()[dead] = 1
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        wt, h = wt[perm], h[perm][:, perm]
    u = _inverse_cholesky(h, damp)
    qt = torch.empty_like(wt)
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        wb, ub, qb = wt[b0:b1], u[b0:b1, b0:b1], qt[b0:b1]
        err = torch.empty_like(wb)
        diag = ub.diagonal().tolist()
        for i in range(b1 - b0):
            col, e = wb[i], err[i]
            torch.mul(torch.div(col, s).clamp_(-F, F).to(fp8_dtype).float(), s, out=qb[i])
            torch.sub(col, qb[i], out=e).div_(diag[i])
            wb[i + 1:].addr_(ub[i, i + 1:], e, alpha=-1)  # spread this column's error over the block's rest
        wt[b1:].addmm_(u[b0:b1, b1:].t(), err, alpha=-1)  # and, once per block, over the columns after it
    if perm is not None:
        qt = qt[torch.argsort(perm)]
    return qt.t().to(weight.dtype)
