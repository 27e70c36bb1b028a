"""`hqtflow eval`'s in-process scoring vs lm-eval's own `HFLM` on the same bf16 model, task and --limit, in one run.

Both sides go through the same `lm_eval.simple_evaluate` (the task built the same way, `bootstrap_iters=0`); only the
LM differs: hqtflow's (`hqtflow.evaluate.evaluate`: the serving engine's log-likelihoods, or padded forwards for a
model it cannot run) against `HFLM(pretrained=model, softmax_dtype=float32)` (the same fp32 log-softmax) at the same
batch size. The model is loaded once, in the
fastest high-precision dtype here (`hqtflow.hardware.fastest_dtype`). Before timing, the warm-up run's metrics of the
two are compared (they score the same documents: the accuracy may differ by bf16 rounding of a near tie, at most
`--max-flips` documents); then the two are timed in alternated rounds and the ratio of the medians printed.

    python bench/eval_throughput.py [--model smollm2] [--task hellaswag_local] [--limit 8] [--rounds 1] [--full]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hqtflow.hardware import fastest_dtype, machine_line  # noqa: E402
from timing import interleaved_medians  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="a model folder or embedded name (default smollm2)")
    ap.add_argument("--task", default="hellaswag_local")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--limit", type=int, default=8, help="documents of the task (default 8)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="timed rounds of each side, alternated (default 1)")
    ap.add_argument("--max-flips", type=int, default=1, help="documents whose correctness may differ (default 1)")
    ap.add_argument("--full", action="store_true", help="a real run: --limit 200 --rounds 3")
    a = ap.parse_args()
    if a.full:
        a.limit, a.rounds = 200, 3
    import torch
    from lm_eval.models.huggingface import HFLM

    from hqtflow import lmeval, models
    from hqtflow.evaluate import EvalSettings, evaluate

    dtype = fastest_dtype()
    path = models.resolve_model(a.model)
    tok, model = models.load_tokenizer(path), models.load_model(path, dtype)
    import lm_eval

    print(machine_line())
    print(f"torch {torch.__version__}, lm-eval {lm_eval.__version__}, {torch.get_num_threads()} threads; model "
          f"{path.name} {dtype} (the fastest high-precision dtype here); {a.task}, --limit {a.limit}, batch {a.batch_size}")
    manager = lmeval.task_manager([], a.data_dir, [a.task])
    lmeval.check_tasks([a.task], manager, a.data_dir)
    settings = EvalSettings(tasks=(a.task,), data_dir=a.data_dir, limit=a.limit, batch_size=a.batch_size)
    hf_lm = HFLM(pretrained=model, tokenizer=tok, batch_size=a.batch_size, max_length=settings.max_length,
                 softmax_dtype=torch.float32)  # hqtflow's log-softmax is fp32 (lm-eval's default rounds to bf16)
    sides = {"hqtflow eval": lambda: evaluate(model, tok, settings, manager, show_progress=False)["tasks"],
             "lm-eval HFLM": lambda: lmeval.run_tasks(hf_lm, [a.task], manager, limit=a.limit)[0]}
    first = {name: fn() for name, fn in sides.items()}  # the warm-up, and the outputs compared before timing
    ours, theirs = (first[n][a.task] for n in sides)
    for metric in sorted(k for k in ours if k.startswith("acc") and "stderr" not in k):
        flips = round(abs(ours[metric] - theirs[metric]) * a.limit)
        print(f"{metric}: hqtflow {ours[metric]:.4f}, HFLM {theirs[metric]:.4f} ({flips} documents differ)")
        if flips > a.max_flips:
            sys.exit(f"{metric} differs between hqtflow's scoring and HFLM's by {flips} of {a.limit} documents (more "
                     f"than --max-flips {a.max_flips}): the scorer computes something else, so its speed is not reported.")
    med = interleaved_medians(sides, a.rounds, desc="timed evaluations")
    base = med["lm-eval HFLM"]
    print(f"baseline: lm-eval HFLM, median {base:.2f} s of {a.rounds} rounds")
    for name, sec in med.items():
        print(f"{name:14} {base / sec:>6.2f}x")
    print(f"hqtflow eval scoring: {base / med['hqtflow eval']:.2f}x lm-eval HFLM's throughput")


if __name__ == "__main__":
    main()
