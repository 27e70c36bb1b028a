"""The CUDA path's static input quantization in one Triton kernel: the bytes of `scales.quantize`.

cast(clamp(x / s, -F, F)) to FP8 with the reference's arithmetic: x widened to float32, an IEEE round-to-nearest
division by the float32 scale (`div_rn`, as torch's division), NaN kept by the clamp, a round-to-nearest-even cast.
Eager aten takes three kernels for it (a bf16 / float32 division that writes a float32 copy of x, the clamp, the
cast) and `torch.compile`'s one kernel costs more host time to dispatch than the two it saves; this is one kernel,
launched by Triton's own launcher. Torch's CUDA builds ship Triton; `available` says it is there with a GPU.
"""

from __future__ import annotations

import torch

from hqtflow.scales import FP8_DTYPES

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 2048
_FMAX = {name: float(torch.finfo(dtype).max) for name, dtype in FP8_DTYPES.items()}

if triton is not None:
    @triton.jit
    def _quantize(x_ptr, scale_ptr, out_ptr, n, fmax, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside).to(tl.float32)
        y = tl.div_rn(x, tl.load(scale_ptr))
        y = tl.clamp(y, -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=inside)


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8: str = "E4M3") -> torch.Tensor:
    """`scales.quantize(x, scale, fp8)` in one kernel, for a one-element float32 `scale` on x's device."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8_DTYPES[fp8], device=x.device)
    if x.numel():
        _quantize[(triton.cdiv(x.numel(), BLOCK),)](x, scale, out, x.numel(), _FMAX[fp8], BLOCK=BLOCK)
    return out


available = triton is not None and torch.cuda.is_available()  # a GPU for it to run on
