"""bf16 matmuls computed by the fp32 GEMM where that is faster (`hardware.fp32_gemm_is_faster`: CPUs without native
bf16 dot products, Intel cores with AVX512-BF16 but no AMX): the same function, faster.

A bf16 GEMM multiplies bf16 values (exactly, in fp32), sums in fp32 and rounds once to bf16; `F.linear(x.float(),
w.float()).bfloat16()` computes that function too, only the order of the sums differs (as it does between any two
GEMM kernels, and within one as the shape changes). On CPUs without AVX512-BF16/AMX torch emulates bf16 matmuls, about
5x slower than this at 2048 x 576 -> 1536 (`bench/bf16_matmul.py --as-avx2`: 4.9-6.7x with torch's AVX2 kernels on a
shared 2-core machine; at 64-256 rows it does not pay); on an Emerald Rapids without AMX, oneDNN's native bf16 GEMM
is 1.4-1.7x slower than this at 2048-8192 rows. hqtflow runs its prefill-shaped bf16 work this way on
both: calibration forwards (hqtflow's and INC's engines alike) and the bf16 reference of `eval` and KL. The weight
is widened per call, which suits many rows at a time, not decode.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.overrides import TorchFunctionMode

from hqtflow.hardware import fp32_gemm_is_faster

_F = torch.nn.functional
_MATMULS = {_F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm,
            torch.bmm, torch.Tensor.bmm}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not DTensor shards or other tensor subclasses


def _bf16_cpu(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN and t.dtype == torch.bfloat16 and t.device.type == "cpu"


class Bf16MatmulsViaFp32(TorchFunctionMode):
    """Inside it, a matmul whose tensors are all plain bf16 CPU tensors runs in fp32 and is rounded to bf16."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS and "out" not in kwargs:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if tensors and all(_bf16_cpu(t) for t in tensors):
                args = tuple(a.float() if isinstance(a, torch.Tensor) else a for a in args)
                kwargs = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                return func(*args, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def bf16_matmuls_via_fp32(enabled: bool | None = None):
    """The mode where it pays (`enabled=None`: where `fp32_gemm_is_faster`), else a no-op."""
    if enabled is False or (enabled is None and not fp32_gemm_is_faster()):
        return nullcontext()
    return Bf16MatmulsViaFp32()
