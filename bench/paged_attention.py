"""Decode attention over the paged KV cache on a CPU: hqtflow's op against the two other ways the engine can do it.

One decode step of one layer: B sequences, one query token each, every sequence over its own context of L tokens,
its slots scattered over the pool as the engine leaves them. Speed relative to the faster baseline (> 1 = faster):
- `loop`: per sequence, `KVPool.read` + `attend_one` (what the engine runs on a CPU without a C++ compiler);
- `padded`: `decode_batch_attention`, every context gathered into one [B, L] batch in the cache's dtype (FP8:
  dequantized to the query's) and masked, attended by SDPA (the engine's CUDA-graph step);
- `op`: `torch.ops.hqtflow.paged_decode_attention` (runtime/csrc/), what the engine runs on a CPU.
The rows cover SmolLM2-135M's heads (9 query, 3 KV, d 64) and an 8B Llama's (32, 8, d 128), with the KV cache in the
model's dtype (fp32, bf16) or FP8 (`fp8`: E4M3 with a per-layer scale, fp32 queries). `--softcap C` soft-caps the
scores (Gemma 2: 50) and `--sinks` adds a sink logit per head (gpt-oss) in all three. Timing is the median of
`--iters` calls after warm-up.

    python bench/paged_attention.py [--batches 1,8,32] [--lengths 64,256,1024,4096] [--threads N] [--softcap C]
                                    [--sinks] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hqtflow.hardware import machine_line  # noqa: E402
from hqtflow.runtime.paged import DecodeBatch, KVPool, attend_one, decode_batch_attention  # noqa: E402

MODELS = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}  # query heads, KV heads, head dim
CACHES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "fp8": (torch.float32, True)}  # fp8: E4M3 KV, fp32 queries
BLOCK = 16


def step(model: str, cache: str, batch: int, length: int, seed: int = 0):
    """A pool holding `batch` contexts of `length` tokens in shuffled blocks, and one query per sequence."""
    heads, kv_heads, d = MODELS[model]
    dtype, fp8 = CACHES[cache]
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-length // BLOCK)
    pool = KVPool(layers=1, kv_heads=kv_heads, head_dim=d, num_blocks=batch * blocks_per_seq + 1, block_size=BLOCK,
                  dtype=dtype, device="cpu", scales=[(torch.tensor(0.02), torch.tensor(0.01))] if fp8 else None)
    order = torch.randperm(batch * blocks_per_seq, generator=g).add(1).tolist()  # block 0: the padded batch's scratch
    tables = [order[b * blocks_per_seq:(b + 1) * blocks_per_seq] for b in range(batch)]
    reads = [pool.slots(t, 0, length) for t in tables]
    pool.zero(0)
    slots = torch.cat(reads)
    pool.write(0, slots, torch.randn(len(slots), kv_heads, d, generator=g).to(dtype),
               torch.randn(len(slots), kv_heads, d, generator=g).to(dtype))
    q = torch.randn(batch, heads, d, generator=g).to(dtype)
    return pool, q, reads, tables


def ways(pool: KVPool, q: torch.Tensor, reads: list[torch.Tensor], tables: list[list[int]], softcap: float = 0.0,
         sinks: torch.Tensor | None = None) -> dict:
    """name -> a call computing [B, heads, d] for this step."""
    batch, heads, d = q.shape
    ks, vs = pool.scales[0] if pool.scales is not None else (None, None)
    slots = torch.cat(reads)
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in reads]).cumsum(0).tolist()])
    plan = DecodeBatch(pool, batch, len(tables[0]) * BLOCK, scratch=0)
    plan.fill([(0, len(r) - 1, t) for r, t in zip(reads, tables)])
    last = torch.stack([r[-1] for r in reads])
    k_new, v_new = pool.read(0, last, q.dtype)  # the step's own KV (rewritten in place: the same values)
    q4, k4, v4 = q.transpose(0, 1)[None], k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None]
    return {
        "loop": lambda: torch.stack([attend_one(q[b], *pool.read(0, r, q.dtype), None, softcap, sinks)
                                     for b, r in enumerate(reads)]),
        "padded": lambda: decode_batch_attention(0, plan, q4, k4, v4, None, None, softcap, sinks)[0],
        "op": lambda: torch.ops.hqtflow.paged_decode_attention(q, pool.keys[0], pool.values[0], slots, offsets, ks, vs,
                                                               d ** -0.5, softcap, sinks),
    }


def timed(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--lengths", default="64,256,1024,4096")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--softcap", type=float, default=0.0, help="soft-cap the scores at this value (Gemma 2: 50)")
    p.add_argument("--sinks", action="store_true", help="a sink logit per query head (gpt-oss)")
    p.add_argument("--smoke", action="store_true", help="one small row per cache: CI keeps the bench from rotting")
    a = p.parse_args()
    if a.smoke:
        a.models, a.batches, a.lengths, a.iters = "smollm2", "2", "40", 2
    if a.threads:
        torch.set_num_threads(a.threads)
    from hqtflow.runtime.paged import cpu_ops

    if not cpu_ops():
        sys.exit("hqtflow's CPU ops could not be built here (no C++ compiler?): there is no op to measure.")
    print(f"{machine_line()}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; softcap {a.softcap or 'none'}, sinks {'yes' if a.sinks else 'no'}")
    print(f"{'model':9} {'cache':15} {'B':>3} {'L':>5} | {'loop':>7} {'padded':>7} {'op':>7} | "
          f"{'op / fastest baseline':>21} {'max |op, padded - loop|':>24}")
    for model in a.models.split(","):
        for cache in a.caches.split(","):
            for batch in map(int, a.batches.split(",")):
                for length in map(int, a.lengths.split(",")):
                    sinks = torch.linspace(-2, 2, MODELS[model][0]) if a.sinks else None
                    fns = ways(*step(model, cache, batch, length), a.softcap, sinks)
                    ref = fns["loop"]().float()
                    err = max((fns[n]().float() - ref).abs().max().item() for n in ("op", "padded"))
                    t = {name: timed(fn, a.iters) for name, fn in fns.items()}
                    base = min(t["loop"], t["padded"])
                    rel = {name: base / s for name, s in t.items()}
                    print(f"{model:9} {cache:15} {batch:3} {length:5} | {rel['loop']:6.2f}x {rel['padded']:6.2f}x "
                          f"{rel['op']:6.2f}x | {rel['op']:20.2f}x {err:24.2e}", flush=True)
    print("(speed relative to the faster of loop and padded in the same run; > 1 = faster)")


if __name__ == "__main__":
    main()
