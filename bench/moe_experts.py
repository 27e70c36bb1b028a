"""One MoE experts layer: hqtflow's FP8 experts (one FP8 Linear pair per expert, the CPU kernel) vs transformers'
fused experts in high precision, for M = 1 .. 256 tokens, measured in one run.

Shape: OLMoE-1B-7B's (hidden 2048, expert intermediate 1024, 64 experts, top-8), tokens routed uniformly at random
(the same routing for every column). The baseline of every ratio is the fastest high-precision column at that M:
transformers' default `grouped_mm` and its eager loop, each in bf16 and fp32 (on CPUs without native bf16 dot
products fp32 is faster). Columns (speed relative to that baseline, > 1 = faster): those four, and the FP8 experts
W8A8 with static per-expert input scales computing in bf16 and in fp32. Before timing, the FP8 outputs are checked against
the fp32 experts' (SQNR >= 20 dB, else it exits without a ratio). Columns are timed interleaved, call by call
(the median of each), so a host whose speed drifts affects them alike.

    python bench/moe_experts.py [--ms 1,8,32,256] [--iters 10] [--experts 64] [--top-k 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checks import require_sqnr  # noqa: E402
from hqtflow.hardware import machine_line  # noqa: E402
from hqtflow.quantize.experts import unfuse_experts  # noqa: E402
from hqtflow.quantize.fp8_linear import FP8Linear, compute_in, set_backend  # noqa: E402
from timing import interleaved_medians  # noqa: E402


def fused_experts(hidden: int, inter: int, experts: int, dtype: torch.dtype, impl: str) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    mod = MixtralExperts(cfg)
    nn.init.normal_(mod.gate_up_proj, std=0.02)
    nn.init.normal_(mod.down_proj, std=0.02)
    return mod.to(dtype).eval()


def fp8_experts(src: nn.Module, x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """`src` unfused and each expert's Linears quantized: per-tensor weight scales, static input scales from the
    inputs each expert sees (its routed tokens, and act(gate) * up)."""
    holder = nn.Module()
    holder.experts = src
    unfuse_experts(holder)
    seen: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, max(seen.get(n, 0.0), float(a[0].abs().max()))))
             for n, m in holder.experts.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        holder.experts(x, idx, torch.ones(idx.shape, dtype=x.dtype))
    for h in hooks:
        h.remove()
    for name, lin in list(holder.experts.named_modules()):
        if isinstance(lin, nn.Linear):
            ws = lin.weight.float().abs().max() / 448
            si = torch.tensor(seen.get(name, 1.0) / 448)
            holder.experts.set_submodule(name, FP8Linear.from_linear(lin, ws.to(lin.weight.dtype), si.to(lin.weight.dtype)))
    compute_in(holder, dtype)  # what `--dtype` does to a loaded checkpoint
    set_backend(holder, "cpu")
    return holder.experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,32,256")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1024)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    from hqtflow.quantize import cpu_kernel

    if not cpu_kernel.available():
        sys.exit(f"the CPU FP8 kernel could not be built: {cpu_kernel.build_error()}")
    print(f"{machine_line()}; FP8 kernel path {torch.ops.hqtflow.fp8_isa()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; experts {a.experts}, top-{a.top_k}, "
          f"hidden {a.hidden}, expert intermediate {a.inter}")
    g = torch.Generator().manual_seed(0)
    calib = torch.randn(512, a.hidden, generator=g)
    calib_idx = torch.stack([torch.randperm(a.experts, generator=g)[:a.top_k] for _ in range(512)])
    hp = {(dt, impl): fused_experts(a.hidden, a.inter, a.experts, dt, impl)
          for dt in (torch.bfloat16, torch.float32) for impl in ("grouped_mm", "eager")}
    fp8 = {dt: fp8_experts(fused_experts(a.hidden, a.inter, a.experts, torch.bfloat16, "eager"), calib.bfloat16(),
                           calib_idx, dt) for dt in (torch.bfloat16, torch.float32)}
    names = {(torch.bfloat16, "grouped_mm"): "bf16 grouped_mm", (torch.bfloat16, "eager"): "bf16 eager",
             (torch.float32, "grouped_mm"): "fp32 grouped_mm", (torch.float32, "eager"): "fp32 eager"}
    cols = list(names.values()) + ["fp8 w8a8 bf16", "fp8 w8a8 fp32"]
    print(f"{'M':>5}  " + "  ".join(f"{c:>15}" for c in cols) + "   baseline (ms)")
    for m in (int(v) for v in a.ms.split(",")):
        x = torch.randn(m, a.hidden, generator=g)
        idx = torch.stack([torch.randperm(a.experts, generator=g)[:a.top_k] for _ in range(m)])
        w = torch.rand(m, a.top_k, generator=g)
        calls = {names[k]: (lambda mod=mod, dt=k[0]: mod(x.to(dt), idx, w.to(dt))) for k, mod in hp.items()}
        calls.update({f"fp8 w8a8 {'bf16' if dt == torch.bfloat16 else 'fp32'}": (lambda mod=mod, dt=dt: mod(x.to(dt), idx, w.to(dt)))
                      for dt, mod in fp8.items()})
        ref = calls["fp32 eager"]()  # the FP8 experts were made from these weights (same seed)
        db = min(require_sqnr(f"M={m} {c}", ref, calls[c]()) for c in cols[4:])
        for fn in calls.values():  # warm-up
            fn()
        t = interleaved_medians(calls, a.iters)
        base_name = min(names.values(), key=lambda k: t[k])
        print(f"{m:>5}  " + "  ".join(f"{t[base_name] / t[c]:>14.2f}x" for c in cols) +
              f"   {base_name} {t[base_name] * 1e3:.1f}; FP8 output SQNR >= {db:.1f} dB")


if __name__ == "__main__":
    main()
