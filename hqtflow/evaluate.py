"""Evaluation: lm-eval tasks and WikiText-2 perplexity for several models side by side, with deltas."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from hqtflow.api import load_any, raise_fp16_overflow  # noqa: F401 - load_any re-exported for old callers
from hqtflow.errors import CalibrationError, HqtflowError, not_a_file


@dataclass(frozen=True)
class EvalSettings:
    tasks: tuple[str, ...] = ()
    include_path: tuple[str, ...] = ()
    data_dir: str | None = None
    limit: int | None = None
    batch_size: int = 8
    max_length: int = 512
    ppl_file: str | None = None
    ppl_window: int = 512
    ppl_windows: int | None = None  # at most this many windows (None: the whole file)
    kv_cache: str = "bf16"  # or "fp8": keys and values read back through the checkpoint's FP8 KV cache (k/v scales)


def read_ppl_text(path, what: str = "Perplexity file") -> str:
    """The text of a --ppl-file (`what`: how the messages name it), refused in one sentence when it cannot be one."""
    if not Path(path).is_file():
        raise CalibrationError(f"{what} {path} {not_a_file(path)}.")
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte order mark is no text to score
    except UnicodeDecodeError:
        raise CalibrationError(f"{what} {path} is not UTF-8 text (a binary file?).") from None
    except OSError as e:
        raise CalibrationError(f"{what} {path} cannot be read ({e.strerror}).") from None
    if not text.strip():
        raise CalibrationError(f"{what} {path} is empty.")
    return text


def capped_to_context(model, tokens: int) -> int:
    """`tokens`, at most the model's context (positions past it were never trained, or do not exist)."""
    from hqtflow.models import context_length

    context = context_length(model.config.to_dict())
    return min(tokens, context[0]) if context else tokens


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, *, window: int = 512, max_windows: int | None = None, progress=None,
               label: str = "perplexity", kv_cache: str = "bf16") -> dict:
    """Perplexity over disjoint `window`-token windows (each scored from its own start, no overlap); `progress`
    (a hqtflow.progress.Progress) gets a bar over the windows. A model whose context is shorter than `window` is
    scored in windows of its context (positions past it were never trained, or do not exist). kv_cache "fp8": each
    window is one forward through a fresh `FP8StaticCache` with the checkpoint's k/v scales, so attention reads the
    keys and values rounded to FP8 (ValueError without the scales); "bf16": a plain forward (no cache)."""
    window = capped_to_context(model, window)
    forward = model if kv_cache == "bf16" else fp8_kv_forward(model)
    ids = tokenizer.encode(text, add_special_tokens=False)
    n = len(ids) // window
    if max_windows:
        n = min(n, max_windows)
    if n == 0:
        raise CalibrationError(f"The perplexity text has {len(ids)} tokens, fewer than one {window}-token window.")
    nll, count = 0.0, 0
    device = next(model.parameters()).device
    if progress is not None:
        progress.start(label, n, unit="window")
    for i in range(n):
        x = torch.tensor([ids[i * window:(i + 1) * window]], device=device)
        logits = forward(x).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
        count += window - 1
        if progress is not None:
            progress.update(1, window)
    return {"perplexity": math.exp(nll / count), "windows": n, "window": window, "tokens": count}


def fp8_kv_forward(model):
    """model(x) with its attention reading keys and values back from a new FP8 KV cache (the checkpoint's
    k_scale/v_scale, the static decoder's `FP8StaticCache`) sized to x; ValueError without the scales."""
    from hqtflow.models import cache_kwarg
    from hqtflow.runtime.kv_cache import FP8StaticCache, kv_scales

    scales, kwarg = kv_scales(model), cache_kwarg(model)
    return lambda x: model(x, **{kwarg: FP8StaticCache(model.config, x.shape[1], scales)}, use_cache=True)


