"""A 16 x 512-token forward of SmolLM2 (the shape of a prefill batch and of lm-eval loglikelihood requests): the FP8
checkpoint vs the bf16 and fp32 models, measured in one run on the same WikiText-2 tokens.

The ratio's baseline is the fastest high-precision model here: bf16 or fp32 through `F.linear`, or bf16 on the CPU
kernel's packed path (`bf16 packed`, as `hqtflow.load` runs a plain model). The FP8 model runs its FP8 layers on `--backend` (auto:
the CPU kernel) and its other parts in `--dtype auto`. Target (issue): FP8 >= 1.0x. Prints the CPU flags. The FP8
logits are checked first (its top token in fp32's top 5 at >= 90% of positions; else it exits without a ratio).

    make demo   # makes out/smollm2/fp8
    python bench/forward.py [--checkpoint out/smollm2/fp8] [--batch 16] [--length 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from baselines import packed_model  # noqa: E402
from checkpoint import DEFAULT, fp8_and_source  # noqa: E402
from checks import require_top5  # noqa: E402
from hqtflow import models  # noqa: E402
from hqtflow.hardware import fastest_dtype, machine_line  # noqa: E402
from timing import interleaved_medians  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(DEFAULT))
    p.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "wikitext2_test.txt"))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", default="auto")
    a = p.parse_args()
    fp8, tok, base, backend = fp8_and_source(a.checkpoint, a.backend)
    engines = {"bf16": models.load_model(base, "bf16"), "fp32": models.load_model(base, "fp32"), "fp8": fp8}
    if (packed := packed_model(base, backend)) is not None:
        engines["bf16 packed"] = packed
    ids = tok.encode(Path(a.text).read_text()[: 40 * a.batch * a.length], add_special_tokens=False)
    x = torch.tensor(ids[: a.batch * a.length]).reshape(a.batch, a.length)
    print(f"model {base.name}; FP8 {a.checkpoint} (backend {backend}, "
          f"high-precision dtype {next(fp8.parameters()).dtype}); forward of {a.batch} x {a.length} tokens; "
          f"threads {torch.get_num_threads()}; median of {a.runs} runs")
    print(f"torch {torch.__version__}; {machine_line()}; --dtype auto here: {fastest_dtype()}")
    with torch.inference_mode():
        warm = {n: m(x[:2]).logits for n, m in engines.items()}  # warm-up, and the output check
    rate = require_top5("fp8 forward", warm["fp32"], warm["fp8"])
    print(f"outputs checked: the FP8 top token is in fp32's top 5 at {100 * rate:.0f}% of {x[:2].numel()} positions")
    with torch.inference_mode():
        med = interleaved_medians({n: (lambda m=m: m(x)) for n, m in engines.items()}, a.runs, desc="timed forwards")
    for n, v in med.items():
        print(f"{n:11} {v:8.2f} s  {a.batch * a.length / v:9.0f} tokens/s")
    best = min((n for n in med if n != "fp8"), key=med.get)
    ratio = med[best] / med["fp8"]
    print(f"\nfp8 / fastest high-precision ({best}): {ratio:.2f}x  target >= 1.0x: {'met' if ratio >= 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
