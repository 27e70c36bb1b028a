"""WikiText-2 perplexity of an FP8 checkpoint with its keys and values read back from a static KV cache: bf16 and
FP8 (`--kv-cache fp8`, the static decoder's `FP8StaticCache`), and without a cache (what `hqtflow eval` scores).

Each disjoint 512-token window is one forward whose attention reads the keys and values it has just written to a
fresh cache, so the FP8 row carries the cache's rounding into every position.

    python bench/kv_cache_ppl.py out/smollm2/fp8 --ppl-file ../shared/data/wikitext2_test.txt --windows 8
"""

import argparse

import torch


class _Cached:
    """The model as `hqtflow.evaluate.perplexity` calls it, each call through a new cache from `make_cache`."""

    def __init__(self, model, make_cache):
        from hqtflow.models import cache_kwarg

        self.model, self.config, self.make_cache, self.kwarg = model, model.config, make_cache, cache_kwarg(model)

    def parameters(self):
        return self.model.parameters()

    def __call__(self, x):
        cache = self.make_cache(x.shape[1])
        return self.model(x, **{self.kwarg: cache}, use_cache=cache is not None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="An FP8 checkpoint quantized with --kv-cache fp8 (k_scale/v_scale).")
    ap.add_argument("--ppl-file", required=True)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()

    import hqtflow
    from transformers import StaticCache

    from hqtflow.evaluate import perplexity, read_ppl_text
    from hqtflow.runtime.kv_cache import FP8StaticCache, kv_scales

    model, tok = hqtflow.load(args.checkpoint, backend=args.backend)
    text = read_ppl_text(args.ppl_file)
    scales = kv_scales(model)
    ways = {"no cache": lambda n: None,
            "bf16 KV cache": lambda n: StaticCache(config=model.config, max_cache_len=n),
            "FP8 KV cache": lambda n: FP8StaticCache(model.config, n, scales)}
    from hqtflow.hardware import machine_line

    print(f"torch {torch.__version__}; {machine_line()}; backend {args.backend}, "
          f"compute dtype {next(model.parameters()).dtype}")
    res = {}
    with torch.inference_mode():
        for name, make in ways.items():
            res[name] = perplexity(_Cached(model, make), tok, text, max_windows=args.windows)
            r = res[name]
            print(f"{name:14s} perplexity {r['perplexity']:.3f} ({r['windows']} x {r['window']} tokens)")
    base = res["bf16 KV cache"]["perplexity"]
    print(f"FP8 / bf16 KV cache: {res['FP8 KV cache']['perplexity'] / base - 1:+.2%}")


if __name__ == "__main__":
    main()
