"""`quantize --gptq`'s per-layer work (`hqtflow.quantize.gptq.gptq_round`) vs round-to-nearest of the same weight to
the same FP8 grid (what `quantize` does without --gptq: `cpu_kernel.quantize_weight`), on SmolLM2's Linear shapes.

Neither Neural Compressor nor transformers rounds FP8 weights with GPTQ (their GPTQ is integer weight-only), so the
baseline is round-to-nearest, measured in the same run: the ratio says how much slower GPTQ makes the job of picking
a layer's FP8 codes (< 1 = slower). Per-channel weight scales (amax / 448), a Hessian H = XᵀX / n from calibration
inputs X whose channels differ in size (as real activations' do). Before timing, both are checked: GPTQ's weight
is on the grid (its codes, dequantized, give it back), and its output error ||X (W - Q)ᵀ||² is below
round-to-nearest's (else the bench exits without a ratio). Timed interleaved, median of `--iters` calls.

    python bench/gptq.py [--iters 2] [--samples 512] [--full]      # --full adds the 4096 x 4096 shape
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hqtflow.hardware import machine_line  # noqa: E402
from hqtflow.quantize.cpu_kernel import quantize_weight  # noqa: E402
from hqtflow.quantize.gptq import gptq_round  # noqa: E402
from timing import interleaved_medians  # noqa: E402

SHAPES = {"smollm2 q/o 576x576": (576, 576), "smollm2 up 576->1536": (576, 1536), "smollm2 down 1536->576": (1536, 576)}
FULL = {"4096x4096": (4096, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--samples", type=int, default=512, help="calibration rows behind each Hessian (default 512)")
    ap.add_argument("--full", action="store_true", help="also the 4096 x 4096 shape")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    print(machine_line())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bf16 weights, per-channel E4M3 scales, "
          f"H from {a.samples} rows; median of {a.iters} calls; speed vs round-to-nearest (< 1 = GPTQ slower)")
    print(f"{'shape':24} {'RTN ms':>8} {'GPTQ':>8}   {'output error GPTQ / RTN':>24}")
    g = torch.Generator().manual_seed(0)
    for label, (k, n) in {**SHAPES, **(FULL if a.full else {})}.items():
        w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        x = torch.randn(a.samples, k, generator=g) * torch.randn(k, generator=g).exp()  # channels of varied size
        h = x.t() @ x / a.samples
        scale = (w.float().abs().amax(dim=1) / 448).bfloat16()
        calls = {"rtn": lambda: quantize_weight(w, scale.reshape(-1, 1)),
                 "gptq": lambda: quantize_weight(gptq_round(w, h, scale), scale.reshape(-1, 1))}
        q_gptq = gptq_round(w, h, scale)  # also the warm-up
        codes = {"rtn": calls["rtn"](), "gptq": quantize_weight(q_gptq, scale.reshape(-1, 1))}
        back = (codes["gptq"].float() * scale.float()[:, None]).to(q_gptq.dtype)
        if not torch.equal(back, q_gptq):  # its codes, dequantized, are the weight it returned
            sys.exit(f"{label}: GPTQ's weight is not on its FP8 grid, so its speed is not reported.")
        err = {name: float((x @ (w.float() - c.float() * scale.float()[:, None]).t()).pow(2).sum())
               for name, c in codes.items()}
        if not err["gptq"] < err["rtn"]:
            sys.exit(f"{label}: GPTQ's output error {err['gptq']:.4g} is not below round-to-nearest's {err['rtn']:.4g}, "
                     "so its speed is not reported.")
        med = interleaved_medians(calls, a.iters)
        print(f"{label:24} {med['rtn'] * 1e3:>8.2f} {med['rtn'] / med['gptq']:>7.4f}x   {err['gptq'] / err['rtn']:>24.3f}",
              flush=True)


if __name__ == "__main__":
    main()
