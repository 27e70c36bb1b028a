"""Neural Compressor (INC, `neural-compressor-pt`) as an engine hqtflow drives: `--engine inc`.

- measure: INC's `prepare` (FP8Config MEASURE, its maxabs observers; `use_qdq` on CPU) + the calibration hqtflow's
  own engine runs (`hqtflow.measure.run.run_sources`: text windows, lm-eval tasks) + `finalize_calibration`; the
  files INC dumps become an hqtflow measurement artifact (same layout, checks and manifest, written atomically).
- quantize / generate / eval / serve: INC's `convert` (QUANTIZE) of the bf16 model with hqtflow's measurement and
  QUANT_CONFIG, after hqtflow's own checks (`hqtflow.quantize.run.plan_job`). `quantize` writes the FP8 weights and
  scales INC's modules apply as hqtflow's compressed-tensors checkpoint, or (`--scales-only`) the scale files INC
  wrote, in hqtflow's scales artifact.

INC reads the measurement's `.npz` (a pickle): it is given one hqtflow writes from the verified JSON twin, in a
private work directory (INC also writes its scale files there), never the artifact's own. INC caches the rank from
the environment in module globals; every call here pins it to a single process. On CPU INC runs the QDQ path and
only the power-of-two / arbitrary scale methods (`maxabs_hw` has no hardware scale set off Gaudi).
"""

from __future__ import annotations

import os
import functools
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from hqtflow.errors import ArtifactError, CalibrationError, ConfigError

_HW_ROUNDINGS = ("HW_ALIGNED", "HW_ALIGNED_FIXED")
_NO_SCALE_FILE = ("Neural Compressor writes no scale file for {} (it needs no statistics); use hqtflow's own engine "
                  "for these scale files.")


def _quantization():
    try:
        from neural_compressor.torch import quantization
    except Exception as e:  # noqa: BLE001 - any import failure means INC is unusable here
        raise ConfigError(f"--engine inc needs Neural Compressor (pip install neural-compressor-pt), which does not "
                          f"import here ({type(e).__name__}).") from None
    return quantization


def inc_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("neural-compressor-pt", "neural-compressor"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


@contextmanager
def single_process():
    """INC caches LOCAL_RANK / WORLD_SIZE (or torch.distributed's) in module globals the first time it looks:
    pin them to "no rank" for this call and put the previous values back afterwards."""
    from neural_compressor.torch.algorithms.fp8_quant.prepare_quant import prepare_model as pm

    keys = ("_local_rank", "_world_size", "_local_rank_initialized", "_world_size_initialized")
    saved = {k: getattr(pm, k) for k in keys}
    pm._local_rank, pm._world_size, pm._local_rank_initialized, pm._world_size_initialized = -1, -1, True, True
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(pm, k, v)


def own_temp_files(fn):
    """Run `fn` with Python's temp files in a directory removed afterwards: INC writes each FP8Config (and each mode
    it switches one to) to a `NamedTemporaryFile(delete=False)` and never removes it."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with tempfile.TemporaryDirectory(prefix="hqtflow-inc-tmp-") as directory:
            saved, tempfile.tempdir = tempfile.tempdir, directory
            try:
                return fn(*args, **kwargs)
            finally:
                tempfile.tempdir = saved

    return run


def fp8_config(cfg, drop: tuple[str, ...] = (), **changes):
    """INC's FP8Config from an hqtflow QuantConfig (its `to_dict` is the JSON INC reads) less `drop`, plus `changes`."""
    d = {k: v for k, v in {**cfg.to_dict(), **changes}.items() if k not in drop}
    try:
        return _quantization().FP8Config(**d)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"Neural Compressor refuses the QUANT_CONFIG ({e}).") from None


def check_method(cfg, device: str) -> None:
    """On CPU INC has no hardware scale set and its OPT weight search needs torch.hpu: refuse those methods in one
    sentence (INC itself fails with a KeyError / ModuleNotFoundError)."""
    from hqtflow.formats.quant_config import not_in_inc
    from hqtflow.scales import scale_method

    if why := not_in_inc(cfg.scale_method):  # (INC's own refusal is a traceback from inside convert)
        raise ConfigError(f"{why}; run it with hqtflow's own engine (without --engine inc).")
    if device != "cpu":
        return
    m = scale_method(cfg.scale_method, "cpu")
    rules = (m.weight, m.activation)
    if any(r.rounding in _HW_ROUNDINGS or r.value == "OPT" for r in rules):
        name = cfg.scale_method if isinstance(cfg.scale_method, str) else "this scale_method"
        why = "it has no hardware scale set there" if any(r.rounding in _HW_ROUNDINGS for r in rules) else \
            "its weight search calls torch.hpu"
        raise ConfigError(f"Neural Compressor cannot run {name} on CPU ({why}); use "
                          "maxabs_pow2, act_maxabs_pow2_weights_pcs_maxabs_pow2, unit_scale or maxabs_arbitrary, or "
                          "--device hpu on Gaudi.")


