#!/usr/bin/env python
"""Load test of `hqtflow serve fp8`: errors, server memory growth and batching speed-up under concurrency (soak
mode, the default), and streaming throughput / time to first token against bf16 and transformers (streams mode).

    python bench/serve_load.py [--checkpoint DIR] [--requests 1000] [--concurrency 16] [--max-new-tokens 16]
                               [--prompt-tokens 16:1024]
    python bench/serve_load.py --mode streams [--checkpoint DIR] [--baseline MODEL] [--streams 32] [--stream-tokens 64]

Streams mode: the FP8 server and the bf16 server of the baseline (default: the checkpoint's source model), both up,
driven one at a time: `--streams` concurrent `/generate_stream` requests of `--stream-tokens` new tokens (greedy,
the same prompts) vs one stream alone (the mean of --single-streams runs); aggregate tokens/s, time to first token
p50/p95. The concurrent run is repeated `--rounds` times, FP8 and bf16 alternated (the order flipped each round), and
the FP8 / bf16 ratio is the median of the rounds' ratios: this machine's speed drifts by more between runs a minute
apart than the difference measured. Then transformers' continuous batching (what `generate_batch` runs, in the
fastest high-precision dtype here, in this process, after the servers have stopped) on the same prompt tokens, its manager set up and warmed
up before the timer as the servers are. Printed as ratios measured in this run (targets: >= 5x one
stream, TTFT p95 <= 3 s, FP8 >= 1.2x bf16, ahead of transformers), with the CPU flags and the load average.

Starts `hqtflow serve fp8 CHECKPOINT` as a subprocess on a free 127.0.0.1 port (default checkpoint: an FP8
SmolLM2 in $HQTFLOW_CACHE/bench/smollm2-fp8, made with `hqtflow measure` + `hqtflow quantize` if missing), then
with httpx.AsyncClient on loopback only:

1. warm-up: `--warmup-requests` requests at the full concurrency (so the batch reaches its largest size);
   the server's VmRSS (/proc/PID/status) is read after it;
2. single stream: the same requests one at a time (`--single-requests`, default all of them);
3. concurrent: the N requests at concurrency C (VmRSS sampled every 0.5 s meanwhile); VmRSS read at the end.

Every request is a TGI `/generate` with a short WikiText-2 prompt (`--prompt-words` words from the start of a
paragraph; with `--prompt-tokens MIN:MAX`, a random WikiText-2 span of MIN..MAX tokens instead), greedy, `max_new_tokens` fixed, `details: true` (generated tokens are counted from the server's
answer). Reported: errors (target 0), RSS growth end vs after warm-up (target < 5%; both read 1 s after the last
request, when the server is idle; the peak sampled during the runs is printed too), aggregate generated tokens/s
at concurrency C vs single stream (target >= 4x with the short prompts; none with `--prompt-tokens`, where prefill
dominates). Every loop is bounded: a per-request timeout and an overall
`--deadline`; the server is always stopped. Exit status 0 when the run completed (targets missed are reported,
not failed; `--strict` makes a missed target exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "wikitext2_valid.txt"
for key, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                   ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(key, value)

import httpx  # noqa: E402


SETTLE_S = 1.0  # RSS is read this long after the last request: retained memory, not what is in flight (peak shown apart)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("soak", "streams"), default="soak")
    p.add_argument("--checkpoint", default=None, help="FP8 checkpoint (default: FP8 SmolLM2 in the cache, built if missing)")
    p.add_argument("--baseline", default=None, help="streams: the bf16 model (default: the checkpoint's source model)")
    p.add_argument("--streams", type=int, default=32, help="streams: concurrent streams")
    p.add_argument("--stream-tokens", type=int, default=64, help="streams: new tokens per stream")
    p.add_argument("--single-streams", type=int, default=3, help="streams: one-stream runs averaged")
    p.add_argument("--rounds", type=int, default=3, help="streams: concurrent runs per server, FP8 and bf16 alternated")
    p.add_argument("--min-agreement", type=float, default=0.5, help="streams: the share of streams whose first 4 "
                   "greedy tokens must match between the FP8 and bf16 servers (else a failure: a fast but wrong path)")
    p.add_argument("--no-peer", action="store_true", help="streams: skip transformers' generate_batch")
    p.add_argument("--prompt-tokens", default=None, help="soak: MIN:MAX prompt tokens (random WikiText-2 spans)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `hqtflow serve` argument (repeatable)")
    p.add_argument("--requests", type=int, default=1000, help="requests in the concurrent run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--single-requests", type=int, default=None,
                   help="requests in the single-stream run (the first K of the same list; default: all)")
    p.add_argument("--warmup-requests", type=int, default=None,
                   help="default: max(400, 2 x concurrency): enough for the shape-keyed caches (oneDNN primitives for "
                        "each matmul shape, allocator arenas) to reach their steady state before RSS is read")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--prompt-words", type=int, default=12, help="words per prompt")
    p.add_argument("--max-batch-size", type=int, default=None, help="server --max-batch-size (default: the server's, "
                   "as many as its KV cache holds)")
    p.add_argument("--data", default=str(DATA), help="prompt source text (default: ../shared/data/wikitext2_valid.txt)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the whole run; stops early past it")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where the servers (and the transformers peer) run: auto (a CUDA GPU "
                                                   "when there is one), cpu or cuda")
    return p.parse_args(argv)


# ---- checkpoint and prompts ---------------------------------------------------------------------------------
def hqtflow_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hqtflow", *args]


def default_checkpoint() -> Path:
    cache = Path(os.environ.get("HQTFLOW_CACHE") or Path.home() / ".cache" / "hqtflow") / "bench"
    ck = cache / "smollm2-fp8"
    if (ck / "hqtflow_manifest.json").is_file():
        return ck
    cache.mkdir(parents=True, exist_ok=True)
    print(f"building the FP8 SmolLM2 checkpoint into {ck} ...", flush=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        meas = Path(tmp) / "measure"
        subprocess.run(hqtflow_cmd("measure", "smollm2", "-o", str(meas), "--text", str(DATA), "--limit", "16",
                                   "--max-length", "256"), check=True, timeout=1800)
        subprocess.run(hqtflow_cmd("quantize", "-m", str(meas), "-o", str(ck), "--overwrite"), check=True, timeout=1800)
    return ck


def prompts(path: str, n: int, words: int, seed: int) -> list[str]:
    paras = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    paras = [p for p in paras if len(p.split()) >= words and not p.startswith("=")]
    rng = random.Random(seed)
    return [" ".join(rng.choice(paras).split()[:words]) for _ in range(n)]


# ---- server -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def token_prompts(path: str, tokenizer_dir: str, n: int, low: int, high: int, seed: int) -> list[str]:
    """n texts of low..high tokens (uniform), spans of the WikiText-2 text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(Path(path).read_text(encoding="utf-8")[:2_000_000])["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(low, high)
        start = rng.randrange(0, len(ids) - length)
        out.append(tok.decode(ids[start:start + length]))
    return out


def run_device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def device_line(device: str) -> str:
    """The GPU's name and torch's version on CUDA, the CPU line otherwise."""
    if device != "cuda":
        return cpu_line()
    import torch

    return f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; " + cpu_line()


def cpu_line() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16") if f in flags]
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return f"CPU: {os.cpu_count()} cores, flags {' '.join(shown) or '-'}; load average {load}"


class Server:
    def __init__(self, checkpoint: Path, max_batch_size: int | None, log: Path, kind: str = "fp8", extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = hqtflow_cmd("serve", kind, str(checkpoint), "--host", "127.0.0.1", "--port", str(self.port),
                          "--max-concurrent-requests", "100000", *extra)
        if max_batch_size:
            cmd += ["--max-batch-size", str(max_batch_size)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly on SIGINT
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


# ---- load ---------------------------------------------------------------------------------------------------
async def drive(url: str, texts: list[str], concurrency: int, max_new: int, timeout: float, deadline: float,
                on_tick=None) -> dict:
    """Send every text to /generate with at most `concurrency` in flight; {requests, errors, tokens, seconds, ...}."""
    queue = list(enumerate(texts))[::-1]
    latencies, tokens, errors, samples = [], 0, [], []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def worker():
            nonlocal tokens
            while queue and time.monotonic() < deadline:
                i, text = queue.pop()
                t = time.perf_counter()
                try:
                    r = await client.post("/generate", json={"inputs": text, "parameters": {
                        "max_new_tokens": max_new, "do_sample": False, "details": True}})
                    if r.status_code != 200:
                        errors.append(f"request {i}: HTTP {r.status_code} {r.text[:200]}")
                        continue
                    tokens += r.json()["details"]["generated_tokens"]
                    latencies.append(time.perf_counter() - t)
                except Exception as e:  # noqa: BLE001 - every failure is counted, the run goes on
                    errors.append(f"request {i}: {type(e).__name__}: {e}")

        async def ticker():
            while True:
                await asyncio.sleep(0.5)
                if on_tick:
                    samples.append(on_tick())

        t0 = time.perf_counter()
        tick = asyncio.create_task(ticker())
        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:
            tick.cancel()
        seconds = time.perf_counter() - t0
    done = len(latencies)
    lat = sorted(latencies)
    return {"requests": len(texts), "completed": done, "errors": len(errors) + len(queue), "error_examples": errors[:5],
            "not_sent": len(queue), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "requests_per_s": done / seconds if seconds else 0.0,
            "latency_p50_s": lat[len(lat) // 2] if lat else None, "latency_max_s": lat[-1] if lat else None,
            "rss_samples_kb": samples}


async def stream_run(url: str, texts: list[str], max_new: int, timeout: float) -> dict:
    """Every text as a /generate_stream at once; aggregate tokens/s and time to first token per stream."""
    ttft, tokens, errors, ids = [], 0, [], [[] for _ in texts]
    limits = httpx.Limits(max_connections=len(texts) + 1, max_keepalive_connections=len(texts) + 1)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        async def one(i, text):
            nonlocal tokens
            t = time.perf_counter()
            try:
                async with client.stream("POST", "/generate_stream", json={"inputs": text, "parameters": {
                        "max_new_tokens": max_new, "do_sample": False}}) as r:
                    if r.status_code != 200:
                        errors.append(f"stream {i}: HTTP {r.status_code}")
                        return
                    first = None
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        ev = json.loads(line[5:])
                        if "error" in ev:
                            errors.append(f"stream {i}: {ev['error']}")
                            return
                        first = first or time.perf_counter()
                        tokens += 1
                        ids[i].append((ev.get("token") or {}).get("id"))
                    ttft.append((first or time.perf_counter()) - t)
            except Exception as e:  # noqa: BLE001 - counted
                errors.append(f"stream {i}: {type(e).__name__}: {e}")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, x) for i, x in enumerate(texts)))
        seconds = time.perf_counter() - t0
    q = sorted(ttft)
    pct = lambda f: q[min(len(q) - 1, int(round(f * (len(q) - 1))))] if q else None  # noqa: E731
    return {"streams": len(texts), "errors": len(errors), "error_examples": errors[:5], "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0, "ttft_p50_s": pct(0.5), "ttft_p95_s": pct(0.95),
            "token_ids": ids}


def agreement(a: list[list[int]], b: list[list[int]], first: int = 4) -> float:
    """The share of streams whose first `first` greedy tokens are the same in both runs."""
    return sum(x[:first] == y[:first] for x, y in zip(a, b)) / max(1, len(a))


def streams_mode(a, ck: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from hqtflow.eval_run import source_model

    baseline = a.baseline or source_model(str(ck)) or "smollm2"
    texts = prompts(a.data, a.streams, a.prompt_words, a.seed)
    warm = prompts(a.data, 4, a.prompt_words, a.seed + 1)
    device = run_device(a.device)
    print(device_line(device), flush=True)
    models = {"fp8": str(ck), "bf16": str(baseline)}
    res = {kind: {"rounds": [], "errors": 0} for kind in models}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:  # both servers stay up (an idle one takes no CPU); only one is driven at a time
            for kind, model in models.items():
                servers[kind] = Server(Path(model), a.max_batch_size, Path(tmp) / f"{kind}.log", kind,
                                       ["--device", device, *a.server_arg])
                servers[kind].wait_ready()
            run = lambda kind, xs: asyncio.run(stream_run(servers[kind].url, xs, a.stream_tokens, a.timeout))  # noqa: E731
            for kind in models:
                run(kind, warm)
                singles = [run(kind, [texts[i % len(texts)]]) for i in range(a.single_streams)]
                res[kind]["single_tokens_per_s"] = sum(r["tokens"] for r in singles) / sum(r["seconds"] for r in singles)
                res[kind]["single_ttft_s"] = sorted(r["ttft_p50_s"] or 0 for r in singles)[len(singles) // 2]
                res[kind]["errors"] += sum(r["errors"] for r in singles)
            for i in range(a.rounds):  # alternated, the order flipped each round: drift hits both servers alike
                for kind in (("fp8", "bf16") if i % 2 == 0 else ("bf16", "fp8")):
                    many = run(kind, texts)
                    res[kind]["rounds"].append(many)
                    res[kind]["errors"] += many["errors"]
                    print(f"round {i + 1} {kind}: {a.streams} streams {many['tokens_per_s']:.1f} tok/s aggregate "
                          f"({many['tokens']} tokens in {many['seconds']:.1f} s), TTFT p50 {many['ttft_p50_s'] or 0:.2f} s "
                          f"p95 {many['ttft_p95_s'] or 0:.2f} s, errors {many['errors']}", flush=True)
        finally:
            for kind, server in servers.items():
                server.stop()
                if a.json:  # beside the figures: why a server was slow (a failed graph capture is logged there)
                    Path(a.json).with_name(f"{Path(a.json).stem}_{kind}_server.log").write_text(server.log.read_text())
    agree = agreement(res["fp8"]["rounds"][0].pop("token_ids"), res["bf16"]["rounds"][0]["token_ids"])
    for r in res.values():
        for x in r["rounds"]:
            x.pop("token_ids", None)
    for kind, r in res.items():  # the round of median throughput stands for the server
        r["concurrent"] = sorted(r["rounds"], key=lambda x: x["tokens_per_s"])[len(r["rounds"]) // 2]
        print(f"{kind} server ({models[kind]}): one stream {r['single_tokens_per_s']:.1f} tok/s (TTFT {r['single_ttft_s']:.2f} s); "
              f"{a.streams} streams, median of {len(r['rounds'])} rounds {r['concurrent']['tokens_per_s']:.1f} tok/s, "
              f"errors {r['errors']}", flush=True)
    peer = None
    if not a.no_peer:
        import torch
        from hqtflow import models

        path = models.resolve_model(None if baseline == "smollm2" else baseline)
        from hqtflow.hardware import fastest_dtype

        dtype = fastest_dtype(device)  # what the high-precision server's --dtype auto runs: the faster one here
        tok, model = models.load_tokenizer(path), models.load_model(path, dtype).to(device)
        ids = [tok(x)["input_ids"] for x in texts]
        sys.path.insert(0, str(ROOT / "bench"))
        from hf_batching import timed_generate_batch

        out, secs = timed_generate_batch(model, ids, a.stream_tokens)  # set up and warmed outside the timer, as the servers are
        n = sum(map(len, out))
        peer = {"tokens": n, "seconds": secs, "dtype": dtype, "tokens_per_s": n / secs, "torch_threads": torch.get_num_threads()}
        print(f"transformers generate_batch ({dtype}, in-process): {peer['tokens_per_s']:.1f} tok/s ({n} tokens in {secs:.1f} s)", flush=True)
    f, b = res["fp8"], res["bf16"]
    mark = lambda good: "OK" if good else "MISSED"  # noqa: E731
    speedup = f["concurrent"]["tokens_per_s"] / f["single_tokens_per_s"]
    p95 = max(r["ttft_p95_s"] or float("inf") for r in f["rounds"])
    ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(f["rounds"], b["rounds"])]
    fp8_vs_bf16 = statistics.median(ratios)  # an even --rounds: the mean of the two middle ones
    lines = [f"serve_load streams: {a.streams} streams x {a.stream_tokens} new tokens, {a.prompt_words}-word prompts, greedy; "
             f"{a.rounds} rounds, FP8 and bf16 alternated; one run on a shared machine (noisy)",
             f"FP8 {a.streams} streams (median round) vs one stream: {speedup:.2f}x  [target >= 5x: {mark(speedup >= 5)}]",
             f"FP8 TTFT at {a.streams} streams: p50 {f['concurrent']['ttft_p50_s'] or 0:.2f} s (median round), p95 {p95:.2f} s "
             f"(worst round)  [target p95 <= 3 s: {mark(p95 <= 3)}]",
             f"FP8 / bf16 server at {a.streams} streams: {fp8_vs_bf16:.2f}x, the median of the rounds' "
             f"{', '.join(f'{x:.2f}' for x in ratios)}  [target >= 1.2x: {mark(fp8_vs_bf16 >= 1.2)}]",
             f"bf16 {a.streams} streams vs one stream: {b['concurrent']['tokens_per_s'] / b['single_tokens_per_s']:.2f}x"]
    if peer:
        lines.append(f"FP8 server / transformers generate_batch: {f['concurrent']['tokens_per_s'] / peer['tokens_per_s']:.2f}x, "
                     f"bf16 server / generate_batch: {b['concurrent']['tokens_per_s'] / peer['tokens_per_s']:.2f}x  "
                     f"[target > 1x: {mark(f['concurrent']['tokens_per_s'] > peer['tokens_per_s'])}]")
    lines.append(f"FP8 vs bf16 server, same prompts: first 4 greedy tokens equal in {100 * agree:.0f}% of streams "
                 f"[required >= {100 * a.min_agreement:.0f}%: {mark(agree >= a.min_agreement)}]")
    lines.append(f"errors: {f['errors'] + b['errors']}; " + device_line(device))
    print("\n".join(lines), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"settings": vars(a), "checkpoint": str(ck), "baseline": str(baseline),
                                            "servers": res, "peer": peer, "device": device_line(device),
                                            "fp8_bf16_agreement": agree}, indent=2))
    if agree < a.min_agreement:
        sys.exit(f"the FP8 server's greedy tokens match the bf16 server's in only {100 * agree:.0f}% of streams: "
                 f"a fast but wrong server; its ratios above do not count.")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    for name in ("requests", "concurrency", "max_new_tokens", "prompt_words", "streams", "stream_tokens", "rounds",
                 "single_streams"):
        if getattr(a, name) < 1:
            sys.exit(f"--{name.replace('_', '-')} must be at least 1")
    t_start = time.monotonic()
    deadline = t_start + a.deadline
    ck = Path(a.checkpoint) if a.checkpoint else default_checkpoint()
    if a.mode == "streams":
        return streams_mode(a, ck)
    n_warm = a.warmup_requests if a.warmup_requests is not None else max(400, 2 * a.concurrency)
    n_single = min(a.single_requests or a.requests, a.requests)
    if a.prompt_tokens:
        low, high = (int(x) for x in a.prompt_tokens.split(":"))
        texts = token_prompts(a.data, str(ck), a.requests, low, high, a.seed)
        warm_texts = token_prompts(a.data, str(ck), n_warm, low, high, a.seed + 1)
    else:
        texts = prompts(a.data, a.requests, a.prompt_words, a.seed)
        warm_texts = prompts(a.data, n_warm, a.prompt_words, a.seed + 1)

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(ck, a.max_batch_size, Path(tmp) / "server.log", "fp8", ["--device", run_device(a.device), *a.server_arg])
        try:
            server.wait_ready()
            pid = server.proc.pid
            rss_start = rss_kb(pid)
            print(f"server pid {pid} on {server.url}: {ck} (RSS after load {rss_start / 1024:.1f} MiB)", flush=True)
            run = lambda texts_, c, tick=None: asyncio.run(  # noqa: E731
                drive(server.url, texts_, c, a.max_new_tokens, a.timeout, deadline, tick))
            warm = run(warm_texts, a.concurrency) if n_warm else None
            time.sleep(SETTLE_S)  # both readings in the same state: idle server, nothing in flight
            rss_warm = rss_kb(pid)
            print(f"warm-up: {n_warm} requests at concurrency {a.concurrency} in {warm['seconds'] if warm else 0:.1f} s; "
                  f"RSS {rss_warm / 1024:.1f} MiB", flush=True)
            single = run(texts[:n_single], 1, lambda: rss_kb(pid))
            print(f"single stream: {single['completed']}/{n_single} requests in {single['seconds']:.1f} s, "
                  f"{single['tokens_per_s']:.2f} tokens/s", flush=True)
            conc = run(texts, a.concurrency, lambda: rss_kb(pid))
            time.sleep(SETTLE_S)
            rss_end = rss_kb(pid)
            log_tail = server.log.read_text()[-2000:]
        finally:
            server.stop()

    errors = (warm["errors"] if warm else 0) + single["errors"] + conc["errors"]
    growth = 100.0 * (rss_end - rss_warm) / rss_warm
    peak = max([rss_end, rss_warm, *single["rss_samples_kb"], *conc["rss_samples_kb"]])
    ratio = conc["tokens_per_s"] / single["tokens_per_s"] if single["tokens_per_s"] else float("inf")
    ok = {"errors": errors == 0, "rss_growth": growth < 5.0}
    if not a.prompt_tokens:  # long prompts make the run prefill-bound: batching cannot multiply the few new tokens
        ok["speedup"] = ratio >= 4.0
    mark = lambda good: "OK" if good else "MISSED"  # noqa: E731
    lines = [
        f"serve_load: {ck}, {a.requests} requests at concurrency {a.concurrency} "
        f"(server max batch {a.max_batch_size or 'from its KV cache'}), max_new_tokens {a.max_new_tokens}, "
        f"{a.prompt_tokens + ' token' if a.prompt_tokens else str(a.prompt_words) + '-word'} prompts; "
        f"single stream over the first {n_single} of the same requests",
        f"errors: {errors} (warm-up {warm['errors'] if warm else 0}, single {single['errors']}, concurrent {conc['errors']})"
        f"  [target 0: {mark(ok['errors'])}]",
        f"server RSS: after warm-up {rss_warm / 1024:.1f} MiB, end {rss_end / 1024:.1f} MiB, peak sampled {peak / 1024:.1f} MiB; "
        f"growth {growth:+.2f}%  [target < 5%: {mark(ok['rss_growth'])}]",
        f"single stream: {single['tokens']} tokens in {single['seconds']:.1f} s = {single['tokens_per_s']:.2f} tokens/s "
        f"(p50 request {single['latency_p50_s'] or 0:.2f} s)",
        f"concurrency {a.concurrency}: {conc['tokens']} tokens in {conc['seconds']:.1f} s = {conc['tokens_per_s']:.2f} tokens/s, "
        f"{conc['requests_per_s']:.2f} requests/s (p50 request {conc['latency_p50_s'] or 0:.2f} s, max {conc['latency_max_s'] or 0:.2f} s)",
        f"aggregate speed-up: {ratio:.2f}x  " + (f"[target >= 4x: {mark(ok['speedup'])}]" if "speedup" in ok
                                                  else "(no target with --prompt-tokens: prefill-bound)"),
        f"wall time {time.monotonic() - t_start:.0f} s; " + cpu_line(),
    ]
    for e in (single["error_examples"] + conc["error_examples"])[:5]:
        lines.append(f"  error: {e}")
    if errors:
        lines.append("server log tail:\n" + log_tail)
    print("\n".join(lines), flush=True)
    if a.json:
        for r in (single, conc):
            r["rss_samples_kb"] = r["rss_samples_kb"][-1000:]
        Path(a.json).write_text(json.dumps({
            "settings": vars(a), "checkpoint": str(ck), "warmup": warm, "single": single, "concurrent": conc,
            "rss": {"after_load_kb": rss_start, "warm_kb": rss_warm, "end_kb": rss_end, "peak_sampled_kb": peak,
                    "growth_pct": growth},
            "speedup": ratio, "targets_met": ok}, indent=2))
    return 1 if a.strict and not all(ok.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
