"""`hqtflow eval`: an FP8 model and its bf16 baseline evaluated side by side; a table and a JSON report."""

from __future__ import annotations

from pathlib import Path

from hqtflow.errors import HqtflowError


def source_model(checkpoint: str | None) -> str | None:
    """The bf16 model a checkpoint was quantized from (its manifest records it)."""
    from hqtflow import models
    from hqtflow.formats.artifact import MANIFEST, read_checkpoint_manifest

    path = models.resolve_model(checkpoint)
    if not (path / MANIFEST).exists():
        return None
    return read_checkpoint_manifest(path, verify=False).data.get("model_path")


def _where(model: str | None) -> str:
    """A model as the report records it: an absolute path for a local folder (like the settings' paths), else its name."""
    from hqtflow import models

    return str(models.resolve_model(model).resolve())


def input_files(tasks, include_path, data_dir, ppl_file, manager=None) -> dict[str, str | None]:
    """What an eval reads ({absolute path: sha256}): its tasks' files (lmeval.task_files) and the --ppl-file; `run`
    redoes the eval when one changed."""
    from hqtflow import lmeval
    from hqtflow.formats.artifact import sha256_file

    files = {}
    if tasks:
        manager = manager or lmeval.task_manager(list(include_path), data_dir, list(tasks))
        files = lmeval.task_files(list(tasks), include_path, manager)
    if ppl_file:
        files[str(Path(ppl_file).resolve())] = sha256_file(Path(ppl_file))
    return files


def compute_dtype(model) -> str | None:
    """The high-precision dtype `model` ran in (models.compute_dtype), as hqtflow names it (bf16, fp16, fp32); None
    for a model with none (or another)."""
    from hqtflow import models
    from hqtflow.formats.checkpoint import HP_DTYPE_NAMES

    return HP_DTYPE_NAMES.get(models.compute_dtype(model))


def check_fp8_kv(model, *, perplexity: bool, key: str = "--kv-cache") -> None:
    """Refuse a model the FP8 KV cache cannot score: one without k/v scales, and for perplexity (FP8StaticCache) one
    with sliding-window layers; `key` is the setting that asked for the cache (eval's --kv-cache, run's eval.kv_cache)."""
    from hqtflow.evaluate import bf16_kv_hint
    from hqtflow.runtime.kv_cache import FIX, fp8_kv_refusal

    fix = FIX if key == "--kv-cache" else f"quantize it with the recipe's `kv_cache: fp8`, or {bf16_kv_hint(key)}"
    if why := fp8_kv_refusal(model, fix=fix, static=("Perplexity's", bf16_kv_hint(key)) if perplexity else None):
        raise HqtflowError(why)


def run_eval(model: str | None, *, baseline: str | None, use_source: bool, tasks: tuple[str, ...],
             include_path: tuple[str, ...], data_dir: str | None, limit: int | None, batch_size: int,
             ppl_file: str | None, ppl_windows: int | None, report: Path | None, backend: str = "auto",
             dtype: str = "auto", loader=None, device: str = "cpu", kv_cache: str = "bf16", max_length: int = 512,
             trust_pickle: bool = False, kv_key: str = "--kv-cache") -> str:
    """`loader`: returns (model, tokenizer, kind) in place of loading MODEL here (`--engine inc`); `device`: where
    MODEL (without a loader) and the bf16 baseline run; `kv_cache` "fp8": MODEL is scored through the FP8 KV cache
    with its k/v scales (refused without them), the bf16 baseline always with a bf16 one; `max_length`: lm-eval's
    context and the perplexity window (each at most the model's context); `trust_pickle`: load models whose weights
    are only pickles (api.load_any); `kv_key`: the setting refusals of the FP8 KV cache name (`run`: eval.kv_cache)."""
    from dataclasses import replace

    from hqtflow import lmeval
    from hqtflow.api import load_any
    from hqtflow.bf16_matmul import bf16_matmuls_via_fp32
    from hqtflow.evaluate import EvalSettings, comparison_rows, evaluate, format_table
    from hqtflow.task_yaml import is_task_file

    if not tasks and not ppl_file:
        raise HqtflowError("Nothing to evaluate: give --tasks and/or --ppl-file.")
    for flag, value, least in (("--limit", limit, 1), ("--batch-size", batch_size, 1), ("--ppl-windows", ppl_windows, 1),
                               ("--max-length", max_length, 2)):  # a 1-token window predicts nothing
        if value is not None and value < least:
            raise HqtflowError(f"{flag} must be at least {least}, not {value}.")
    if ppl_file:
        from hqtflow.evaluate import read_ppl_text

        read_ppl_text(ppl_file)  # refuse a binary or empty file before any model is loaded
    if report is not None:
        from hqtflow.formats.artifact import check_report_path

        check_report_path(report, model, "evaluated")
    absolute = lambda p: None if p is None else str(Path(p).resolve())  # the report records every path absolute
    settings = EvalSettings(tasks=tuple(absolute(t) if is_task_file(t) else t for t in tasks),
                            include_path=tuple(absolute(p) for p in include_path),
                            data_dir=absolute(data_dir), limit=limit, batch_size=batch_size,
                            ppl_file=absolute(ppl_file), ppl_windows=ppl_windows, kv_cache=kv_cache,
                            max_length=max_length, ppl_window=max_length)
    manager = None
    if tasks:
        manager = lmeval.task_manager(list(include_path), data_dir, list(tasks))
        lmeval.check_tasks(list(tasks), manager, data_dir)
    files = input_files(tasks, include_path, data_dir, ppl_file, manager)
    candidates = {}
    base_ref = baseline or (source_model(model) if use_source else None)
    if base_ref and not baseline:  # the manifest's: checked before any model is loaded
        from hqtflow import models

        models.recorded_model(base_ref, model, f"`hqtflow eval {model} --baseline MODEL` (the bf16 model it was quantized from), or --no-baseline")
    if base_ref:
        candidates["bf16"] = base_ref
    results, paths, dtypes = {}, {}, {}
    m, tok, kind = loader() if loader else load_any(model, dtype, backend=backend, device=device,
                                                    trust_pickle=trust_pickle)
    if kv_cache == "fp8":
        check_fp8_kv(m, perplexity=bool(ppl_file), key=kv_key)  # before any model is scored
    names = list(candidates) + [kind if kind not in candidates else f"{kind}-model"]
    for n in candidates:
        bm, btok, _ = load_any(candidates[n], "bf16", device=device, trust_pickle=trust_pickle)  # the accuracy reference is the bf16 model
        with bf16_matmuls_via_fp32():
            results[n] = evaluate(bm, btok, replace(settings, kv_cache="bf16"), manager, label=n)
        paths[n] = _where(candidates[n])
        dtypes[n] = compute_dtype(bm)
        del bm
    results[names[-1]] = evaluate(m, tok, settings, manager, label=names[-1], kv_key=kv_key)
    paths[names[-1]] = _where(model)
    dtypes[names[-1]] = compute_dtype(m)
    base = names[0]
    rows = comparison_rows(results, base)
    if report is not None:
        from hqtflow.formats.artifact import write_json_atomic

        write_json_atomic(report, {"models": paths, "dtypes": dtypes, "baseline": base, "settings": settings.__dict__,
                                   "files": files, "results": results, "comparison": rows}, default=str)
    return format_table(rows, names, base)