def _place(model, device: str):
    if device == "hpu":
        from hqtflow.engines import hpu

        return hpu.to_hpu(model)
    return model


def _step(device: str) -> None:
    if device == "hpu":
        from hqtflow.engines import hpu

        hpu.mark_step()


# ---- measure --------------------------------------------------------------------------------------------
@own_temp_files
def measure(s, device: str = "cpu", *, show_progress: bool = True, trust_pickle: bool = False) -> Path:
    """`hqtflow measure --engine inc`: calibrate through INC's observers, write an hqtflow measurement artifact
    (`trust_pickle`: models.load_model's)."""
    import torch

    from hqtflow import lmeval, models
    from hqtflow.bf16_matmul import bf16_matmuls_via_fp32
    from hqtflow.formats import measurement as mf
    from hqtflow.formats.artifact import StagingDir
    from hqtflow.measure.run import inputs, preflight, run_sources, write_artifact_files
    from hqtflow.progress import Progress

    if s.tp > 1:
        raise ConfigError("--engine inc measures on one card; run hqtflow's own engine for --tp N.")
    if s.hessians:
        raise ConfigError("--hessians (a recipe's `gptq: true`) is recorded by hqtflow's own observers; measure "
                          "without --engine inc for it.")
    s, cfg, model_dir, texts, manager = preflight(s)
    if cfg.observer == "maxabs_per_channel":  # INC fails with "Required shape files are missing"
        raise ConfigError("Neural Compressor's per-channel observer needs a shape run before it (observer `shape`), "
                          "which --engine inc does not drive; measure per channel with hqtflow's own engine.")
    q = _quantization()
    torch.manual_seed(s.seed)
    stage = StagingDir(Path(s.output), overwrite=s.overwrite, inputs=inputs(s, model_dir))
    stage.create()
    try:
        tokenizer = models.load_tokenizer(model_dir)
        model = models.load_model(model_dir, s.dtype, trust_pickle=trust_pickle)
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        if not any(cfg.selects(n, type(m).__name__) for n, m in linears.items()):
            raise ConfigError("The config selects no module of this model: check its allowlist/blocklist.")
        base = Path(cfg.dump_stats_path).name
        inc_cfg = fp8_config(cfg, mode="MEASURE", dump_stats_path=str(stage.path / base), use_qdq=device == "cpu")
        model = _place(model, device)
        dev = next(model.parameters()).device
        with single_process():
            model = q.prepare(model, inc_cfg)
        progress = Progress(show_progress)
        counts = {"samples": 0, "tokens": 0}

        @torch.inference_mode()
        def forward(ids, mask):
            with bf16_matmuls_via_fp32():  # as hqtflow's engine computes (the same statistics)
                out = observed(ids, mask)
            counts["samples"] += ids.shape[0]
            counts["tokens"] += int(mask.sum())
            progress.update(ids.shape[0], int(mask.sum()))  # after the batch ran: the bar's tok/s is its real rate
            return out

        def observed(ids, mask):
            """INC's observers see every position: padded rows run alone, unpadded, so padding is never observed."""
            if bool(mask.all()):
                out = model(input_ids=ids.to(dev)).logits
                _step(device)
                return out
            out = None
            for r in range(ids.shape[0]):
                n = int(mask[r].sum())
                if not bool(mask[r, :n].all()):
                    raise CalibrationError("Calibration batches must be right-padded for --engine inc.")
                if n == 0:
                    continue
                logits = model(input_ids=ids[r:r + 1, :n].to(dev)).logits
                _step(device)
                if out is None:
                    out = logits.new_zeros(ids.shape[0], ids.shape[1], logits.shape[-1])
                out[r, :n] = logits[0]
            return out

        @torch.inference_mode()
        def generate(ids, max_new, until=()):  # counted as hqtflow's engine counts it: prompt + tokens fed back
            text, tokens = lmeval.greedy_generate(model, tokenizer, ids.to(dev), max_new, until)
            _step(device)
            counts["samples"] += 1
            counts["tokens"] += tokens
            progress.update(1, tokens)
            return text

        t0 = time.perf_counter()
        sources = run_sources(s, texts, manager, tokenizer, forward, generate, progress)
        seconds = time.perf_counter() - t0
        if counts["tokens"] == 0:
            raise CalibrationError("Calibration ran no tokens through the model.")
        with single_process():
            q.finalize_calibration(model)

        stem = mf.measurement_stem(base, cfg.observer, None, 1)
        files = [f"{stem}{ext}" for ext in mf.RANK_FILES]
        missing = [f for f in files if not (stage.path / f).is_file()]
        if missing:  # INC's save swallows its own errors: its silence is not success
            raise ArtifactError(f"Neural Compressor did not write {missing[0]} (its save failed silently).")
        meas = mf.read_measurement(stage.path / f"{stem}.json")
        if not meas.nodes:
            raise ArtifactError("Neural Compressor measured no module of this model.")
        selected = [n for n, m in linears.items() if cfg.selects(n, type(m).__name__)]
        layers = {n: {"type": type(linears[n]).__name__, "style": "replicated", "packed_parts": 1,
                      "weight_shape": list(linears[n].weight.shape), "global_weight_shape": list(linears[n].weight.shape),
                      "input_dim": linears[n].in_features, "output_dim": linears[n].out_features}
                  for n in meas.nodes if n in linears}
        record = {"rank": 0, "stem": stem, "files": files, "layers": layers,
                  "unmeasured": [n for n in selected if n not in meas.nodes],
                  "skipped": {n: "excluded by allowlist/blocklist" for n in linears if n not in selected}}
        calibration = {"sources": sources, **counts, "seconds": seconds}
        extra = {"statistics_dtype": cfg.hp_dtype, "parallel": None,
                 "engine": {"name": "inc", "version": inc_version(), "device": device}}
        write_artifact_files(stage.path, s, cfg, model_dir, [record], calibration, extra)
        stage.commit()
        return Path(s.output)
    except BaseException:
        stage.abort()
        raise


