"""FP8 on an NVIDIA GPU (compute capability >= 8.9), every figure a ratio against bf16 measured in the same run.

1. linear: `FP8Linear` through `torch._scaled_mm` (static per-tensor W8A8, the same with Hopper's fast accumulation,
   and per-token dynamic activations with row-wise scales; the activation's quantization included) vs bf16 `F.linear`, at 4096^2 and 8192^2, M = 1 .. 4096.
   Each figure is the median over CUDA-graph replays of calls cycling through enough weight copies (>= 256 MiB of
   bf16) that weights come from HBM, not L2 (decode's case). Target (issue #18): FP8 >= 1.5x bf16 at M >= 256 on 8192^2.
2. decode: `StaticDecoder` (static KV cache) on a Llama-shaped model with random weights (speed does not depend on the
   values), bf16 vs FP8 (static per-tensor W8A8 on every decoder Linear, input scales from one calibration forward;
   `lm_head` bf16), batch 1, 8 and 32: the eager step as a CUDA graph, the torch.compile'd step as a CUDA graph
   (gpt-fast's way; compile time printed), eager steps at batch 1 for contrast. Target (issue #18): the fastest FP8
   engine >= 1.3x the fastest bf16 one at batch 1 and 8. `--parts profile` prints the GPU time per kernel of an
   eager step.
3. engine: the serving engine (`Engine`, paged KV cache, decode steps as CUDA graphs) through its public API: 32
   concurrent streams x 64 new tokens vs one stream alone, bf16 vs FP8, graphs, compiled steps in graphs, and
   `cuda_graphs=()`. Target (issue #14):
   FP8 >= 1.3x bf16 tokens/s at 32 streams, aggregate >= 5x one stream, time to first token p95 <= 3 s.
4. eager (`--parts eager`): eager calls of one 4096^2 Linear, bf16 vs FP8 with each way of quantizing the input
   outside graphs (`FP8Linear.eager_quantizer`): the host time per call that rules an engine's prefill step.
5. prefill (`--parts prefill`): the engine's one eager step that prefills the 32 prompts, bf16 vs FP8 (each
   `--fp8-variants`): its wall time (median of 5), then one profiled run's GPU time per kernel and host time per op.

    python bench/fp8_cuda.py [--models 1b,8b] [--json results.json] [--parts linear,eager,decode,engine,prefill]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from hqtflow.quantize.fp8_linear import FP8Linear, set_backend  # noqa: E402
from hqtflow.runtime.cuda_graphs import capture  # noqa: E402
from hqtflow.scales import Rule  # noqa: E402
from random_llama import llama  # noqa: E402

F8 = 448.0
DEVICE = "cuda"
SIZES = (4096, 8192)


def graph_time(calls, replays: int = 20) -> float:
    """Seconds per call: `calls` captured in one CUDA graph, median of timed replays."""
    g, _ = capture(lambda: [fn() for fn in calls], warmup=1)
    return graph_time_replays(g, replays) / len(calls)


def graph_time_replays(graph, replays: int = 20) -> float:
    """Seconds per replay of a captured graph, median of timed replays."""
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_linear(ms: list[int]) -> list[dict]:
    rows = []
    print(f"\n{'shape':>10} {'M':>5} {'bf16 us':>9} {'fp8 static':>11} {'fast acc':>9} {'fp8 token':>10}   (speed vs bf16, >1 = FP8 faster)")
    for k in SIZES:
        copies = max(2, 256 * 2**20 // (2 * k * k))
        torch.manual_seed(0)
        lins = [torch.nn.Linear(k, k, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        static, token = [], []
        x0 = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
        s_x = (x0.abs().max() / F8).reshape(1)
        per_token = Rule("PCS", dynamic="fp32")  # compressed-tensors' FP8_DYNAMIC: amax / F per token, in float32
        for lin in lins:
            static.append(FP8Linear.from_linear(lin, (lin.weight.abs().max() / F8).reshape(1), s_x))
            token.append(FP8Linear.from_linear(lin, lin.weight.abs().amax(1).float() / F8, None, dynamic=per_token))
        for m in static + token:
            set_backend(m, "scaled_mm")
        for m_ in ms:
            x = torch.randn(m_, k, device="cuda", dtype=torch.bfloat16)
            with torch.inference_mode():
                t_bf16 = graph_time([lambda l=l: l(x) for l in lins])
                t_static = graph_time([lambda l=l: l(x) for l in static])
                for mod in static:
                    mod.fast_accum = True
                t_fast = graph_time([lambda l=l: l(x) for l in static])
                for mod in static:
                    mod.fast_accum = False
                t_token = graph_time([lambda l=l: l(x) for l in token])
            row = dict(k=k, n=k, m=m_, bf16_s=t_bf16, fp8_static_s=t_static, fp8_static_fast_accum_s=t_fast,
                       fp8_token_s=t_token, static_x=t_bf16 / t_static,
                       fast_x=t_bf16 / t_fast, token_x=t_bf16 / t_token)
            rows.append(row)
            print(f"{f'{k}^2':>10} {m_:>5} {t_bf16 * 1e6:>9.1f} {row['static_x']:>10.2f}x {row['fast_x']:>8.2f}x "
                  f"{row['token_x']:>9.2f}x", flush=True)
        del lins, static, token
        torch.cuda.empty_cache()
    return rows


def bench_eager_linear(ms=(32, 2048), k: int = 4096, calls: int = 200) -> list[dict]:
    """Eager calls (an engine's prefill step: launched from Python, no graph) of one k x k Linear, bf16 vs FP8 with
    each `eager_quantizer`: wall time per call over `calls` calls, synchronized once (host time where it rules)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, k, bias=False, device="cuda", dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(lin, (lin.weight.abs().max() / F8).reshape(1), torch.tensor([0.01], device="cuda"))
    set_backend(fp8, "scaled_mm")
    rows = []
    print(f"\neager calls of one {k}^2 Linear (us per call; speed vs bf16, >1 = FP8 faster)")
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row: dict = {"k": k, "m": m}
        with torch.inference_mode():
            for name, layer, quantizer in [("bf16", lin, None), ("fp8_triton", fp8, "triton"),
                                           ("fp8_aten", fp8, "aten"), ("fp8_compiled", fp8, "compiled")]:
                if quantizer:
                    layer.eager_quantizer = quantizer
                for _ in range(3):
                    layer(x)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(calls):
                    layer(x)
                torch.cuda.synchronize()
                row[name + "_us"] = (time.perf_counter() - t) / calls * 1e6
        del fp8.eager_quantizer
        rows.append(row)
        print(f"  M={m:5d}  bf16 {row['bf16_us']:7.1f} us  " + "  ".join(
            f"{q} {row[f'fp8_{q}_us']:7.1f} us ({row['bf16_us'] / row[f'fp8_{q}_us']:.2f}x)"
            for q in ("triton", "aten", "compiled")), flush=True)
    return rows


@torch.no_grad()  # not inference mode: the CPU kernel's packing tracks the weights' version counters
def to_fp8(model, vocab: int) -> None:
    """Every decoder Linear to static per-tensor FP8 (input scales: maxabs over one calibration forward)."""
    amax: dict[str, torch.Tensor] = {}
    kv_amax: dict[str, torch.Tensor] = {}  # k_proj / v_proj outputs: the KV cache's scales (`--fp8-variants kv8`)

    def keep(d, name, t):
        d[name] = torch.maximum(d.get(name, t.abs().amax()), t.abs().amax())

    hooks = []
    for name, mod in model.model.layers.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda m, a, name=name: keep(amax, name, a[0])))
            if name.endswith(("k_proj", "v_proj")):
                hooks.append(mod.register_forward_hook(lambda m, a, out, name=name: keep(kv_amax, name, out)))
    model(torch.randint(0, vocab, (4, 128), device=DEVICE))
    for h in hooks:
        h.remove()
    for name, s in kv_amax.items():  # rotary keeps a key's norm per pair: maxabs * sqrt(2) bounds the cached keys
        attn, _, proj = name.rpartition(".")
        bound = s.float() * (2 ** 0.5 if proj == "k_proj" else 1.0)
        model.model.layers.get_submodule(attn).register_buffer(f"{proj[0]}_scale", (bound / F8).reshape(()))
    for name, s in amax.items():
        parent, _, child = name.rpartition(".")
        owner = model.model.layers.get_submodule(parent)
        lin = getattr(owner, child)
        fp8 = FP8Linear.from_linear(lin, (lin.weight.abs().max() / F8).reshape(1), (s.float() / F8).reshape(1).to(torch.bfloat16))
        setattr(owner, child, fp8)
        del lin
    # CUDA: torch._scaled_mm; a CPU (this script's smoke test) runs the CPU kernel, not _scaled_mm's slow emulation
    set_backend(model, "scaled_mm" if DEVICE == "cuda" else "auto")
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def bench_decode(model, vocab: int, modes=("graph", "compiled", "eager"), batches=(1, 8, 32), new: int = 128) -> dict:
    """Decode tok/s per (mode, batch): "graph" (the eager step captured as a CUDA graph), "compiled" (the
    torch.compile'd step captured as a CUDA graph, gpt-fast's way), "eager" (batch 1 only, for contrast)."""
    from hqtflow.runtime.static_decode import StaticDecoder

    out = {}
    for mode in modes if DEVICE == "cuda" else [m for m in modes if m != "graph"]:
        for b in batches[:1] if mode == "eager" and DEVICE == "cuda" else batches:
            ids = torch.randint(0, vocab, (b, 64))
            dec = StaticDecoder(model, max_length=64 + new, compile=mode == "compiled",
                                cuda_graph=mode != "eager" and DEVICE == "cuda")
            t = time.perf_counter()
            dec.generate(ids, 8)  # capture / compile / warm-up
            warm = time.perf_counter() - t
            runs = [dec.generate(ids, new).decode_tokens_per_s for _ in range(3)]
            out[f"{mode} b{b}"] = statistics.median(runs)
            if mode == "compiled":
                out[f"compile s b{b}"] = round(warm, 1)
            if dec.graph_failed:
                out[f"{mode} graph_failed"] = dec.graph_failed
    return out


