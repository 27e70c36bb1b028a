"""`hqtflow measure`: model + QUANT_CONFIG + calibration data -> a versioned measurement artifact.

The artifact directory holds INC's files for every rank (`<stem>.json/.npz/_mod_list.json`), a ready
`quant_config.json` for INC's QUANTIZE pointing at them, and `hqtflow_manifest.json`, written last.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

from hqtflow.errors import CalibrationError, ConfigError
from hqtflow.formats import measurement as mf
from hqtflow.formats.artifact import ArtifactKind, StagingDir, check_output_dir, read_manifest
from hqtflow.formats.quant_config import MEASURE_OBSERVERS, QuantConfig, for_inc
from hqtflow.measure.settings import DEFAULT_MAX_LENGTH, MeasureSettings
from hqtflow.progress import Progress
from hqtflow.task_yaml import is_task_file


def load_measure_config(path: str | None) -> QuantConfig:
    cfg = QuantConfig.from_file(path) if path else QuantConfig(mode="MEASURE")
    src = path or "the default config"
    if cfg.mode not in ("MEASURE", "AUTO"):
        raise ConfigError(
            f"{src} has mode {cfg.mode}; `hqtflow measure` needs a MEASURE config such as "
            "quantization_config/maxabs_measure.json."
        )
    if cfg.observer not in MEASURE_OBSERVERS:
        raise ConfigError(f"{src}: observer {cfg.observer!r} is not supported by hqtflow measure; use {' or '.join(MEASURE_OBSERVERS)}.")
    return cfg


def preflight(s: MeasureSettings):
    """Every check that needs no model weights loaded: settings, config, model folder and context, output dir, data,
    TP split, the model's fingerprint. Returns the settings with max_length resolved (resolve_max_length), then what the run needs."""
    from hqtflow import models

    s.validate()
    cfg = load_measure_config(s.config)
    model_dir = models.resolve_model(s.model)
    s = resolve_max_length(s, model_dir)
    texts = [(f, _read(f, s.text_field)) for f in s.text]  # (data first: a loop as --text is data's error)
    manager = None
    if s.tasks:
        from hqtflow import lmeval

        manager = lmeval.task_manager(list(s.include_path), s.data_dir, list(s.tasks))
        lmeval.check_tasks(list(s.tasks), manager, s.data_dir)
    check_output_dir(Path(s.output), s.overwrite, inputs(s, model_dir))
    cfg.check_rank_files(s.tp, s.config or "the default config")
    if s.tp > 1:
        from hqtflow.measure.distributed import check_tp_split, in_torchrun

        check_tp_split(models.load_config(model_dir), s.tp)
        if not in_torchrun():  # what every rank loads first: refused here once, not by each rank
            models.load_tokenizer(model_dir)
    models.fingerprint(model_dir)  # what the manifest records, refused now if it cannot be taken (digests cached)
    return s, cfg, model_dir, texts, manager


def resolve_max_length(s: MeasureSettings, model_dir: Path) -> MeasureSettings:
    """`s` with the tokens per sequence it calibrates with: not given (None), the model's context up to
    DEFAULT_MAX_LENGTH; given (--max-length or a recipe's max_length), refused when longer than the context, since
    positions the model was never trained on would skew the statistics. A config naming no context keeps the value."""
    from dataclasses import replace

    from hqtflow import models

    context = models.context_length(models.load_config(model_dir))
    if s.max_length is None:
        return replace(s, max_length=min(DEFAULT_MAX_LENGTH, context[0]) if context else DEFAULT_MAX_LENGTH)
    if context is not None and s.max_length > context[0]:
        n, source = context
        label = "--max-length" if s.recipe is None else "--max-length (a recipe's `max_length`)"
        raise ConfigError(f"{label} {s.max_length} is longer than the model's context of {n} tokens ({source} in "
                          f"{model_dir / 'config.json'}); give at most {n}, or leave it out to use "
                          f"{min(DEFAULT_MAX_LENGTH, n)}.")
    return s


def inputs(s: MeasureSettings, model_dir: Path) -> list:
    """What a measurement reads: its output may be none of these, nor contain or lie inside one."""
    return [model_dir, s.config, *s.text, *s.include_path, *filter(is_task_file, s.tasks), s.data_dir]


def _read(path: str, text_field: str) -> list[str]:
    from hqtflow.measure.calibration import read_texts

    return read_texts(Path(path), text_field)


def measure(s: MeasureSettings, *, show_progress: bool = True, trust_pickle: bool = False) -> Path:
    """Run the measurement stage (spawning ranks for --tp N unless already inside torchrun); `trust_pickle`: load a
    model whose weights are only pickles (models.load_model)."""
    from hqtflow.measure import distributed

    s, cfg, model_dir, texts, manager = preflight(s)
    if s.tp > 1 and not distributed.in_torchrun():
        return distributed.launch(s, trust_pickle=trust_pickle)
    rank, world = distributed.init(s.tp)
    try:
        return _measure_rank(s, cfg, model_dir, texts, manager, rank, world, show_progress and rank == 0,
                             trust_pickle)
    finally:
        distributed.shutdown()