# ---- convert (quantize / run) ---------------------------------------------------------------------------
@own_temp_files
def convert(job, model, device: str = "cpu", *, scale_dir: Path | None = None):
    """INC's `convert` of `model` (bf16, on `device`) with `job`'s measurement (a `plan_job` result) and config.

    Returns INC's model; every module the plan quantizes must be one INC patched. `scale_dir`: copy the scale files
    INC wrote (`<stem>_<SCALE_METHOD>.json/.npz`) there."""
    import shutil

    from hqtflow.formats import measurement as mf

    if job.meas.world_size > 1:
        raise ArtifactError(f"{job.meas.directory} is a {job.meas.world_size}-rank measurement; --engine inc runs one "
                            f"card: `hqtflow unify -g {''.join(map(str, range(job.meas.world_size)))}` it first.")
    check_method(job.cfg, device)
    q = _quantization()
    stem, base, observer = job.meas.stems[0], job.meas.base, job.meas.observer
    with tempfile.TemporaryDirectory(prefix="hqtflow-inc-") as work:
        # INC unpickles the .npz: give it one written here from the verified JSON (INC writes its scales here too)
        meas = job.meas.ranks[0]
        mf.write_measurement(Path(work), stem, meas.nodes, local_rank=None, num_samples=meas.num_samples)
        cfg = fp8_config(job.cfg, mode="QUANTIZE", observer=observer, dump_stats_path=str(Path(work) / base),
                         use_qdq=device == "cpu", drop=("device_for_scales",) if device == "cpu" else ())
        model = _place(model, device)
        with single_process():
            qmodel = q.convert(model, cfg)
        if scale_dir is not None:
            written = sorted(p for p in Path(work).iterdir() if p.name.startswith(f"{stem}_") and p.suffix in (".json", ".npz")
                             and not p.name.endswith("_mod_list.json"))
            if not written:
                raise ArtifactError(_NO_SCALE_FILE.format(job.cfg.scale_method))
            for p in written:
                shutil.copy2(p, Path(scale_dir) / p.name)
    patched = patched_linears(qmodel)
    missing = sorted(set(job.plan["quantize"]) - set(patched))
    if missing:
        raise ArtifactError(f"Neural Compressor left {missing[0]} unquantized although the measurement covers it.")
    return qmodel


def patched_linears(model) -> dict:
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "PatchedLinear"}


def _settings_check(s) -> None:
    for flag, on in (("--disk-offload", s.disk_offload), ("--gptq", s.gptq),
                     ("--weight-only", s.weight_only), ("--kv-cache fp8", s.kv_cache == "fp8")):
        if on:
            raise ConfigError(f"{flag} is not implemented with --engine inc; use hqtflow's own engine for it.")


