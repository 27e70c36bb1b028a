"""`hqtflow bench`: text-generation-benchmark style latency/throughput of an FP8 checkpoint vs its bf16 source.

Both models run through hqtflow's continuous-batching `Engine`, driven synchronously through its public API (its
thread is not started): `batch` random-token prompts of the same length are submitted and prefilled in one step
(the engine's prefill budget is sized to take them all), then `decode_length` decode steps run (`Engine.step()`,
sampling and token emission included; `ignore_eos` keeps every request to the end). Step times come from the
engine's `on_step` hook, which times the model forward of each step.

Per batch size, like text-generation-benchmark: prefill latency and throughput (batch * prompt_length / latency),
decode per-token latency, decode total latency and decode throughput (batch * steps / total latency), as
avg / min / max / p50 / p90 / p99. Samples: one prefill and one decode run per timed run; every decode step is a per-token
latency sample. The models' runs alternate (bf16, fp8, bf16, fp8 ...) so load from elsewhere hits both alike.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hqtflow.errors import HqtflowError, ModelError
from hqtflow.models import DEFAULT_MODEL

STATS = ("avg", "min", "max", "p50", "p90", "p99")  # text-generation-benchmark's: average, lowest, highest, ...
METRICS = (  # key, label, unit, lower is better
    ("prefill_latency", "Prefill latency", "ms", True),
    ("prefill_throughput", "Prefill throughput", "tok/s", False),
    ("decode_token_latency", "Decode latency (per token)", "ms", True),
    ("decode_total_latency", "Decode total latency", "ms", True),
    ("decode_throughput", "Decode throughput", "tok/s", False),
)


@dataclass
class BenchSettings:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    prompt_length: int = 64
    decode_length: int = 32
    runs: int = 3
    warmup: int = 1
    seed: int = 0

    def check(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise HqtflowError(f"--batch-sizes must be positive integers, not {','.join(map(str, self.batch_sizes)) or 'nothing'}.")
        for name, value, low in (("--prompt-length", self.prompt_length, 1), ("--decode-length", self.decode_length, 1),
                                 ("--runs", self.runs, 1), ("--warmup", self.warmup, 0)):
            if value < low:
                raise HqtflowError(f"{name} must be at least {low}, not {value}.")


@dataclass
class Samples:
    """Raw seconds of one model at one batch size."""
    prefill: list[float] = field(default_factory=list)   # one per run
    decode_steps: list[float] = field(default_factory=list)  # every decode step of every run
    decode_totals: list[float] = field(default_factory=list)  # one per run


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise HqtflowError(f"--batch-sizes must be comma-separated integers (e.g. 1,2,4,8), not {text!r}.") from None
    return sizes


def random_prompts(tokenizer, batch: int, length: int, seed: int) -> torch.Tensor:
    """[batch, length] random token ids (no special tokens), the same for a given seed."""
    vocab = len(tokenizer)
    allowed = torch.ones(vocab, dtype=torch.bool)
    special = [i for i in tokenizer.all_special_ids if 0 <= i < vocab]
    allowed[special] = False
    ids = allowed.nonzero().flatten()
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    return ids[torch.randint(len(ids), (batch, length), generator=g)]


class _Runner:
    """One model behind an Engine that is driven step by step from this thread (its public `submit` and `step`)."""

    def __init__(self, name: str, model, tokenizer):
        self.name, self.model, self.tok = name, model, tokenizer
        self.times: list[tuple[str, int, float]] = []
        self.engine = None

    def _engine(self, tokens: int):
        """An engine whose prefill budget takes the whole batch in one step."""
        from hqtflow.runtime.engine import Engine

        if self.engine is None or self.engine.max_prefill_tokens < tokens:
            self.engine = None
            gc.collect()
            self.engine = Engine(self.model, self.tok, max_prefill_tokens=tokens, max_batch_total_tokens=2 * tokens,
                                 on_step=lambda kind, b, secs, shape: self.times.append((kind, b, secs)))
        return self.engine

    def run(self, prompts: torch.Tensor, decode_steps: int) -> tuple[float, list[float]]:
        """Batched prefill + `decode_steps` batched decode steps; (prefill seconds, [decode step seconds])."""
        from hqtflow.runtime.engine import SamplingParams

        batch, n = prompts.shape
        eng = self._engine(batch * (n + decode_steps + 1))
        params = SamplingParams(max_new_tokens=decode_steps + 1, ignore_eos=True)  # greedy; every row runs every step
        reqs = [eng.submit(row.tolist(), params, lambda ev: None) for row in prompts]
        self.times.clear()
        try:
            while eng.step():
                pass
        finally:
            for r in reqs:
                r.cancel()
            eng.step()
        prefill = [s for kind, _, s in self.times if kind == "prefill"]
        decode = [s for kind, _, s in self.times if kind == "decode"]
        if len(prefill) != 1 or len(decode) != decode_steps:
            raise RuntimeError(f"expected 1 prefill and {decode_steps} decode steps, the engine ran {len(prefill)} and {len(decode)}")
        return prefill[0], decode


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(samples: Samples, batch: int, prompt_length: int, decode_steps: int) -> dict[str, dict[str, float]]:
    """{metric: {stat: value}} in ms and tokens/s."""
    per_metric = {
        "prefill_latency": [s * 1e3 for s in samples.prefill],
        "prefill_throughput": [batch * prompt_length / s for s in samples.prefill],
        "decode_token_latency": [s * 1e3 for s in samples.decode_steps],
        "decode_total_latency": [s * 1e3 for s in samples.decode_totals],
        "decode_throughput": [batch * decode_steps / s for s in samples.decode_totals],
    }
    out = {}
    for key, vals in per_metric.items():
        out[key] = {"avg": sum(vals) / len(vals), "p50": _pct(vals, 50), "p90": _pct(vals, 90), "p99": _pct(vals, 99),
                    "min": min(vals), "max": max(vals), "n": len(vals)}
    return out


def benchmark(models: dict[str, tuple], s: BenchSettings, echo=None) -> dict:
    """models: {name: (model, tokenizer)} in column order. Returns {"settings", "results": {batch: {name: summary}}}."""
    s.check()
    runners = [_Runner(name, m, tok) for name, (m, tok) in models.items()]
    results: dict = {}
    for batch in s.batch_sizes:
        samples = {r.name: Samples() for r in runners}
        prompts = {r.name: random_prompts(r.tok, batch, s.prompt_length, s.seed) for r in runners}
        for i in range(s.warmup + s.runs):
            for r in runners:
                prefill, steps = r.run(prompts[r.name], s.decode_length)
                if i >= s.warmup:
                    samples[r.name].prefill.append(prefill)
                    samples[r.name].decode_steps.extend(steps)
                    samples[r.name].decode_totals.append(sum(steps))
        results[batch] = {name: summarize(smp, batch, s.prompt_length, s.decode_length) for name, smp in samples.items()}
        if echo:
            echo(f"batch {batch}: " + ", ".join(
                f"{n} prefill {v['prefill_latency']['avg']:.1f} ms, decode {v['decode_token_latency']['avg']:.2f} ms/token"
                for n, v in results[batch].items()))
        gc.collect()
    return {"settings": s.__dict__, "results": results}


def _fmt(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value:.2f} ms"
    return f"{value:,.1f} tok/s"


def format_table(report: dict, names: list[str]) -> str:
    """One row per (metric, batch size, statistic); a column per model and, for two models, their ratio."""
    ratio = f"{names[-1]}/{names[0]}" if len(names) == 2 else None
    head = ["Step", "Batch", "Stat", *names, *([ratio] if ratio else [])]
    rows = [head]
    for key, label, unit, _ in METRICS:
        for batch, per_model in report["results"].items():
            for j, stat in enumerate(STATS):
                vals = [per_model[n][key][stat] for n in names]
                row = [label if j == 0 else "", str(batch) if j == 0 else "", stat, *[_fmt(v, unit) for v in vals]]
                if ratio:
                    row.append(f"{vals[1] / vals[0]:.3f}x" if vals[0] else "-")
                rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    sep = "+-" + "-+-".join("-" * w for w in widths) + "-+"

    def line(r):
        return "| " + " | ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"

    out = [sep, line(rows[0]), sep.replace("-", "=")]
    for r in rows[1:]:
        if r[0] and len(out) > 3:
            out.append(sep)
        out.append(line(r))
    out.append(sep)
    return "\n".join(out)


def run_bench(model: str | None, *, baseline: str | None, settings: BenchSettings, json_path: Path | None = None,
              echo=None, backend: str = "auto", dtype: str = "auto", device: str = "cpu",
              trust_pickle: bool = False) -> str:
    """Load the FP8 checkpoint (MODEL) and its bf16 baseline on `device`, benchmark both, return the printed text
    (`trust_pickle`: load models whose weights are only pickles, api.load_any)."""
    from hqtflow import models as models_mod
    from hqtflow.eval_run import source_model
    from hqtflow.api import load_any

    settings.check()
    if json_path is not None:
        from hqtflow.formats.artifact import check_report_path

        check_report_path(Path(json_path), model, "benchmarked")
    base_ref = baseline or source_model(model)
    if base_ref and baseline is None and not Path(base_ref).exists():
        raise ModelError(f"The checkpoint's source model {base_ref} (from its manifest) does not exist; pass --baseline.")
    for ref in (model, base_ref) if base_ref else (model,):  # cheap checks before loading anything
        models_mod.check_context(models_mod.load_config(models_mod.resolve_model(ref)),
                                 settings.prompt_length + settings.decode_length + 1,
                                 f"--prompt-length + --decode-length ({settings.prompt_length + settings.decode_length})",
                                 ref or DEFAULT_MODEL)
    m, tok, kind = load_any(model, dtype, backend=backend, device=device, trust_pickle=trust_pickle)
    models: dict[str, tuple] = {}
    if base_ref:
        bm, btok, bkind = load_any(base_ref, dtype, device=device, trust_pickle=trust_pickle)  # auto: the fastest high-precision dtype there
        if bkind == "fp8":
            raise ModelError(f"The baseline {base_ref} is an FP8 checkpoint; give a bf16 model.")
        models[bkind] = (bm, btok)
    models[kind if kind not in models else f"{kind}-model"] = (m, tok)
    names = list(models)
    report = benchmark(models, settings, echo=echo)
    report["models"] = {names[0]: str(base_ref)} if base_ref else {}
    report["models"][names[-1]] = str(model or DEFAULT_MODEL)
    threads = torch.get_num_threads()
    device = next(m.parameters()).device
    header = (f"hqtflow bench: {', '.join(f'{n}={p}' for n, p in report['models'].items())}\n"
              f"prompt length {settings.prompt_length}, decode steps {settings.decode_length}, runs {settings.runs} "
              f"(+{settings.warmup} warm-up), seed {settings.seed}, device {device}, torch threads {threads}\n"
              f"latency = model forward of the step (engine on_step); prefill throughput = batch*prompt_length/latency; "
              f"decode throughput = batch*steps/total decode latency")
    if json_path is not None:
        from hqtflow.formats.artifact import write_json_atomic

        write_json_atomic(json_path, {**report, "results": {str(k): v for k, v in report["results"].items()}}, default=str)
    return header + "\n" + format_table(report, names)
