"""bf16 matmuls through the fp32 GEMM (`hqtflow.bf16_matmul`, what hqtflow runs where `hardware.fp32_gemm_is_faster`:
CPUs without native bf16 dot products, Intel cores with AVX512-BF16 but no AMX) vs torch's own bf16 matmul, at one
Linear shape (default SmolLM2's up projection over 2048 rows), one run.

Columns (speed relative to the baseline, > 1 = faster): the baseline is torch's bf16 `F.linear` as it runs on a
CPU without AVX512-BF16/AMX (its emulated GEMM: oneDNN's bf16 path switched off, which is what such CPUs get), the
path `bf16_matmuls_via_fp32` replaces; then hqtflow's fp32-GEMM path; then this machine's native bf16 matmul (oneDNN
on), which hqtflow keeps where it is the faster one (AMX; AMD cores with AVX512-BF16). Before timing, every column's
output is checked against the others (all compute the same bf16 GEMM, only the order of the sums differs: SQNR >= 40
dB). `--as-avx2` reruns the bench with torch's AVX2 kernels (ATen and MKL) on an AVX-512 machine: the arithmetic of the
CPUs without native bf16.

    python bench/bf16_matmul.py [--shape 2048,576,1536] [--iters 5] [--as-avx2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks import require_sqnr  # noqa: E402
from hqtflow.bf16_matmul import Bf16MatmulsViaFp32  # noqa: E402
from hqtflow.hardware import fp32_gemm_is_faster, machine_line  # noqa: E402
from timing import interleaved_medians  # noqa: E402

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def emulated_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch's bf16 linear without oneDNN's bf16 kernels: what a CPU without native bf16 computes."""
    with torch.backends.mkldnn.flags(enabled=False, allow_tf32=None, fp32_precision=None):  # only the switch
        return F.linear(x, w)


def via_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    with Bf16MatmulsViaFp32():
        return F.linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048,576,1536", help="M,K,N: rows, in features, out features")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--as-avx2", action="store_true", help="rerun with torch's AVX2 kernels (ATen and MKL)")
    a = ap.parse_args()
    if a.as_avx2 and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    try:
        m, k, n = (int(v) for v in a.shape.split(","))
    except ValueError:
        ap.error(f"--shape {a.shape!r}: give three integers M,K,N")
    torch.set_grad_enabled(False)
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ATen CPU kernels "
          f"{torch.backends.cpu.get_cpu_capability()}, MKL instructions "
          f"{os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'all')}; "
          f"hqtflow's bf16 GEMMs here: {'via fp32' if fp32_gemm_is_faster() else 'native'}; {m} x {k} -> {n}, "
          f"median of {a.iters} calls")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    calls = {"bf16 without native bf16": lambda: emulated_bf16(x, w),
             "bf16 via fp32 GEMM (hqtflow)": lambda: via_fp32(x, w),
             "bf16 native (oneDNN)": lambda: F.linear(x, w)}
    outs = {name: fn() for name, fn in calls.items()}  # also the warm-up
    ref = outs["bf16 without native bf16"]
    db = min(require_sqnr(name, ref, out, min_db=40.0) for name, out in outs.items())
    t = interleaved_medians(calls, a.iters)
    base = t["bf16 without native bf16"]
    print(f"outputs checked: the three bf16 GEMMs agree to SQNR >= {db:.1f} dB (>= 40 required)")
    print(f"baseline: bf16 without native bf16, {base * 1e3:.1f} ms")
    for name, sec in t.items():
        print(f"{name:30} {base / sec:>7.2f}x")
    gain = base / t["bf16 via fp32 GEMM (hqtflow)"]
    native = t["bf16 native (oneDNN)"] / t["bf16 via fp32 GEMM (hqtflow)"]
    print(f"bf16 via fp32 GEMM: {gain:.2f}x torch's bf16 matmul without native bf16; {native:.2f}x this machine's "
          f"native bf16 matmul (hqtflow turns it on where hardware.fp32_gemm_is_faster: here "
          f"{'yes' if fp32_gemm_is_faster() else 'no'})")


if __name__ == "__main__":
    main()
