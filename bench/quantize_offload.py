"""Peak memory and throughput of `hqtflow quantize` with and without `--disk-offload`.

Writes a synthetic Llama-shaped bf16 checkpoint of about --size-gb (random weights, written shard by shard from
per-tensor random tensors: the model is never built in RAM), a matching synthetic measurement artifact (HQT JSON +
hqtflow manifest with the model's fingerprint), then runs `python -m hqtflow quantize` both ways as separate
processes, sampling /proc/PID/status (VmRSS, RssAnon) every ~20 ms. Also measures:
- the import baseline: a process that only imports torch, transformers and hqtflow's CLI;
- the read speed: a plain sequential read of the same safetensors files (every byte once, 64 MiB reads).
The files are read once before everything else, so every run sees them in the page cache (dropping the cache
needs root); the report says whether they were cached.

    python bench/quantize_offload.py                 # 4 GB
    python bench/quantize_offload.py --size-gb 0.2   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sample_process(cmd: list[str], env: dict, interval: float = 0.02) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_rss = peak_anon = 0
    status = Path(f"/proc/{proc.pid}/status")
    while proc.poll() is None:
        try:
            s = status.read_text()
            rss = re.search(r"VmRSS:\s+(\d+) kB", s)
            anon = re.search(r"RssAnon:\s+(\d+) kB", s)
            if rss:
                peak_rss = max(peak_rss, int(rss.group(1)) * 1024)
            if anon:
                peak_anon = max(peak_anon, int(anon.group(1)) * 1024)
        except OSError:
            pass
        time.sleep(interval)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall_s": wall, "peak_rss": peak_rss, "peak_anon": peak_anon, "stdout": out.strip()}


def llama_config(size_gb: float):
    from transformers import LlamaConfig

    h = 2048 if size_gb >= 1 else 1024
    inter = (int(2.75 * h) // 256) * 256
    heads, kv, vocab = h // 128, max(1, h // 512), 32000
    per_layer = 2 * (2 * h * h + 2 * h * kv * 128 + 3 * h * inter + 2 * h)
    emb = 2 * 2 * vocab * h
    layers = max(1, round((size_gb * 1e9 - emb) / per_layer))
    return LlamaConfig(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, head_dim=128, vocab_size=vocab, max_position_embeddings=2048,
                       tie_word_embeddings=False, dtype="bfloat16", bos_token_id=0, eos_token_id=1, pad_token_id=1)


def write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("the a of to and in is".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", pad_token="</s>").save_pretrained(out)


def write_model(out: Path, size_gb: float, shard_bytes: int = 512 * 2**20) -> tuple[object, int]:
    import torch
    from safetensors.torch import save_file

    cfg = llama_config(size_gb)
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    write_tokenizer(out)
    h, inter, kvd, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * cfg.head_dim, cfg.vocab_size
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kvd, h)),
                   (p + "self_attn.v_proj.weight", (kvd, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    gen = torch.Generator().manual_seed(0)
    groups, cur, size = [], [], 0
    for name, shape in shapes:
        n = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        if cur and size + n > shard_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    groups.append(cur)
    total, weight_map = 0, {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name, shape in g:
            t = torch.ones(shape, dtype=torch.bfloat16) if len(shape) == 1 else \
                (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            shard[name] = t
            total += t.nbytes
            weight_map[name] = fname
        save_file(shard, out / fname, metadata={"format": "pt"})
        del shard
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return cfg, total


def write_measurement(meas: Path, model_dir: Path, cfg) -> None:
    import numpy as np

    from hqtflow.formats import measurement as mf
    from hqtflow.formats.artifact import ArtifactKind, write_manifest
    from hqtflow.models import fingerprint

    rng = np.random.default_rng(0)
    names = [f"model.layers.{i}.{m}" for i in range(cfg.num_hidden_layers)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]
    nodes = {n: mf.NodeStats(inputs=[np.array([[float(rng.uniform(0.5, 20))]], dtype=np.float32)]) for n in names}
    meas.mkdir(parents=True)
    dump = "./hqt_output/measure"
    stem = mf.measurement_stem(dump, "maxabs", None, 1)
    files = mf.write_measurement(meas, stem, nodes, local_rank=None, num_samples=16)
    write_manifest(meas, ArtifactKind.MEASUREMENT, model=fingerprint(model_dir),
                   config={"mode": "MEASURE", "observer": "maxabs", "dump_stats_path": dump},
                   data={"world_size": 1, "ranks": [{"rank": 0, "stem": stem, "files": [f.name for f in files],
                                                     "layers": {}, "unmeasured": [], "skipped": {}}],
                         "model_path": str(model_dir.resolve()), "model_dtype": "bf16", "observer": "maxabs",
                         "dump_stats_path": dump, "synthetic": True})


def read_all(files: list[Path], chunk: int = 64 * 2**20) -> tuple[float, int]:
    buf = bytearray(chunk)
    mv = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while (k := fh.readinto(mv)) > 0:
                n += k
    return time.perf_counter() - t0, n


def cached_fraction(files: list[Path]) -> str:
    """fincore-like check via mincore is not in the stdlib; report what `vmtouch`/`fincore` say if present."""
    tool = shutil.which("fincore")
    if not tool:
        return "unknown (no fincore); files were read once just before, so they are most likely in the page cache"
    r = subprocess.run([tool, "--bytes", "--noheadings", "--output", "RES,SIZE", *map(str, files)], capture_output=True, text=True)
    res = size = 0
    for line in r.stdout.splitlines():
        a, b = line.split()[:2]
        res, size = res + int(a), size + int(b)
    return f"{100 * res / max(size, 1):.0f}% of the files' pages in the page cache (fincore)"


def net_throughput(total: int, wall_s: float, base_s: float) -> float | None:
    """GB/s over the run's wall time minus the import baseline's; None (no figure) when that leaves under 5% of the
    run (a run no slower than the baseline's process)."""
    net = wall_s - base_s
    return total / net / 1e9 if net > 0.05 * wall_s else None


def _gbs(value: float | None, width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:{width}.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--workdir", type=Path, default=None, help="Where to write (default: a temp dir, removed).")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    work = a.workdir or Path(tempfile.mkdtemp(prefix="hq-offload-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    from tqdm import tqdm

    bar = tqdm(total=5, desc="write the model", unit="phase", file=sys.stderr)  # minutes per phase at 4 GB
    try:
        model_dir, meas = work / "model", work / "meas"
        t0 = time.perf_counter()
        cfg, total = write_model(model_dir, a.size_gb)
        write_measurement(meas, model_dir, cfg)
        files = sorted(model_dir.glob("*.safetensors"))
        print(f"synthetic Llama: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}: "
              f"{total / 1e9:.3f} GB bf16 in {len(files)} files (written in {time.perf_counter() - t0:.1f} s)")
        bar.update()
        bar.set_description("read the files")
        read_all(files)  # warm the page cache for every run alike
        rs, rn = min(read_all(files)[0] for _ in range(2)), total
        read_gbs = rn / rs / 1e9
        print(f"page cache: {cached_fraction(files)}")
        from hqtflow.hardware import machine_line

        print(machine_line())
        print(f"sequential read of the safetensors files: {read_gbs:.2f} GB/s ({rs:.2f} s)")
        bar.update()
        bar.set_description("import baseline")
        base = sample_process([sys.executable, "-c", "import torch, transformers, accelerate, safetensors, hqtflow.cli, hqtflow.quantize.run; "
                               "from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM"], env)
        print(f"import baseline (torch, transformers incl. the Llama classes, hqtflow): peak RssAnon {base['peak_anon'] / 2**20:.0f} MiB, "
              f"peak RSS {base['peak_rss'] / 2**20:.0f} MiB, {base['wall_s']:.1f} s")
        rows = []
        for label, extra in (("in-memory", []), ("disk-offload", ["--disk-offload"])):
            bar.update()
            bar.set_description(f"quantize {label}")
            out = work / f"fp8-{label}"
            read_all(files)
            r = sample_process([sys.executable, "-m", "hqtflow", "quantize", "-m", str(meas), "-o", str(out), *extra], env)
            n_out = len(list(out.glob("*.safetensors")))
            thr = total / r["wall_s"] / 1e9
            thr_net = net_throughput(total, r["wall_s"], base["wall_s"])
            rows.append((label, r, thr, thr_net, n_out))
            shutil.rmtree(out) if not a.keep else None
        bar.update()
        bar.close()
        print(f"\n{'mode':<13} {'wall s':>7} {'peak RssAnon':>13} {'/ckpt':>6} {'(-base)/ckpt':>13} {'peak RSS':>9} "
              f"{'/ckpt':>6} {'GB/s':>6} {'/read':>6} {'GB/s*':>6} {'/read*':>7} {'shards':>6}")
        for label, r, thr, thr_net, n_out in rows:
            print(f"{label:<13} {r['wall_s']:7.1f} {r['peak_anon'] / 2**20:10.0f} MiB {r['peak_anon'] / total:6.1%} "
                  f"{(r['peak_anon'] - base['peak_anon']) / total:13.1%} {r['peak_rss'] / 2**20:5.0f} MiB "
                  f"{r['peak_rss'] / total:6.1%} {thr:6.2f} {thr / read_gbs:6.2f} {_gbs(thr_net, 6)} {_gbs(thr_net and thr_net / read_gbs, 7)} {n_out:6d}")
        print("GB/s = bf16 checkpoint bytes / process wall time; * = wall time minus the import-baseline process's "
              "wall time (n/a: the run took no longer than the baseline, within 5%); /read = ratio to the sequential read speed; RSS includes the memory-mapped file pages "
              "(reclaimable), RssAnon does not.")
        off = rows[1]
        print(f"targets (disk-offload): peak RssAnon < 15% of checkpoint: {off[1]['peak_anon'] / total:.1%} "
              f"(above the import baseline: {(off[1]['peak_anon'] - base['peak_anon']) / total:.1%}); "
              f"throughput >= 0.5 x read speed: {off[2] / read_gbs:.2f} (excluding startup: {_gbs(off[3] and off[3] / read_gbs, 0)})")
    finally:
        bar.close()
        if not a.keep and a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
