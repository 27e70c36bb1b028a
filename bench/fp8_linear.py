"""FP8 Linear vs the fastest high-precision Linear on this machine, for M = 1 .. 512, measured in one run.

The baseline of every ratio is the faster of bf16 and fp32 `F.linear` at that shape and M (on CPUs without native
bf16 dot products fp32 is several times faster than bf16). Columns (speed relative to that baseline, > 1 = faster):
bf16 and fp32 themselves; hqtflow's FP8 QDQ reference (W8A8); the CPU kernel W8A8 and weight-only with bf16
activations (FP8 weights widened in registers or per panel, batch-invariant), and W8A8 with fp32 activations (what
`--dtype auto` runs without native bf16); on AVX-512 machines, its AVX2-only build (`avx2`, the path of CPUs
without AVX-512) W8A8 in fp32; `torch._scaled_mm` W8A8 (a real FP8 GEMM on CUDA compute capability >= 8.9; a slow
emulation on CPU). Targets (issue): M=1 >= 1.5x at 4096^2 and >= 1.0x on SmolLM2 shapes, M=8 >= 1.2x, M=256 and
512 >= 1.0x.

Before timing, every FP8 column's output is checked against the high-precision Linear it was made from (SQNR >= 20
dB; a wrong path exits without a ratio). The columns are timed interleaved, call by call (the median of each), so a host whose speed drifts affects them
alike. By default each shape cycles through enough distinct weight copies to exceed the last-level cache (`--working-set`
MiB per dtype), so weights stream from DRAM the way a model's layers do in decode; `--hot` reuses one copy.

On an AMX machine `--kernel bf16dot` times the build without tiles (the path of Intel CPUs without AMX: FP8 pairs
widened to bf16, then two fp32 FMAs a pair at M > 36); run it with `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` so that bf16
`F.linear` leaves AMX too, and the baseline is that CPU's.

    python bench/fp8_linear.py [--device cuda] [--kernel bf16dot] [--iters 20] [--hot] [--per-channel] [--ms 1,8,256,512] [--columns "cpu w8a8,cpu w-only"]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import packed_linears  # noqa: E402
from checks import require_sqnr  # noqa: E402
from hqtflow.hardware import cpu_flags, fastest_dtype, machine_line  # noqa: E402
from hqtflow.quantize.fp8_linear import FP8Linear, resolve_backend, set_backend  # noqa: E402

SHAPES = {"4096x4096": (4096, 4096), "smollm2 q/o 576x576": (576, 576), "smollm2 up 576->1536": (576, 1536),
          "smollm2 down 1536->576": (1536, 576)}


def timed(columns: dict[str, tuple[list, int]], device: str) -> dict[str, float]:
    """Median seconds per call of each column ({name: (calls, iters)}, one call per weight copy, cycled), the
    columns interleaved call by call: a host whose speed drifts (shared machines swing by 2-3x for seconds at a
    time) slows every column alike instead of whichever ran during the slow phase. Each round takes the columns in a
    new random order: a call runs slower right after some others (after fp32's 1 ms GEMM, a 576^2 call at M=512 took
    0.29 ms instead of 0.22 on an AMX Xeon), and a fixed order charged that to whichever column came next."""
    cycles = {name: itertools.cycle(calls) for name, (calls, _) in columns.items()}
    for name, (calls, _) in columns.items():
        for _ in range(max(3, len(calls))):
            next(cycles[name])()
    times: dict[str, list[float]] = {name: [] for name in columns}
    order, shuffle = list(columns), random.Random(0).shuffle
    for i in range(max(iters for _, iters in columns.values())):
        shuffle(order)
        for name in order:
            if i >= columns[name][1]:
                continue
            fn = next(cycles[name])
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


TARGETS = {1: 1.0, 8: 1.2, 256: 1.0, 512: 1.0}  # M -> best FP8 / baseline (M=1 at 4096^2: 1.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--ms", default="1,8,256,512")
    p.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident for small shapes)")
    p.add_argument("--working-set", type=int, default=512, help="MiB of bf16 weights cycled per shape (default 512)")
    p.add_argument("--per-channel", action="store_true", help="one weight scale per output row (compressed-tensors "
                   "per-channel checkpoints, the *_pcs_* scale methods) instead of one per tensor")
    p.add_argument("--pow2", action="store_true", help="weight scales rounded up to powers of two, as HQT's *_pow2 "
                   "methods give them (per channel: the CPU kernel's bf16 register paths scale each row's sum)")
    p.add_argument("--kernel", default="native", choices=("native", "bf16dot"),
                   help="the CPU kernel build the cpu columns run: bf16dot is the AVX512-BF16 build without AMX tiles, "
                   "on an AMX machine the path of Intel CPUs without AMX (with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 in "
                   "the environment bf16 F.linear leaves AMX too: the baseline of such a CPU)")
    p.add_argument("--columns", default=None, help="comma-separated FP8 columns to measure (default: all; the bf16 and "
                   "fp32 baselines always run). On a CPU `qdq` and `scaled_mm` emulate and take most of the run")
    a = p.parse_args()
    dev = a.device
    cpu_kernel = dev == "cpu" and resolve_backend("auto", "cpu") == "cpu"
    avx2 = None
    if cpu_kernel:
        from hqtflow.quantize import cpu_kernel as ck

        if a.kernel != "native" and not ck.load(a.kernel):
            sys.exit(f"--kernel {a.kernel}: the build failed: {ck.build_error(a.kernel)}")
        kernel = ck.ops(a.kernel)
        isa = kernel.fp8_isa()
        avx2 = ck.ops("avx2") if "avx512f" in cpu_flags() and ck.load("avx2") else None  # else: the native build
    print(f"device {dev}{f': {torch.cuda.get_device_name()}' if dev == 'cuda' else ''}; {machine_line()}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; median of {a.iters} calls; "
          f"{'hot (one weight copy)' if a.hot else f'cold (weights cycled over {a.working_set} MiB of bf16 copies)'}; "
          f"{'per-channel' if a.per_channel else 'per-tensor'}{' power-of-two' if a.pow2 else ''} weight scales; "
          f"--dtype auto here: {fastest_dtype(dev)}"
          + (f"; CPU kernel ({a.kernel} build) path for bf16: {isa}" if cpu_kernel else ""))
    if dev == "cpu" and not cpu_kernel:
        from hqtflow.quantize import cpu_kernel as ck

        print(f"CPU kernel unavailable: {ck.build_error()}")
    print("speed vs the fastest high-precision Linear at each row: bf16 or fp32 F.linear, or the kernel's packed bf16 "
          "path (`hp packed`, as hqtflow runs a plain model's Linears) (>1 = FP8 faster)")
    cols = ["bf16", "fp32", "hp packed", "qdq", "cpu w8a8", "cpu w-only", "cpu fp32", "avx2 fp32", "scaled_mm"]
    wanted = set(cols) if a.columns is None else {"bf16", "fp32", "hp packed", *(c.strip() for c in a.columns.split(","))}
    if unknown := wanted - set(cols):
        p.error(f"--columns: unknown {', '.join(sorted(unknown))} (choose from {', '.join(cols[3:])})")
    cols = [c for c in cols if c in wanted]
    print(f"{'shape':24} {'M':>4} {'base ms':>8} " + " ".join(f"{c:>10}" for c in cols) + f" {'best FP8':>9}")
    verdicts, worst = [], float("inf")
    for label, (k, n) in SHAPES.items():
        copies = 1 if a.hot else max(1, a.working_set * 2**20 // (2 * k * n))
        torch.manual_seed(0)
        lins = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        lins32 = [torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.float32) for _ in range(max(1, copies // 2))]
        for m_ in map(int, a.ms.split(",")):
            x = torch.randn(m_, k, device=dev, dtype=torch.bfloat16)
            x32 = x.float()
            s_x = (x.abs().max() / 112).to(torch.bfloat16)
            slow = dev == "cpu"  # the QDQ reference and _scaled_mm emulate on CPU: fewer copies and calls
            w_max = lambda w: w.abs().amax(1) if a.per_channel else w.abs().max()  # noqa: E731
            pow2 = (lambda v: 2.0 ** torch.ceil(torch.log2(v))) if a.pow2 else (lambda v: v)  # noqa: E731
            w_scale = lambda l: pow2(w_max(l.weight).float() / 224).to(l.weight.dtype)  # noqa: E731
            runs = [("qdq", "qdq", lins, s_x, x), ("cpu w8a8", "cpu", lins, s_x, x), ("cpu w-only", "cpu", lins, None, x),
                    ("cpu fp32", "cpu", lins32, s_x.float(), x32), ("scaled_mm", "scaled_mm", lins, s_x, x)]
            columns = {"bf16": ([lambda l=l: l(x) for l in lins], a.iters),
                       "fp32": ([lambda l=l: l(x32) for l in lins32], a.iters)}
            built: dict[str, list] = {}
            # the high-precision Linear hqtflow itself runs (packed bf16 values), with the native build only
            if cpu_kernel and a.kernel == "native" and (hp := packed_linears([l.weight for l in lins])) is not None:
                x_hp = x.to(hp[1])
                columns["hp packed"] = ([lambda h=h: h(x_hp) for h in hp[0]], a.iters)
            for name, backend, source, s_in, xin in runs:  # a module list per column: no backend switch per call
                if (backend == "cpu" and not cpu_kernel) or name not in wanted:
                    continue
                few = slow and backend in ("qdq", "scaled_mm")
                mods = []
                for l in source[: max(1, len(source) // 4)] if few else source:
                    mod = FP8Linear.from_linear(l, w_scale(l), s_in)
                    set_backend(mod, backend)
                    mods.append(mod)
                if backend == "cpu" and a.kernel != "native":  # the same modules' tensors through the other build
                    calls = [lambda f=f, xin=xin, pk=kernel.fp8_pack(f.weight): kernel.fp8_linear(
                        xin, f.weight, f.weight_scale, f.input_scale, None, pk) for f in mods]
                else:
                    calls = [lambda f=f, xin=xin: f(xin) for f in mods]
                columns[name] = (calls, max(5, a.iters // 3) if few else a.iters)
                built[name] = mods
            if avx2 is not None and "avx2 fp32" in wanted:  # the fp32 modules of "cpu fp32" when it ran
                f32 = built.get("cpu fp32") or [FP8Linear.from_linear(l, w_scale(l), s_x.float()) for l in lins32]
                packs = [avx2.fp8_pack(f.weight) for f in f32]  # as set_backend("cpu") makes them
                columns["avx2 fp32"] = ([lambda f=f, p=p: avx2.fp8_linear(x32, f.weight, f.weight_scale, f.input_scale,
                                                                          None, p) for f, p in zip(f32, packs)], a.iters)
            with torch.inference_mode():  # modules built outside it: their packing tracks the weights
                for name, mods in built.items():  # each FP8 column against the Linear it was made from
                    src, xin = (lins32, x32) if name == "cpu fp32" else (lins, x)
                    worst = min(worst, require_sqnr(f"{label} M={m_} {name}", src[0](xin), columns[name][0][0]()))
                if "avx2 fp32" in columns:
                    worst = min(worst, require_sqnr(f"{label} M={m_} avx2 fp32", f32[0](x32), columns["avx2 fp32"][0][0]()))
                row = timed(columns, dev)
            base = min(row[c] for c in ("bf16", "fp32", "hp packed") if c in row)
            ratio = {k_: base / v for k_, v in row.items()}
            best = max((v for k_, v in ratio.items() if k_ not in ("bf16", "fp32", "hp packed", "avx2 fp32")), default=0.0)
            gate = "scaled_mm" if dev == "cuda" else ("cpu w8a8" if fastest_dtype(dev) == "bf16" else "cpu fp32")
            cell = lambda name: f"{ratio[name]:>9.2f}x" if name in ratio else f"{'-':>10}"  # noqa: E731
            print(f"{label:24} {m_:>4} {base * 1e3:>8.3f} " + " ".join(cell(c) for c in cols) + f" {best:>8.2f}x", flush=True)
            target = 1.5 if (label == "4096x4096" and m_ == 1) else TARGETS.get(m_)
            if target is not None and gate in row:
                got = ratio.get(gate, 0.0)
                verdicts.append(f"{label} M={m_}: {gate} (the default W8A8 at --dtype auto) {got:.2f}x (target {target}x) "
                                f"{'met' if got >= target else 'NOT met'}")
    print(f"\noutputs checked: every FP8 column against the Linear it was made from, lowest SQNR {worst:.1f} dB "
          f"(>= 20 required)")
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