def _measure_rank(s, cfg: QuantConfig, model_dir: Path, texts, manager, rank: int, world: int, show_progress: bool,
                  trust_pickle: bool) -> Path:
    import torch

    from hqtflow import lmeval, models
    from hqtflow.bf16_matmul import bf16_matmuls_via_fp32
    from hqtflow.measure import distributed
    from hqtflow.measure.hessians import HessianRecorder
    from hqtflow.measure.hooks import ObserverSession
    from hqtflow.measure.kv import KVStats

    torch.manual_seed(s.seed)
    stage = StagingDir(Path(s.output), overwrite=s.overwrite, inputs=inputs(s, model_dir))
    stage.path = distributed.broadcast_path(stage.create if rank == 0 else None)
    try:
        tokenizer = models.load_tokenizer(model_dir)
        model = models.load_model(model_dir, s.dtype, tp_plan="auto" if world > 1 else None, trust_pickle=trust_pickle)
        session = ObserverSession(model, cfg)
        if not session.nodes:
            raise ConfigError("The config selects no module of this model: check its allowlist/blocklist.")
        device = next(model.parameters()).device
        progress = Progress(show_progress)

        # tensor-parallel ranks hold head shards, and a cache of other than keys and values (DeepSeek's MLA: a
        # compressed latent) has no FP8 KV cache to scale: neither is recorded
        kv = KVStats(model) if world == 1 and models.kv_cache_refusal(model) is None else None
        hessians = HessianRecorder(model, list(session.nodes)) if s.hessians else None
        recording = hessians.batch if hessians else lambda mask: nullcontext()
        cache_name = models.cache_kwarg(model)  # the forward's name for the KV cache (looked up once)

        @torch.inference_mode()
        def forward(ids, mask):
            with session.batch(mask), recording(mask), bf16_matmuls_via_fp32():
                # no KV statistics: no cache at all (a forward over the batch needs none; transformers 5.25 builds a
                # hybrid's own and fails on it where layer 0 caches nothing, NemotronH's MoE first)
                extra = {cache_name: kv.cache(mask), "use_cache": True} if kv else {"use_cache": False}
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), **extra).logits
            progress.update(ids.shape[0], int(mask.sum()))
            return logits

        @torch.inference_mode()
        def generate(ids, max_new, until=()):
            with session.batch(None), recording(None):
                extra = {cache_name: kv.cache()} if kv else {}  # (generate takes it under the forward's name)
                text, tokens = lmeval.greedy_generate(model, tokenizer, ids.to(device), max_new, until, **extra)
            session.count(1, tokens)  # the prompt and the generated tokens fed back: all observed
            progress.update(1, tokens)
            return text

        t0 = time.perf_counter()
        sources = run_sources(s, texts, manager, tokenizer, forward, generate, progress)
        seconds = time.perf_counter() - t0
        session.close()
        if session.tokens == 0:
            raise CalibrationError("Calibration ran no tokens through the model.")

        _check_finite(session.stats(), kv, model_dir, s.dtype)
        hessians_record = _write_hessians(stage.path, hessians, model_dir) if hessians is not None else None
        stem = mf.measurement_stem(cfg.dump_stats_path, cfg.observer, rank if world > 1 else None, world)
        files = mf.write_measurement(stage.path, stem, session.stats(), local_rank=rank if world > 1 else None,
                                      num_samples=session.samples)
        if kv is not None and kv.maxabs:
            mf.write_kv_stats(stage.path, kv.layers())
        rank_record = {
            "rank": rank, "stem": stem, "files": [f.name for f in files],
            "layers": session.layer_info(), "unmeasured": session.unused(), "skipped": session.skipped,
        }
        records = distributed.gather(rank_record)
        if rank == 0:
            calibration = {"sources": sources, "samples": session.samples, "tokens": session.tokens, "seconds": seconds}
            extra = {"statistics_dtype": "float32", "hessians": hessians_record,
                     "parallel": "transformers tp_plan=auto; row-parallel outputs observed after the all-reduce"
                     if world > 1 else None}
            write_artifact_files(stage.path, s, cfg, model_dir, records, calibration, extra)
            stage.commit()
        distributed.barrier()
        return Path(s.output)
    except BaseException:
        if rank == 0:
            stage.abort()
        raise


