"""FP8 Linear vs bf16 Linear on decode (M = 1, 8) and prefill (M = 256) shapes, measured in one run.

Columns (speed relative to bf16 `F.linear`, > 1 = faster): fp32 `F.linear`; hqtflow's FP8 QDQ reference (W8A8);
the CPU kernel W8A8 and weight-only (CPU only: FP8 weights widened in registers); `torch._scaled_mm` W8A8 (a real
FP8 GEMM on CUDA compute capability >= 8.9; a slow emulation on CPU). Gate from the issue: FP8 at least as fast
as bf16 at M = 1 on 4096 x 4096 (the memory-bound limit is 2x: half the weight bytes).

By default each shape cycles through enough distinct weight copies to exceed the last-level cache (`--working-set`
MiB per dtype), so weights stream from DRAM the way a model's layers do in decode; `--hot` reuses one copy.

    python bench/fp8_linear.py [--device cuda] [--iters 20] [--hot]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hqtflow.quantize.fp8_linear import FP8Linear, resolve_backend, set_backend  # noqa: E402

SHAPES = {"4096x4096": (4096, 4096), "smollm2 q/o 576x576": (576, 576), "smollm2 up 576->1536": (576, 1536),
          "smollm2 down 1536->576": (1536, 576)}


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
        keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "fma", "avx_vnni", "f16c"))]
        return " ".join(sorted(keep))
    except (OSError, StopIteration):
        return platform.processor()


def timed(fns, iters: int, device: str) -> float:
    """Median seconds per call, cycling through `fns` (one per weight copy)."""
    cycle = itertools.cycle(fns)
    for _ in range(max(3, len(fns))):
        next(cycle)()
    times = []
    for _ in range(iters):
        fn = next(cycle)
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
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--ms", default="1,8,256")
    p.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident for small shapes)")
    p.add_argument("--working-set", type=int, default=512, help="MiB of bf16 weights cycled per shape (default 512)")
    a = p.parse_args()
    dev = a.device
    cpu_kernel = dev == "cpu" and resolve_backend("auto", "cpu") == "cpu"
    print(f"device {dev}: {torch.cuda.get_device_name() if dev == 'cuda' else cpu_flags()}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; median of {a.iters} calls; "
          f"{'hot (one weight copy)' if a.hot else f'cold (weights cycled over {a.working_set} MiB of bf16 copies)'}; "
          "speed vs bf16 (>1 = faster)")
    if dev == "cpu" and not cpu_kernel:
        from hqtflow.quantize import cpu_kernel as ck

        print(f"CPU kernel unavailable: {ck.build_error()}")
    print(f"{'shape':24} {'M':>4} {'bf16 ms':>9} {'fp32':>7} {'fp8 qdq':>8} {'cpu w8a8':>9} {'cpu w-only':>10} {'scaled_mm':>10}")
    gate = None
    for label, (k, n) in SHAPES.items():
        copies = 1 if a.hot else max(1, a.working_set * 2**20 // (2 * k * n))
        torch.manual_seed(0)
        lins = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        lins32 = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.float32) for _ in range(min(copies, 8))]
        for m_ in map(int, a.ms.split(",")):
            x = torch.randn(m_, k, device=dev, dtype=torch.bfloat16)
            s_x = (x.abs().max() / 112).to(torch.bfloat16)
            w8a8 = [FP8Linear.from_linear(l, (l.weight.abs().max() / 224).to(torch.bfloat16), s_x) for l in lins]
            wonly = [FP8Linear.from_linear(l, (l.weight.abs().max() / 224).to(torch.bfloat16), None) for l in lins]
            x32 = x.float()
            row = {}
            with torch.inference_mode():
                row["bf16"] = timed([lambda l=l: l(x) for l in lins], a.iters, dev)
                row["fp32"] = timed([lambda l=l: l(x32) for l in lins32], a.iters, dev)
                for mods, name, backend in ((w8a8, "qdq", "qdq"), (w8a8, "cpu w8a8", "cpu"), (wonly, "cpu w-only", "cpu"),
                                            (w8a8, "scaled_mm", "scaled_mm")):
                    if backend == "cpu" and not cpu_kernel:
                        continue
                    for mod in mods:
                        set_backend(mod, backend)
                    calls = [lambda f=f: f(x) for f in mods]
                    row[name] = timed(calls[: max(1, len(calls) // 4)] if backend in ("qdq", "scaled_mm") and dev == "cpu" else calls,
                                      max(5, a.iters // 3) if backend in ("qdq", "scaled_mm") and dev == "cpu" else a.iters, dev)
            ratio = {k_: row["bf16"] / v for k_, v in row.items()}
            cell = lambda name, w: f"{ratio[name]:>{w - 1}.2f}x" if name in ratio else f"{'-':>{w}}"  # noqa: E731
            print(f"{label:24} {m_:>4} {row['bf16'] * 1e3:>9.3f} {cell('fp32', 7)} {cell('qdq', 8)} {cell('cpu w8a8', 9)} "
                  f"{cell('cpu w-only', 10)} {cell('scaled_mm', 10)}")
            if label == "4096x4096" and m_ == 1:
                gate = max(v for k_, v in ratio.items() if k_ not in ("bf16", "fp32"))
    if gate is not None:
        verdict = "met" if gate >= 1.0 else "NOT met"
        print(f"\ngate (FP8 >= bf16 speed at M=1, 4096x4096): best FP8 backend {gate:.2f}x bf16: {verdict}")


if __name__ == "__main__":
    main()
