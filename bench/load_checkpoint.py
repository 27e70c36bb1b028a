"""Loading an FP8 checkpoint (`hqtflow.load`, with and without verifying its hashes) vs transformers'
`from_pretrained` of the bf16 model it was quantized from, each with its tokenizer, in one process.

The baseline of every ratio is `AutoModelForCausalLM.from_pretrained(source, dtype=bfloat16)` + `AutoTokenizer`
(> 1 = faster than that). Before timing, the loaded FP8 model's logits on a line of text are checked against the bf16
model's (the FP8 top token in the bf16 top 5 at >= 90% of positions, bench/checks.py). The loads are timed in
alternated rounds (the median of each); every file is in the page cache after the check, so this is the loaders'
own cost (parsing, unpacking, building modules, hashing), not the disk.

    python bench/load_checkpoint.py [--checkpoint out/smollm2/fp8] [--rounds 3] [--full]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint import DEFAULT  # noqa: E402
from checks import require_top5  # noqa: E402
from hqtflow import models  # noqa: E402
from hqtflow.eval_run import source_model  # noqa: E402
from hqtflow.formats.artifact import MANIFEST  # noqa: E402
from hqtflow.hardware import machine_line  # noqa: E402
from timing import interleaved_medians  # noqa: E402

TEXT = "The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest structure in Paris."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT), help="an hqtflow FP8 checkpoint (default: make demo's)")
    ap.add_argument("--rounds", type=int, default=3, help="timed loads of each, alternated (default 3)")
    ap.add_argument("--full", action="store_true", help="a real run: 10 rounds")
    a = ap.parse_args()
    rounds = 10 if a.full else a.rounds
    ckpt = Path(a.checkpoint)
    if not (ckpt / MANIFEST).is_file():
        sys.exit(f"No FP8 checkpoint at {ckpt}: run `make demo` (or pass --checkpoint).")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hqtflow

    source = models.resolve_model(source_model(str(ckpt)))
    torch.set_grad_enabled(False)
    print(machine_line())
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"{ckpt} (FP8) vs {source} (bf16); median of {rounds} loads each")
    loads = {"transformers bf16": lambda: (AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).eval(),
                                           AutoTokenizer.from_pretrained(source)),
             "hqtflow.load": lambda: hqtflow.load(ckpt, dtype="bf16"),
             "hqtflow.load verify=False": lambda: hqtflow.load(ckpt, dtype="bf16", verify=False)}
    (ref, tok), (fp8, _) = loads["transformers bf16"](), loads["hqtflow.load"]()  # also the warm-up
    ids = tok(TEXT, return_tensors="pt").input_ids
    rate = require_top5("the loaded FP8 model", ref(ids).logits[0], fp8(ids).logits[0])
    del ref, fp8
    med = interleaved_medians(loads, rounds, desc="timed loads", before=gc.collect)  # each load's model dropped at once
    base = med["transformers bf16"]
    print(f"output checked: the FP8 top token in the bf16 top 5 at {100 * rate:.0f}% of positions (>= 90% required)")
    print(f"baseline: transformers bf16 from_pretrained + tokenizer, median {base:.2f} s")
    for name, sec in med.items():
        print(f"{name:26} {base / sec:>6.2f}x")
    print(f"FP8 checkpoint load: {base / med['hqtflow.load']:.2f}x transformers' bf16 load "
          f"({base / med['hqtflow.load verify=False']:.2f}x without verifying hashes)")


if __name__ == "__main__":
    main()