def write_artifact_files(path: Path, s: MeasureSettings, cfg: QuantConfig, model_dir: Path, records: list[dict],
                         calibration: dict, extra: dict) -> None:
    """The artifact's `quant_config.json` and its manifest (last), once every rank's files are in `path`."""
    from hqtflow import models

    data = {
        "world_size": len(records),
        "observer": cfg.observer,
        "dump_stats_path": cfg.dump_stats_path,
        "model_dtype": s.dtype,
        "model_path": os.path.abspath(model_dir),  # `..` folded, symlinks kept as named
        "calibration": {**calibration, "batch_size": s.batch_size, "max_length": s.max_length,
                        "seconds": round(calibration["seconds"], 3)},
        "ranks": records,
        **extra,
        "settings": s.to_json(),
    }
    # On CPU, INC's QUANTIZE also needs use_qdq and a power-of-two or arbitrary scale_method (maxabs_hw has no
    # hardware scale set there).
    mf.write_artifact(path, Path(s.output), base=Path(cfg.dump_stats_path).name, inc_config=for_inc(cfg.to_dict())[0],
                      model=models.fingerprint(model_dir), config=cfg.to_dict(), data=data)


def run_sources(s: MeasureSettings, texts, manager, tokenizer, forward, generate, progress: Progress) -> list[dict]:
    """Feed every calibration source to `forward(ids, mask)` (text windows in batches of one length, then the
    lm-eval tasks, which may also call `generate(ids, max_new)`); return the sources as the manifest records them.
    Both engines (hqtflow's observers, Neural Compressor's) calibrate through this one function."""
    from hqtflow.measure.calibration import batches, token_chunks

    sources: list[dict] = []
    for path, file_texts in texts:
        chunks = token_chunks(file_texts, tokenizer, s.max_length, s.limit)
        if not chunks:
            raise CalibrationError(f"Calibration file {path} has no tokens.")
        progress.start(f"text {Path(path).name}", len(chunks))
        for b in batches(chunks, s.batch_size):
            forward(b.input_ids, b.attention_mask)
        sources.append({"kind": "text", "path": str(path), "sha256": _sha(path), "chunks": len(chunks)})
    if s.tasks:
        from hqtflow import lmeval

        progress.start("lm-eval " + ",".join(s.tasks), None)
        files = lmeval.task_files(list(s.tasks), s.include_path, manager)  # (as read: before the tasks run)
        lm = lmeval.build_lm(forward, tokenizer, batch_size=s.batch_size, max_length=s.max_length, generate=generate)
        task_results, _ = lmeval.run_tasks(lm, list(s.tasks), manager, limit=s.limit)
        sources.append({"kind": "lm-eval", "tasks": list(s.tasks), "limit": s.limit,
                        "include_path": list(s.include_path), "data_dir": s.data_dir, "files": files,
                        "results": task_results})
    progress.close()
    return sources


def _check_finite(stats: dict, kv, model_dir: Path, dtype: str = "bf16") -> None:
    """NaN/inf weights or activations make statistics (and so scales) meaningless: refuse, naming the module and the
    likely cause: in fp16, activations past its largest value (65504) overflowing; else broken weights or data."""
    from hqtflow.errors import ArtifactError, ModelError

    why = ("in fp16 its activations pass fp16's largest value, 65504: measure it with --dtype bf16 or fp32"
           if dtype == "fp16" else "its weights or the data are broken")
    try:
        mf.check_statistics(mf.Measurement(stats, None, 0, "DynamicRange"), f"Model {model_dir}")
    except ArtifactError as e:
        raise ModelError(f"{str(e).split('; re-measure')[0]}: {why}; nothing was written.") from None
    bad = kv.non_finite() if kv is not None else None
    if bad:
        why = why if dtype == "fp16" else "broken weights?"
        raise ModelError(f"Model {model_dir}: the keys/values cached by {bad} are NaN or inf ({why}); "
                         "nothing was written.")


def _write_hessians(directory: Path, recorder, model_dir: Path) -> dict:
    """hessians.safetensors from the recorder (refused when an input was NaN/inf); what the manifest records of it."""
    from hqtflow.errors import ModelError
    from hqtflow.formats.hessians import HESSIAN_FILE, write_hessians

    recorder.close()
    bad = recorder.non_finite()
    if bad:
        raise ModelError(f"Model {model_dir}: the inputs of {bad} are NaN or inf (broken weights?); nothing was written.")
    write_hessians(directory, recorder.matrices(), recorder.owner, recorder.tokens)
    return {"file": HESSIAN_FILE, "matrices": len(recorder.sums), "modules": len(recorder.owner),
            "statistic": "mean of x x^T over calibration tokens (float32)"}


def _sha(path) -> str:
    from hqtflow.formats.artifact import sha256_file

    return sha256_file(Path(path))


def measurement_summary(out: Path) -> str:
    d = read_manifest(out, ArtifactKind.MEASUREMENT, verify=False).data
    nodes = sum(len(r["layers"]) for r in d["ranks"])
    return (f"Wrote {out}: {nodes} observed nodes over {d['world_size']} rank(s), "
            f"{d['calibration']['samples']} samples / {d['calibration']['tokens']} tokens.")
