"""hqtflow's engine vs transformers' built-in continuous batching (`generate_batch`), same prompts, same model.

Why hqtflow has its own small scheduler: transformers' continuous batching samples with one generation config for
all requests (no per-request seeds, repetition penalty or stop sequences, which TGI's API needs). This measures what
that choice costs or gains on CPU, both in the machine's fastest high-precision dtype (bf16 with native bf16 dot
products, else fp32): aggregate greedy tokens/s over N concurrent requests, both in one run, and checks
that the greedy texts agree.

    python bench/engine_vs_transformers.py [--model DIR] [--requests 16] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hqtflow import models  # noqa: E402
from hqtflow.hardware import fastest_dtype, machine_line  # noqa: E402
from hqtflow.runtime.engine import Engine, SamplingParams  # noqa: E402
from hf_batching import timed_generate_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wikitext2_valid.txt"))
    a = p.parse_args()
    path = models.resolve_model(a.model)
    tok = models.load_tokenizer(path)
    dtype = fastest_dtype()  # the faster high-precision dtype here, for both sides
    model = models.load_model(path, dtype)
    lines = [ln.strip() for ln in Path(a.data).read_text().splitlines() if len(ln.split()) > 12]
    prompts = [tok.encode(" ".join(ln.split()[: 8 + 3 * (i % 5)])) for i, ln in enumerate(lines[: a.requests])]
    import transformers

    print(f"model {path.name} {dtype} (the fastest high-precision dtype here), {a.requests} requests x {a.new_tokens} new tokens, greedy; both sides set up and "
          f"warmed up outside the timer")
    print(f"{machine_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"transformers {transformers.__version__}")

    hf_seqs, t_hf = timed_generate_batch(model, prompts, a.new_tokens)  # set up and warmed outside its timer
    hf_tokens = sum(map(len, hf_seqs))

    eng = Engine(model, tok, max_batch_size=a.max_batch_size).start()
    try:
        params = SamplingParams(max_new_tokens=a.new_tokens)
        eng.generate(prompts[0], SamplingParams(max_new_tokens=2))  # warm-up
        results, threads = [None] * len(prompts), []
        t = time.perf_counter()
        for i, ids in enumerate(prompts):
            th = threading.Thread(target=lambda i=i, ids=ids: results.__setitem__(i, eng.generate(ids, params)))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        t_ours = time.perf_counter() - t
    finally:
        eng.stop()
    our_tokens = sum(sum(e.token is not None for e in r) for r in results)
    same = 0
    for theirs, r in zip(hf_seqs, results):  # ours stops at EOS, transformers' runs on: compare the common prefix
        ours = [e.token.id for e in r if e.token]
        same += ours == theirs[: len(ours)]
    print(f"transformers generate_batch : {hf_tokens / t_hf:7.1f} tokens/s ({hf_tokens} tokens in {t_hf:.1f} s)")
    print(f"hqtflow engine              : {our_tokens / t_ours:7.1f} tokens/s ({our_tokens} tokens in {t_ours:.1f} s)"
          f" = {(our_tokens / t_ours) / (hf_tokens / t_hf):.2f}x transformers")
    print(f"identical greedy texts: {same}/{len(prompts)} (batch composition can flip near-ties)")


if __name__ == "__main__":
    main()