def profile_step(model, vocab: int, batch: int, top: int = 12) -> list[tuple[str, float, int]]:
    """GPU time per kernel name over 4 eager decode steps (self CPU time per op with --device cpu): (name,
    microseconds per step, calls per step)."""
    from torch.profiler import ProfilerActivity, profile

    from hqtflow.runtime.static_decode import StaticDecoder

    dec = StaticDecoder(model, max_length=80, cuda_graph=False)
    ids = torch.randint(0, vocab, (batch, 64))
    dec.generate(ids, 4)
    cuda = DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        dec.generate(ids, 5)  # prefill + 4 decode steps; the prefill's kernels are few and long
    rows, total = kernel_table(prof, 4, cuda)
    print(f"profile b{batch}: {total / 1e3:.2f} ms of {'GPU' if cuda else 'CPU'} time per step (prefill included, / 4), top kernels:")
    for name, us, n in rows[:top]:
        print(f"  {us:9.1f} us  {n:5d}x  {name[:90]}")
    return rows[:top]


def kernel_table(prof, per: int, cuda: bool = True) -> tuple[list[tuple[str, float, int]], float]:
    """A profile's (name, microseconds, calls) per 1/`per` of it, longest first (GPU time; self CPU time without
    CUDA), and their total."""
    rows = [(e.key, (e.device_time_total if cuda else e.self_cpu_time_total) / per, e.count // per)
            for e in prof.key_averages() if not (cuda and _op_not_kernel(e.key))]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


def profile_prefill(model, vocab: int, streams: int = 32, top: int = 14) -> dict:
    """One eager engine step prefilling `streams` random 16-128-token prompts (the 32-stream run's first step): its
    wall time, its GPU kernel time per kernel name, and the host's self time per op (what an eager step spends)."""
    from torch.profiler import ProfilerActivity, profile

    from hqtflow.runtime.engine import Engine, SamplingParams

    steps: list[tuple[str, int, float]] = []
    eng = Engine(model, _Tok(), max_batch_total_tokens=streams * 256 + 512, cuda_graphs=(),
                 on_step=lambda kind, n, seconds, shape: steps.append((kind, shape[1], seconds)))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (int(torch.randint(16, 129, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(streams)]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def run():
        reqs = [eng.submit(p, params, lambda ev: None) for p in prompts]  # submitted before the loop runs: one step
        while eng.step():
            pass
        assert all(r.finished for r in reqs)

    for _ in range(2):
        run()
    steps.clear()
    for _ in range(5):
        run()
    wall_ms = statistics.median(s * 1e3 for _, _, s in steps)  # unprofiled
    steps.clear()
    cuda = DEVICE == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    gpu, gpu_total = kernel_table(prof, 1, cuda)
    host = sorted(((e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()), key=lambda r: -r[1])
    walls = [(k, t, round(s * 1e3, 2)) for k, t, s in steps]
    print(f"prefill of {streams} prompts ({sum(map(len, prompts))} tokens): {wall_ms:.1f} ms a step (median of 5, "
          f"unprofiled); profiled: steps (kind, tokens, ms) {walls}, GPU kernel time {gpu_total / 1e3:.2f} ms; top kernels:")
    for name, us, n in gpu[:top]:
        print(f"  {us:9.1f} us  {n:5d}x  {name[:90]}")
    print("  host self time, top ops:")
    for name, us, n in host[:top]:
        print(f"  {us:9.1f} us  {n:5d}x  {name[:90]}")
    del eng
    return dict(step_ms=wall_ms, steps=walls, gpu_ms=gpu_total / 1e3, kernels=gpu[:top], host=host[:top])


def _op_not_kernel(name: str) -> bool:
    """A profiler row that holds its kernels' GPU time again (an operator or a compiled region), not a kernel."""
    return name.split("::")[0] in ("aten", "hqtflow", "torch_attn", "prims", "inductor") or \
        name.startswith(("Torch-Compiled", "CompiledFunction", "## Call", "cudaGraph"))


def graph_kernels(graph, top: int = 15) -> list[tuple[str, float, int]]:
    """GPU time per kernel name in one replay of a captured graph (the mean of 5 replays): (name, us, calls)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    rows, total = kernel_table(prof, 5)
    print(f"  graph replay: {total / 1e3:.2f} ms of kernel time, {sum(r[2] for r in rows)} kernels; top:")
    for name, us, n in rows[:top]:
        print(f"    {us:8.1f} us {n:5d}x  {name[:100]}")
    return rows[:top]


def bench_engine(model, tok, vocab: int, streams: int = 32, new: int = 64, mode: str = "graphs", kv_cache: str = "bf16",
                 kernels: bool = False) -> dict:
    """mode: "graphs" (decode steps as CUDA graphs), "compiled" (the torch.compile'd step as CUDA graphs), "eager".
    kv_cache: the engine's ("fp8": the scales `to_fp8` calibrated). kernels: print the 32-sequence graph's kernels."""
    from hqtflow.runtime.engine import Engine, SamplingParams

    full_steps: list[float] = []  # when each decode step of all `streams` sequences was launched

    def on_step(kind, n, seconds, shape):
        if kind == "decode" and n == streams:
            full_steps.append(time.perf_counter())

    eng = Engine(model, tok, max_batch_total_tokens=streams * 256 + 512, cuda_graphs=() if mode == "eager" else None,
                 compile=mode == "compiled", on_step=on_step, kv_cache=kv_cache)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (int(torch.randint(16, 129, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(streams)]
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)

    def run(batch):
        done, reqs = threading.Semaphore(0), []
        t = time.monotonic()
        for p in batch:
            reqs.append(eng.submit(p, params, lambda ev: done.release() if ev.finish_reason or ev.error else None))
        for _ in batch:
            done.acquire()
        wall = time.monotonic() - t
        return wall, [r.t_first - r.t_submit for r in reqs], sum(len(r.generated) for r in reqs)

    eng.start()
    try:
        t = time.monotonic()
        run(prompts)  # warm-up: every bucket captured (and compiled)
        warm = time.monotonic() - t
        run(prompts[:1])
        singles = [run([p]) for p in prompts[:3]]
        one = statistics.mean(n / w for w, _, n in singles)
        full_steps.clear()
        wall, ttft, n = run(prompts)
    finally:
        eng.stop()
    ttft.sort()
    # the engine's period per full decode step against the GPU time of that step's graph alone: what the host adds
    period = statistics.median(b - a for a, b in zip(full_steps, full_steps[1:])) if len(full_steps) > 2 else None
    gpu = None
    key = max((k for k in eng.graphs.graphs if k[0] == streams), default=None) if eng.graphs else None
    top = None
    if DEVICE == "cuda" and key:
        gpu = graph_time_replays(eng.graphs.graphs[key][0])
        top = graph_kernels(eng.graphs.graphs[key][0]) if kernels else None
    res = dict(one_stream_tps=one, streams_tps=n / wall, speedup_vs_one=n / wall / one,
               ttft_p50_s=ttft[len(ttft) // 2], ttft_p95_s=ttft[int(0.95 * (len(ttft) - 1))],
               graphs=len(eng.graphs.graphs) if eng.graphs else 0, graph_failed=eng.graphs.failed if eng.graphs else None,
               warmup_s=warm, step_ms=period and period * 1e3, graph_gpu_ms=gpu and gpu * 1e3, kv_cache=kv_cache)
    if top:
        res["graph_kernels"] = top
    del eng
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return res


def quantizer_of(variant: str) -> str:
    """The `FP8Linear.eager_quantizer` an FP8 variant names: triton_quant, compiled_quant, else the default (aten)."""
    return next((q for q in ("triton", "compiled") if f"{q}_quant" in variant.split("+")), "aten")


class _Tok:
    """What the engine reads of a tokenizer, for random-token prompts (no vocabulary file is needed for speed)."""
    eos_token_id, all_special_ids = None, []

    def decode(self, ids, **_):
        return " ".join(map(str, ids)) + (" " if ids else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b")
    p.add_argument("--parts", default="linear,decode,engine", help="linear, eager, decode, engine, profile, prefill")
    p.add_argument("--ms", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--decode-modes", default="graph,compiled,eager", help="decode: graph, compiled, eager")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (profile: the last)")
    p.add_argument("--engine-modes", default="graphs,compiled,eager", help="engine: graphs, compiled, eager")
    p.add_argument("--fp8-variants", default="plain",
                   help="engine and prefill, the FP8 runs: plain (inputs quantized outside graphs by three aten "
                   "kernels), kv8 (the FP8 KV cache), triton_quant (by one Triton kernel), compiled_quant (by "
                   "torch.compile's one kernel), joined by + (kv8+triton_quant)")
    p.add_argument("--graph-kernels", action="store_true", help="engine: print the kernels of the 32-sequence graph")
    p.add_argument("--sizes", default="4096,8192", help="linear: square shapes K = N")
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the decode and engine parts without graphs "
                                                    "(a smoke test of this script, with --models tiny)")
    a = p.parse_args()
    parts = a.parts.split(",")
    global DEVICE
    DEVICE = a.device
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    if DEVICE == "cuda":
        print(f"{name} (cc {'.'.join(map(str, torch.cuda.get_device_capability()))}), torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}")
    from hqtflow.hardware import machine_line

    print(f"host {machine_line()}")  # the engine's host time per step depends on the host CPU
    results: dict = {"device": name, "torch": torch.__version__, "host": machine_line()}

    def save():
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))

    global SIZES
    SIZES = tuple(int(k) for k in a.sizes.split(","))
    engine_modes = [m for m in a.engine_modes.split(",") if DEVICE == "cuda" or m != "compiled"]  # compiles graphs
    if "linear" in parts:
        results["linear"] = bench_linear([int(m) for m in a.ms.split(",")])
        save()
    if "eager" in parts and DEVICE == "cuda":
        results["eager_linear"] = bench_eager_linear()
        save()
    for size in a.models.split(","):
        if not {"decode", "engine", "profile", "prefill"} & set(parts):
            break
        model = llama(size, a.vocab, DEVICE)
        params = sum(t.numel() for t in model.parameters())
        print(f"\nLlama-shaped {size}: {params / 1e9:.2f} B parameters, random weights, vocab {a.vocab}")
        res: dict = {"params": params}
        for kind in ("bf16", "fp8"):
            if kind == "fp8":
                to_fp8(model, a.vocab)
            if "prefill" in parts:
                for variant in a.fp8_variants.split(",") if kind == "fp8" else ["plain"]:
                    FP8Linear.eager_quantizer = quantizer_of(variant)
                    res[f"prefill_{kind}" + ("" if variant == "plain" else f"_{variant}")] = profile_prefill(model, a.vocab)
                    FP8Linear.eager_quantizer = "aten"
            if "profile" in parts:
                res[f"profile_{kind}"] = profile_step(model, a.vocab, int(a.batches.split(",")[-1]))
            if "decode" in parts:
                res[f"decode_{kind}"] = bench_decode(model, a.vocab, a.decode_modes.split(","),
                                                     [int(b) for b in a.batches.split(",")])
                print(f"decode tok/s {kind}: " + ", ".join(f"{k_} {v:.0f}" if isinstance(v, float) else f"{k_} {v}"
                                                           for k_, v in res[f"decode_{kind}"].items()), flush=True)
            if "engine" in parts:
                variants = a.fp8_variants.split(",") if kind == "fp8" else ["plain"]
                for mode, variant in [(m, v) for m in engine_modes for v in variants]:
                    key = f"engine_{kind}_{mode}" + ("" if variant == "plain" else f"_{variant}")
                    FP8Linear.eager_quantizer = quantizer_of(variant)
                    res[key] = bench_engine(model, _Tok(), a.vocab, mode=mode, kernels=a.graph_kernels,
                                            kv_cache="fp8" if "kv8" in variant.split("+") else "bf16")
                    FP8Linear.eager_quantizer = "aten"
                    print(f"{key}: " + ", ".join(f"{k_} {v:.3g}" if isinstance(v, float) else f"{k_} {v}"
                                                 for k_, v in res[key].items() if k_ != "graph_kernels"), flush=True)
                    if kind == "fp8" and (base := res.get(f"engine_bf16_{mode}")):
                        print(f"  {key} / bf16 {mode}: {res[key]['streams_tps'] / base['streams_tps']:.2f}x tokens/s, "
                              f"TTFT p50 {res[key]['ttft_p50_s'] * 1e3:.0f} ms vs {base['ttft_p50_s'] * 1e3:.0f} ms")
                    results[size] = res
                    save()
            results[size] = res
            save()
        if "decode" in parts:
            d8, d16 = res["decode_fp8"], res["decode_bf16"]
            speeds = [k_ for k_, v in d16.items() if isinstance(v, float) and not k_.startswith("compile s") and k_ in d8]
            print("decode FP8 / bf16, same engine: " + ", ".join(f"{k_} {d8[k_] / d16[k_]:.2f}x" for k_ in speeds))
            for b in sorted({k_.split()[-1] for k_ in speeds}, key=lambda x: int(x[1:])):
                best16 = max((d16[k_], k_) for k_ in speeds if k_.endswith(f" {b}"))
                best8 = max((d8[k_], k_) for k_ in speeds if k_.endswith(f" {b}"))
                print(f"decode {b}: fastest FP8 ({best8[1]}) / fastest bf16 ({best16[1]}) {best8[0] / best16[0]:.2f}x "
                      "(target 1.3x)")
        if "engine" in parts:
            def fp8_runs(mode):  # the FP8 variants of a mode, fastest first
                keys = [k_ for k_ in res if k_ == f"engine_fp8_{mode}" or k_.startswith(f"engine_fp8_{mode}_")]
                return sorted(keys, key=lambda k_: -res[k_]["streams_tps"])

            for mode in engine_modes:  # on a CPU: no graphs in any mode
                f8key = fp8_runs(mode)[0]
                f8, b16 = res[f8key], res[f"engine_bf16_{mode}"]
                print(f"engine {mode}, 32 streams: FP8 ({f8key}) / bf16 {f8['streams_tps'] / b16['streams_tps']:.2f}x (target 1.3x); "
                      f"FP8 32 streams / one stream {f8['speedup_vs_one']:.1f}x (target 5x); TTFT p95 "
                      f"{f8['ttft_p95_s']:.3f} s")
                for kind, r in (("bf16", b16), ("FP8", f8)):
                    if r["step_ms"] and r["graph_gpu_ms"]:
                        print(f"  {kind}: a 32-sequence decode step every {r['step_ms']:.2f} ms, its graph alone "
                              f"{r['graph_gpu_ms']:.2f} ms of GPU time (the rest: the engine's host work per step)")
            best = {"fp8": max(res[fp8_runs(m)[0]]["streams_tps"] for m in engine_modes),
                    "bf16": max(res[f"engine_bf16_{m}"]["streams_tps"] for m in engine_modes)}
            print(f"engine 32 streams: fastest FP8 / fastest bf16 {best['fp8'] / best['bf16']:.2f}x")
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