def padded_forward(model, tokenizer):
    """lm-eval's forward(ids, mask) -> logits in padded batches, for a model the serving engine cannot run: one
    padding column more, so every row takes the masked attention kernel (transformers drops an all-ones mask for the
    causal one, whose bf16 sums differ); a document's score can still move with its batch's width by bf16 rounding."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @torch.inference_mode()
    def forward(ids, mask):
        ids, mask = F.pad(ids, (0, 1), value=pad), F.pad(mask, (0, 1), value=0)
        return model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits[:, :-1]

    @torch.inference_mode()
    def generate(ids, max_new, until=()):
        from hqtflow.lmeval import greedy_generate

        return greedy_generate(model, tokenizer, ids.to(device), max_new, until)[0]

    return forward, generate


@contextmanager
def serving_engine(model, tokenizer, *, batch_size: int, max_length: int, kv_cache: str = "bf16"):
    """lm-eval's scoring and greedy generation through the serving engine, so a document's log-likelihood and text
    are what `hqtflow serve` gives it: each sequence's attention is its own (a padded batch's is not: the kernels'
    sums depend on the padded width, by a bf16 step that FP8 inputs amplify up to a nat on a document). Yields
    (score, generate) for lmeval.build_lm, or None for a model the engine cannot run; the model's attention and the
    engine's KV memory are given back after. kv_cache: the engine's ("fp8": the checkpoint's k/v scales, checked
    first: ValueError without them)."""
    from hqtflow.errors import ResourceError
    from hqtflow.runtime.engine import Engine, SamplingParams
    from hqtflow.models import context_length
    from hqtflow.runtime import limits
    from hqtflow.runtime.settings import ServeSettings

    # the server's defaults for this model (its prefill chunk: the same chunks, so the same scores)
    if kv_cache == "fp8":
        from hqtflow.runtime.kv_cache import kv_scales

        kv_scales(model)  # before the engine, whose ValueError means an attention it has no kernel for
    serve, before = limits.fit(ServeSettings(), context_length(model.config.to_dict())), model.config._attn_implementation
    engine = None
    try:
        try:
            engine = Engine(model, tokenizer, pad_to_multiple=serve.pad_sequence_to_multiple_of, cuda_graphs=(), kv_cache=kv_cache,
                            max_prefill_tokens=serve.max_batch_prefill_tokens,
                            max_batch_total_tokens=max(batch_size, 1) * (max_length + 2 * serve.pad_sequence_to_multiple_of))
        except ValueError:  # an attention the engine has no kernel for (Bloom, Falcon, Llama 4's chunked layers, ...)
            yield None
            return

        def run(jobs: list[tuple[list[int], SamplingParams]]) -> list:
            last: dict[int, object] = {}
            for i, (ids, params) in enumerate(jobs):
                engine.submit(ids, params, lambda ev, i=i: last.__setitem__(i, ev) if ev.finish_reason or ev.error else None)
            while engine.step():
                pass
            for i, (ids, params) in enumerate(jobs):
                ev = last.get(i)
                if ev is None:
                    raise ResourceError(f"An lm-eval request of {len(ids)} + {params.max_new_tokens} tokens does not fit "
                                        f"the {engine.capacity_tokens} KV tokens eval sized for --batch-size x --max-length; "
                                        "raise --max-length.")
                if ev.error:
                    raise_fp16_overflow(model)  # fp16 overflowed: its own sentence, exit 4
                    raise ResourceError(f"The serving engine failed on an lm-eval request: {ev.error}.")
            return [last[i] for i in range(len(jobs))]

        def score(items: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
            """(tokens, n): the log-likelihood of the last n tokens given the ones before, and whether each is greedy."""
            out = []
            jobs = [(ids, SamplingParams(max_new_tokens=0, prompt_logprobs=1, prompt_logprobs_from=len(ids) - n)) for ids, n in items]
            for (ids, n), ev in zip(items, run(jobs)):
                scored = ev.prompt[len(ids) - n:]
                out.append((sum(lp for lp, _ in scored), all(top[0][0] == t for (_, top), t in zip(scored, ids[len(ids) - n:]))))
            return out

        def generate(ids: torch.Tensor, max_new: int, until=()) -> str:
            [ev] = run([(ids[0].tolist(), SamplingParams(max_new_tokens=max_new, stop=tuple(until)))])
            return ev.generated_text

        yield score, generate
    finally:
        if engine is not None:
            engine.stop()
            engine.pool = engine.graphs = None  # the KV blocks, not held through the perplexity pass
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()
        model.set_attn_implementation(before)


def bf16_kv_hint(key: str) -> str:
    """What turns the FP8 KV cache off, in the words of the setting `key` that asked for it: eval's --kv-cache, or
    the recipe key `run` reads (eval.kv_cache)."""
    return "give --kv-cache bf16" if key == "--kv-cache" else f"set {key} to bf16 in the recipe"


def evaluate(model, tokenizer, s: EvalSettings, manager=None, *, label: str = "", show_progress: bool = True,
             kv_key: str = "--kv-cache") -> dict:
    """{"tasks": {task: {metric: v}}, "wikitext": {...}} for one model; progress bars (named `label`) over
    lm-eval's requests and the perplexity windows. `s.kv_cache` "fp8": log-likelihoods through the serving engine's
    FP8 KV cache and perplexity through `FP8StaticCache` (HqtflowError for a model the engine cannot run, naming
    `kv_key`, the setting that asked for it)."""
    from hqtflow import lmeval
    from hqtflow.progress import Progress

    out: dict = {}
    progress = Progress(show_progress)
    prefix = f"{label}: " if label else ""
    if s.tasks:
        # lm-eval's context, at most the model's: the engine runs a scored sequence's last token too (max_length + 1)
        max_length = capped_to_context(model, s.max_length + 1) - 1
        progress.start(f"{prefix}lm-eval {','.join(s.tasks)}", 0, unit="request")
        with serving_engine(model, tokenizer, batch_size=s.batch_size, max_length=max_length, kv_cache=s.kv_cache) as engine:
            if engine is None and s.kv_cache == "fp8":
                raise HqtflowError(f"{kv_key} fp8 scores through hqtflow's serving engine, which cannot run this "
                                   f"model's attention: {bf16_kv_hint(kv_key)}.")
            forward, generate = padded_forward(model, tokenizer) if engine is None else (None, engine[1])
            lm = lmeval.build_lm(forward, tokenizer, batch_size=s.batch_size, max_length=max_length, generate=generate,
                                 score=engine and engine[0], progress=progress.update, announce=progress.add_total)
            out["tasks"], out["higher_is_better"] = lmeval.run_tasks(lm, list(s.tasks), manager, limit=s.limit)
            del lm, generate  # (they hold the engine)
    if s.ppl_file:
        out["wikitext"] = {**perplexity(model, tokenizer, read_ppl_text(s.ppl_file), window=s.ppl_window,
                                        max_windows=s.ppl_windows, progress=progress, label=f"{prefix}perplexity",
                                        kv_cache=s.kv_cache),
                           "file": Path(s.ppl_file).name}
    progress.close()
    return out


def comparison_rows(results: dict[str, dict], baseline: str) -> list[dict]:
    """One row per (task, metric) lm-eval reports (standard errors left out): each model's value, its delta to the
    baseline, and the metric's direction (`higher_is_better`, as lm-eval's task says; a lower-is-better metric such
    as a perplexity also gets its delta in percent)."""
    from hqtflow.lmeval import is_metric

    rows = []
    base = results[baseline]
    for task, metrics in base.get("tasks", {}).items():
        better = base.get("higher_is_better", {}).get(task, {})
        for metric in filter(is_metric, metrics):
            rows.append(_row(task, metric, better.get(metric), results, baseline,
                             lambda r: r.get("tasks", {}).get(task, {}).get(metric)))
    if "wikitext" in base:
        text = Path(base["wikitext"].get("file") or "wikitext2").stem  # the --ppl-file's name: whatever text it is
        rows.append(_row(text, "perplexity", False, results, baseline, lambda r: r.get("wikitext", {}).get("perplexity")))
    return rows


def _row(task, metric, higher_is_better, results, baseline, get) -> dict:
    b = get(results[baseline])
    row = {"task": task, "metric": metric, "higher_is_better": higher_is_better,
           "values": {k: get(v) for k, v in results.items()}}
    row["delta"] = {k: (None if v is None or b is None else v - b) for k, v in row["values"].items() if k != baseline}
    if higher_is_better is False and b:
        row["delta_pct"] = {k: (None if v is None else 100 * (v - b) / b) for k, v in row["values"].items() if k != baseline}
    return row


ARROWS = {True: " ↑", False: " ↓"}  # lm-eval's marks: higher is better, lower is better


def format_table(rows: list[dict], names: list[str], baseline: str) -> str:
    head = ["task", "metric", *names, *[f"Δ {n}" for n in names if n != baseline]]
    lines = [head]
    for r in rows:
        vals = [_fmt(r["values"].get(n)) for n in names]
        deltas = []
        for n in names:
            if n == baseline:
                continue
            d = r["delta"].get(n)
            pct = r.get("delta_pct", {}).get(n)
            deltas.append("-" if d is None else (f"{d:+.3f} ({pct:+.2f}%)" if pct is not None else f"{d:+.4f}"))
        lines.append([r["task"], r["metric"] + ARROWS.get(r.get("higher_is_better"), ""), *vals, *deltas])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}"
