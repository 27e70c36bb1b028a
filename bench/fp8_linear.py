"""FP8 Linear vs bf16 Linear on decode (M = 1, 8) and prefill (M = 256) shapes, measured in one run.

Backends: bf16 `F.linear` (the baseline), fp32 `F.linear`, hqtflow's FP8 QDQ reference, and FP8 `torch._scaled_mm`
(a real FP8 GEMM on CUDA compute capability >= 8.9; a slow emulation on CPU). Printed as speed relative to bf16
(> 1 = faster than bf16). Gate from the issue: FP8 at least as fast as bf16 at M = 1 on 4096 x 4096.

    python bench/fp8_linear.py [--device cuda] [--iters 50]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hqtflow.quantize.fp8_linear import FP8Linear, set_backend  # noqa: E402

SHAPES = {"4096x4096": (4096, 4096), "smollm2 q/o 576x576": (576, 576), "smollm2 up 576->1536": (576, 1536),
          "smollm2 down 1536->576": (1536, 576)}


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
        keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma", "avx_vnni"))]
        return " ".join(sorted(keep))
    except (OSError, StopIteration):
        return platform.processor()


def timed(fn, iters: int, device: str) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ms", default="1,8,256")
    a = p.parse_args()
    dev = a.device
    print(f"device {dev}: {torch.cuda.get_device_name() if dev == 'cuda' else cpu_flags()}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; median of {a.iters} calls; speed vs bf16 (>1 = faster)")
    print(f"{'shape':24} {'M':>4} {'bf16 ms':>9} {'fp32':>7} {'fp8 qdq':>8} {'fp8 scaled_mm':>14}")
    gate = None
    for label, (k, n) in SHAPES.items():
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        lin32 = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.float32)
        for m_ in map(int, a.ms.split(",")):
            x = torch.randn(m_, k, device=dev, dtype=torch.bfloat16)
            s_x = (x.abs().max() / 112).to(torch.bfloat16)
            fp8 = FP8Linear.from_linear(lin, (lin.weight.abs().max() / 224).to(torch.bfloat16), s_x)
            x32 = x.float()
            with torch.inference_mode():
                t_bf16 = timed(lambda: lin(x), a.iters, dev)
                t_fp32 = timed(lambda: lin32(x32), a.iters, dev)
                set_backend(fp8, "qdq")
                t_qdq = timed(lambda: fp8(x), a.iters, dev)
                set_backend(fp8, "scaled_mm")
                t_mm = timed(lambda: fp8(x), a.iters, dev)
            print(f"{label:24} {m_:>4} {t_bf16 * 1e3:>9.3f} {t_bf16 / t_fp32:>6.2f}x {t_bf16 / t_qdq:>7.2f}x {t_bf16 / t_mm:>13.2f}x")
            if label == "4096x4096" and m_ == 1:
                gate = max(t_bf16 / t_qdq, t_bf16 / t_mm)
    verdict = "met" if gate and gate >= 1.0 else "NOT met"
    print(f"\ngate (FP8 >= bf16 speed at M=1, 4096x4096): best FP8 backend {gate:.2f}x bf16: {verdict}")


if __name__ == "__main__":
    main()