def load(s, device: str = "cpu", *, trust_pickle: bool = False):
    """(INC's quantized model, tokenizer) for generate / eval / serve: `s` is a QuantizeSettings (model,
    measurement, config, scale method); `trust_pickle`: models.load_model's."""
    import torch

    from hqtflow import models
    from hqtflow.quantize.run import plan_job

    _settings_check(s)
    if s.scales_only:
        raise ConfigError("--scales-only writes files; generate, eval and serve run the quantized model.")
    job = plan_job(s, trust_pickle=trust_pickle)
    check_method(job.cfg, device)
    # INC's modules compute in the config's hp_dtype (bf16 by default); the model around them runs in it too, whatever
    # dtype it was measured in (an fp32 model around them fed fp32 queries and bf16 values to attention)
    model = models.load_model(job.model_dir, job.cfg.hp_dtype, trust_pickle=job.trust_pickle)
    with torch.no_grad():
        qmodel = convert(job, model, device).eval()
    return qmodel, models.load_tokenizer(job.model_dir)


def quantize(s, device: str = "cpu", *, trust_pickle: bool = False) -> Path:
    """`hqtflow quantize --engine inc`: INC converts the model; the FP8 weights and the scales its QDQ modules
    apply are written as hqtflow's compressed-tensors checkpoint, or with --scales-only the scale files INC wrote
    (beside the measurement files and a QUANT_CONFIG, as hqtflow's engine lays them out); same manifests and checks.
    `trust_pickle`: models.load_model's."""
    import torch

    from hqtflow import models
    from hqtflow.formats.artifact import check_output_dir, staged_output, write_manifest
    from hqtflow.formats.checkpoint import copy_side_files, save_checkpoint
    from hqtflow.quantize.convert import _set_module, _untie_if_needed
    from hqtflow.formats.artifact import ArtifactKind
    from hqtflow.quantize.run import plan_job

    check_output_dir(Path(s.output), s.overwrite, [s.measurement, s.config, s.model if s.model and Path(s.model).exists() else None])
    _settings_check(s)
    if device != "cpu" and not s.scales_only:
        raise ConfigError("quantize --engine inc writes a checkpoint from INC's CPU (QDQ) modules; use --device cpu, "
                          "or --scales-only for the scale files INC computes on the card.")
    job = plan_job(s, trust_pickle=trust_pickle)
    check_method(job.cfg, device)
    target = job.cfg.device_for_scales or "CPU"
    if device == "cpu" and target != "CPU":  # INC on the CPU computes the CPU's scales, whatever the config names
        raise ConfigError(f"--engine inc on the CPU computes scales for the CPU, not {target}; make {target} scales with "
                          f"hqtflow's own engine (`hqtflow quantize --scales-only --scales-for {target.lower()}`) or run "
                          "INC on the card (--device hpu).")
    if s.scales_only and all(r.rounding == "SCALE_UNIT" for m in job.method.methods() for r in (m.weight, m.activation)):
        raise ConfigError(_NO_SCALE_FILE.format(job.cfg.scale_method))
    model = models.load_model(job.model_dir, job.dtype, trust_pickle=job.trust_pickle)
    if s.scales_only:
        return _scales_only(s, job, model, device)
    with torch.no_grad():
        _untie_if_needed(model, job.plan["quantize"])
        qmodel = convert(job, model, device)
        per_channel = False
        for name, mod in patched_linears(qmodel).items():
            fp8 = fp8_linear(mod, job.cfg.fp8_config)
            per_channel |= fp8.per_channel
            _set_module(qmodel, name, fp8)
    with staged_output(Path(s.output), overwrite=s.overwrite, inputs=[job.meas.directory, job.model_dir, s.config]) as tmp:
        save_checkpoint(qmodel, tmp, ignore=job.plan["ignore"], per_channel=per_channel, static_input=True)
        copy_side_files(job.model_dir, tmp)
        data = {**_common(job, device), "kv_cache": "bf16", "mode": "w8a8-static", "settings": asdict(s)}
        write_manifest(tmp, ArtifactKind.CHECKPOINT, model=job.fingerprint, config=job.cfg.to_dict(), data=data)
    return Path(s.output)


def _common(job, device: str) -> dict:
    """The manifest fields hqtflow's quantize records, plus the engine."""
    meas = job.meas
    return {"scale_method": job.cfg.scale_method if isinstance(job.cfg.scale_method, str) else "custom",
            "target": device, "fp8": job.cfg.fp8_config, "hp_dtype": job.cfg.hp_dtype,
            "source_measurement": str(meas.directory.resolve()), "source_digest": meas.digest(),
            "provenance_known": meas.manifest.data.get("provenance_known", True),
            "skipped": job.plan["skipped"], "quantized": sorted(job.plan["quantize"]), "model_path": os.path.abspath(job.model_dir),
            "engine": {"name": "inc", "version": inc_version(), "device": device}}


