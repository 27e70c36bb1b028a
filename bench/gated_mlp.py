"""A gated MLP block, down_proj(silu(gate_proj(x)) * up_proj(x)), FP8 on the CPU kernel vs the fastest
high-precision block on this machine, for M = 1 .. 8192 tokens, measured in one run.

Columns (speed relative to the fastest high-precision block at that M, > 1 = faster): bf16 and fp32 eager torch, and
`packed`, the three Linears on the CPU kernel's packed bf16 path (as `hqtflow.load` runs a plain model); FP8 W8A8
with the three Linears on the kernel and torch's `silu` and `*` between them (unfused); FP8 with `down_proj`
making its input hp(silu(g) * u) inside the kernel call (`fp8_linear_gated`, what `set_backend("cpu")` gives a
Llama-family model). The fused output is checked bit for bit against the unfused one, and both against bf16 (SQNR
>= 20 dB), before any timing. Random weights of SmolLM2's MLP shape (576 -> 1536 -> 576) by default. Prints the CPU
flags; the columns are timed interleaved, call by call (median of each).

    python bench/gated_mlp.py [--hidden 576] [--intermediate 1536] [--ms 1,8,256,512,2048,8192] [--iters 20]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import packed_linears  # noqa: E402
from checks import require_sqnr  # noqa: E402
from hqtflow.hardware import machine_line  # noqa: E402
from hqtflow.quantize.fp8_linear import FP8Linear, set_backend  # noqa: E402
from hqtflow.quantize.gated_mlp import act_table  # noqa: E402
from timing import interleaved_medians  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--ms", default="1,8,256,512,2048,8192")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    h, i = a.hidden, a.intermediate
    lins = {n: torch.nn.Linear(k, o, bias=False).bfloat16() for n, (k, o) in
            {"gate": (h, i), "up": (h, i), "down": (i, h)}.items()}
    x_all = torch.randn(max(map(int, a.ms.split(","))), h, dtype=torch.bfloat16)
    with torch.no_grad():
        inner = F.silu(lins["gate"](x_all)) * lins["up"](x_all)
    scale = {"gate": x_all.abs().max() / 448, "up": x_all.abs().max() / 448, "down": inner.abs().max() / 448}
    fp8 = torch.nn.ModuleDict({n: FP8Linear.from_linear(l, l.weight.abs().max() / 448, scale[n].bfloat16())
                               for n, l in lins.items()})
    set_backend(fp8, "cpu")
    table = act_table(F.silu, torch.bfloat16)
    w32 = {n: l.weight.float() for n, l in lins.items()}
    hp = packed_linears([lins[n].weight for n in ("gate", "up", "down")])

    def packed(x):
        gate, up, down = hp[0]
        return down(F.silu(gate(x)) * up(x))

    def bf16(x):
        return F.linear(F.silu(F.linear(x, lins["gate"].weight)) * F.linear(x, lins["up"].weight), lins["down"].weight)

    def fp32(x):
        return F.linear(F.silu(F.linear(x, w32["gate"])) * F.linear(x, w32["up"]), w32["down"])

    def unfused(x):
        return fp8["down"](F.silu(fp8["gate"](x)) * fp8["up"](x))

    def fused(x):
        return fp8["down"].gated(fp8["gate"](x), fp8["up"](x), table)

    print(f"gated MLP {h} -> {i} -> {h} (SiLU), random weights; threads {torch.get_num_threads()}; "
          f"median of {a.iters} calls per column, interleaved")
    print(f"torch {torch.__version__}; {machine_line()}")
    print(f"{'M':>6} {'bf16':>7} {'fp32':>7} {'packed':>7} {'fp8 unfused':>12} {'fp8 fused':>10}   (speed vs the fastest "
          "high-precision block)")
    with torch.inference_mode():
        for m in map(int, a.ms.split(",")):
            x, x32 = x_all[:m], x_all[:m].float()
            ref = bf16(x)
            if not torch.equal(fused(x), unfused(x)):
                sys.exit(f"M={m}: the fused FP8 block differs from the unfused one; no ratios.")
            require_sqnr(f"fp8 MLP at M={m}", ref, unfused(x), 20.0)
            calls = {"bf16": lambda: bf16(x), "fp32": lambda: fp32(x32), "unfused": lambda: unfused(x),
                     "fused": lambda: fused(x)}
            if hp is not None:
                x_hp = x.to(hp[1])
                calls["packed"] = lambda: packed(x_hp)
            med = interleaved_medians(calls, a.iters)
            base = min(med[c] for c in ("bf16", "fp32", "packed") if c in med)
            cell = lambda c, w: f"{base / med[c]:>{w}.2f}x" if c in med else f"{'-':>{w + 1}}"  # noqa: E731
            print(f"{m:>6} " + " ".join(cell(c, w) for c, w in
                                          (("bf16", 6), ("fp32", 6), ("packed", 6), ("unfused", 11), ("fused", 9))))


if __name__ == "__main__":
    main()