def _scales_only(s, job, model, device: str) -> Path:
    """INC's own scale files for the measurement, in hqtflow's scales artifact (measurement files beside them and a
    QUANT_CONFIG for INC pointing at the directory)."""
    import torch

    from hqtflow.formats.artifact import ArtifactKind, staged_output, write_manifest
    from hqtflow.formats.measurement import copy_measurement_files
    from hqtflow.formats.scale_files import write_quant_config

    with staged_output(Path(s.output), overwrite=s.overwrite, inputs=[job.meas.directory, job.model_dir, s.config]) as tmp:
        with torch.no_grad():
            convert(job, model, device, scale_dir=tmp)
        scale_files = sorted(p.name for p in tmp.iterdir() if p.suffix in (".json", ".npz"))
        files = copy_measurement_files(job.meas.directory, job.meas.stems, tmp) + scale_files
        write_quant_config(tmp, Path(s.output), job.cfg, job.meas.base, device, job.meas.observer,
                           job.meas.ranks[0].nodes)
        write_manifest(tmp, ArtifactKind.SCALES, model=job.fingerprint, config=job.cfg.to_dict(),
                       data={**_common(job, device), "world_size": 1, "files": files})
    return Path(s.output)


def fp8_linear(mod, fp8: str = "E4M3"):
    """hqtflow's FP8Linear holding what INC's CPU PatchedLinear applies: its FP8 weight (INC keeps it [in, out]),
    the weight scale it dequantizes with and the input scale its QuantDequant uses."""
    import torch

    from hqtflow.quantize.fp8_linear import FP8Linear

    w = mod.weight.detach().t()  # [out, in]
    hp = mod._mod_extra_config.config_params["hp_dtype"] if hasattr(mod, "_mod_extra_config") else torch.bfloat16
    w_scale = torch.as_tensor(mod.dequant_weights.scale).detach().to(hp)
    bias = getattr(mod, "bias", None)
    m = FP8Linear(w.shape[1], w.shape[0], bias=bias is not None, hp_dtype=hp, fp8=fp8, per_channel=w_scale.numel() > 1)
    m.weight.copy_(w)
    m.weight_scale.copy_(w_scale.reshape(m.weight_scale.shape))
    m.input_scale.copy_(torch.as_tensor(float(mod.quant_input.scale), dtype=hp).reshape(1))
    if bias is not None:
        m.bias.copy_(bias.detach())
    return m


# ---- running (generate / eval / serve --engine inc) -----------------------------------------------------
def load_run(model_ref: str | None, measurement, *, device: str, config=None, scale_method: str | None = None,
             backend: str = "auto", dtype: str = "auto", trust_pickle: bool = False):
    """(INC's quantized model, tokenizer): the bf16 MODEL converted at load from a measurement, like optimum-habana
    and TGI-Gaudi with QUANT_CONFIG. hqtflow's runtime options do not apply to INC's modules and are refused.
    `trust_pickle`: models.load_model's."""
    from hqtflow.quantize.run import QuantizeSettings

    if measurement is None:
        raise ConfigError("--engine inc quantizes the bf16 MODEL at load: give its measurement with -m DIR.")
    for flag, value in (("--backend", backend), ("--dtype", dtype)):
        if value != "auto":
            raise ConfigError(f"{flag} sets hqtflow's FP8 runtime; --engine inc runs Neural Compressor's modules "
                              "in the QUANT_CONFIG's hp_dtype (bf16 unless it sets another).")
    s = QuantizeSettings(measurement=str(measurement), output="-", model=model_ref,
                         config=str(config) if config else None, scale_method=scale_method)
    model, tok = load(s, device, trust_pickle=trust_pickle)
    if device == "hpu":
        from hqtflow.engines import hpu

        model = hpu.wrap_in_hpu_graph(model)
    return model, tok


def prompt_inputs(tok, text: str, device: str, *, add_special_tokens: bool = True, pad_to_multiple: int = 128):
    """Tokenized prompt on `device`; on HPU left-padded to a bucketed length (few shapes, few HPU graphs)."""
    ids = tok(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    if device != "hpu":
        return dict(ids)
    from hqtflow.engines import hpu

    input_ids, mask = hpu.pad_to_bucket(ids["input_ids"], ids["attention_mask"], tok.pad_token_id,
                                        pad_to_multiple=pad_to_multiple)
    return {"input_ids": hpu.to_hpu(input_ids), "attention_mask": hpu.to_hpu(mask)}
