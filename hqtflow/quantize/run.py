"""`hqtflow quantize`: measurement artifact + model + QUANTIZE config -> INC scale files, or an FP8 checkpoint.

Scales come from `hqtflow.scales` (pure functions of statistics and weights). The checkpoint is compressed-tensors
FP8 plus the tokenizer and an hqtflow manifest that adds what the layout cannot say (scale method, target device,
the source measurement's digest).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hqtflow.choices import KVCache, parse
from hqtflow.errors import ArtifactError, ConfigError
from hqtflow.formats.artifact import ArtifactKind, artifact_kind, read_manifest, staged_output, write_manifest
from hqtflow.formats.quant_config import QuantConfig, not_in_inc
from hqtflow.quantize.settings import QuantizeSettings  # noqa: F401 - re-exported (it lived here)
from hqtflow.formats.measurement import (LoadedMeasurement, Measurement, gaudi_only_note, load_measurement,
                                         require_dynamic_range)


DEFAULT_CONFIG = {"mode": "QUANTIZE", "scale_method": "maxabs_arbitrary", "blocklist": {"names": ["lm_head"]}}


def quant_config(s: QuantizeSettings) -> QuantConfig:
    cfg = QuantConfig.from_file(s.config) if s.config else QuantConfig.from_dict(DEFAULT_CONFIG, source="default")
    if cfg.mode not in ("QUANTIZE", "LOAD", "AUTO"):
        raise ConfigError(f"{s.config} has mode {cfg.mode}; `hqtflow quantize` needs a QUANTIZE config such as quantization_config/maxabs_quant.json.")
    changes = {}
    if s.scale_method:
        from hqtflow.formats.quant_config import SCALE_METHODS, choice

        changes["scale_method"] = choice("scale_method", s.scale_method, SCALE_METHODS, source="--scale-method")
        from hqtflow.formats.quant_config import INC_DYNAMIC_METHODS

        if changes["scale_method"] in INC_DYNAMIC_METHODS:  # INC's dynamic-only methods imply its switch
            changes["extra"] = {**cfg.extra, "dynamic_quantization": True}
    if s.scales_for:
        changes["device_for_scales"] = s.scales_for.upper()
    return cfg.with_changes(**changes) if changes else cfg


# ---- the stage ----------------------------------------------------------------------------------
@dataclass
class Job:
    """Everything `quantize` decided before touching weights."""

    cfg: QuantConfig
    target: str
    method: object  # hqtflow.scales.ScaleRules: (module name, type name) -> ScaleMethod; .default
    meas: LoadedMeasurement
    model_dir: Path
    fingerprint: dict
    plan: dict
    dtype: str
    hessians: object = None  # hqtflow.formats.hessians.Hessians for --gptq, else None
    trust_pickle: bool = False  # load a model whose weights are only pickles (models.load_model)
    skeleton: object = None  # the model on the meta device (models.skeleton), planned on (its MoE experts unfused)


def plan_config(s: QuantizeSettings):
    """Every check of the config and flags alone (no measurement, no model) -> (config, target, scale rules); `run`
    makes them before any stage runs."""
    from hqtflow.scales import TARGETS, scale_rules

    cfg = quant_config(s)
    target = (cfg.device_for_scales or "cpu").lower()
    if target not in TARGETS:
        raise ConfigError(f"--scales-for {target!r} is not a valid target; valid values are {', '.join(TARGETS)}.")
    rules = scale_rules(cfg.scale_method, target, dynamic=cfg.dynamic_quantization)
    method = rules.default
    if any(m.dynamic for m in rules.methods()) and s.scales_only:
        inc = "INC does not have it either" if not_in_inc(method.name) else "hand the QUANT_CONFIG to INC as is"
        raise ConfigError(f"{method.name} computes activation scales at run time; INC uses no scale files with "
                          f"dynamic_quantization, so --scales-only does not apply ({inc}).")
    if any(m.smoothquant for m in rules.methods()) and (s.scales_only or s.disk_offload or not rules.uniform):
        raise ConfigError(f"{method.name} folds its smoothing into the model's weights: it writes FP8 checkpoints only "
                          "(no --scales-only, --disk-offload or per-layer scale_method sections).")
    if s.disk_offload and (any(m.dynamic for m in rules.methods()) or not rules.uniform):
        raise ConfigError("--disk-offload writes one static scale method everywhere; it cannot be combined with "
                          "dynamic methods or per-layer scale_method sections yet.")
    if s.gptq and (s.scales_only or any(m.smoothquant for m in rules.methods())):
        raise ConfigError("--gptq changes the FP8 weights of a checkpoint; it cannot be combined with --scales-only "
                          "(INC quantizes the original weights) or SmoothQuant methods.")
    if not s.scales_only and cfg.fp8_config != "E4M3":
        raise ConfigError("compressed-tensors FP8 checkpoints are E4M3; fp8_config E5M2 is supported with --scales-only.")
    return cfg, target, rules


def plan_job(s: QuantizeSettings, *, trust_pickle: bool = False, skeleton=None) -> Job:
    """Every check that needs no weights: config, target, measurement (complete, finite, same model), rank count;
    `trust_pickle` is kept for the job's model loading (models.load_model); `skeleton`: the model's, when the caller
    has built it already (models.skeleton; the job's from then on, changed by planning)."""
    from hqtflow import models

    cfg, target, rules = plan_config(s)
    meas = load_measurement(s.measurement)
    hessians = meas.hessians() if s.gptq else None
    if s.gptq and hessians is None:
        raise ArtifactError(f"{meas.directory} has no Hessians; measure again with --hessians to use --gptq.")
    for st, r in zip(meas.stems, meas.ranks):
        require_dynamic_range(r, f"{meas.directory / st}.json")
    recorded = meas.manifest.data.get("model_path")
    if s.model is None and recorded is None:
        raise ArtifactError(f"{meas.directory} was imported without --model, so it names no model; pass the MODEL argument.")
    model_dir = models.resolve_model(s.model) if s.model is not None else models.recorded_model(
        recorded, meas.directory, f"`hqtflow quantize MODEL -m {meas.directory} -o {s.output}`")
    fp = models.fingerprint(model_dir)
    if recorded is not None and not meas.manifest.model:  # every stage that records a model records its fingerprint
        raise ArtifactError(f"{meas.directory}'s manifest names the model {recorded} but holds no fingerprint of it; "
                            "the manifest is corrupt: measure again.")
    if meas.manifest.model and not models.same_model(meas.manifest.model, fp, str(meas.directory)):
        raise ArtifactError(
            f"Measurement {meas.directory} was made on a different model, or on this one before its config or weights "
            f"changed (fingerprint {meas.manifest.model.get('id')}, {model_dir} is {fp['id']}); measure this model first."
        )
    if s.scales_only:
        cfg.check_rank_files(meas.world_size, s.config or "the default config")
    else:
        if meas.world_size > 1:
            raise ArtifactError(f"{meas.directory} is a {meas.world_size}-rank measurement; a checkpoint needs one rank: "
                                f"run `hqtflow unify -g {''.join(map(str, range(meas.world_size)))} -m {meas.directory} -o DIR` first.")
    skeleton = models.skeleton(model_dir) if skeleton is None else skeleton
    plan = plan_modules(skeleton, cfg, meas.ranks[0], unfuse=not s.scales_only,
                        world_size=meas.world_size, weight_only=s.weight_only and not s.scales_only)
    if not plan["quantize"]:
        raise ConfigError("The config quantizes no Linear layer of this model (every one is excluded by its "
                          "allowlist/blocklist or has no statistics): check the config.")
    dtype = meas.manifest.data.get("model_dtype", "bf16")
    if not s.scales_only and not s.weight_only:
        kinds = {(m.activation.granularity, m.activation.dynamic, m.activation.backoff, m.activation.rounding)
                 if m.dynamic else None for m in (rules(n) for n in plan["quantize"])}
        if len(kinds) > 1:
            raise ConfigError("The per-layer scale methods mix static and dynamic activations (or different dynamic "
                              "rules); an FP8 checkpoint has one activation scheme (--scales-only writes mixed INC scales).")
    _warn_fixed_scales(rules, plan["quantize"], meas.ranks[0], target, cfg.fp8_config, weight_only=s.weight_only)
    return Job(cfg, target, rules, meas, model_dir, fp, plan, dtype, hessians, trust_pickle, skeleton)


def _warn_fixed_scales(rules, names: list[str], meas: Measurement, target: str, fp8: str, *,
                       weight_only: bool = False) -> None:
    """One AccuracyWarning when a method that ignores the statistics (unit_scale, hw_aligned_single_scale: fixed
    scales) puts a layer's largest measured weight or input (not with `weight_only`) below FP8's smallest normal
    number on `target`: every value of it then quantizes to a subnormal code (at most 3 bits) or zero, which ruins
    the model."""
    import warnings

    import torch

    from hqtflow.errors import AccuracyWarning
    from hqtflow.scales import FP8_DTYPES, activation_scale, weight_scale

    fmt = torch.float8_e4m3fnuz if (target, fp8) == ("gaudi2", "E4M3") else FP8_DTYPES[fp8]
    tiny, ruined, fixed = float(torch.finfo(fmt).tiny), [], set()
    for name in names:
        m = rules(name)
        if m.weight.value != "FIXED_VALUE":
            continue
        fixed.add(m.name)
        node = meas.nodes[name]
        s_w = float(weight_scale(torch.zeros(1, 1), m.weight, target=target, fp8=fp8))
        s_in = float(activation_scale(0.0, m.activation, target=target, fp8=fp8))
        w_max = float(node.params["weight"].max()) if "weight" in node.params else float("inf")
        x_max = float(node.inputs[0].max()) if node.inputs and not weight_only else float("inf")
        if w_max / s_w < tiny:
            ruined.append(f"{name} (weight scale {s_w:g})")
        elif x_max / s_in < tiny:
            ruined.append(f"{name} (input scale {s_in:g})")
    if ruined:
        verb = "ignores" if len(fixed) == 1 else "ignore"
        warnings.warn(f"{' and '.join(sorted(fixed))} {verb} the statistics: fixed scales put all weights or all "
                      f"inputs of {len(ruined)} of {len(names)} quantized layers ({ruined[0]} the first) below FP8's "
                      f"smallest normal number ({tiny:g}) on {target}, which ruins accuracy; a maxabs method suits "
                      "this model.", AccuracyWarning, stacklevel=2)


def weight_rounding(job: Job, *, show_progress: bool = True):
    """GPTQ from the measurement's Hessians as `convert_model`'s `round_weight` (a bar per layer), or None."""
    if job.hessians is None:
        return None
    from tqdm.auto import tqdm

    from hqtflow.quantize.gptq import gptq_round
    from hqtflow.scales import full_scale

    fp8, total = job.cfg.fp8_config, len(job.plan["quantize"])
    bar = tqdm(total=total, desc="GPTQ", unit="layer", disable=None if show_progress else True)

    def round_weight(name: str, weight, scale):
        try:
            w = gptq_round(weight, job.hessians.get(name, weight.shape[1]), scale, fp8, fullscale=full_scale(fp8, job.target))
        except ValueError:
            raise ArtifactError(f"{job.hessians.path}: the Hessian of {name} is not positive semi-definite even with "
                                "damping; the file is corrupt (measure again with --hessians).") from None
        bar.update(1)
        if bar.n >= total:
            bar.close()
        return w
    return round_weight


def _convert(model, job: Job, *, weight_only: bool) -> None:
    """Swap the planned Linears for FP8Linear: the scale method(s), or HQT's SmoothQuant folded into the model."""
    from hqtflow.progress import Progress
    from hqtflow.quantize.convert import convert_model
    from hqtflow.quantize.experts import unfuse_experts

    unfuse_experts(model, job.plan["unfused"])
    kw = dict(target=job.target, fp8=job.cfg.fp8_config, hp_dtype=job.cfg.hp_dtype)
    if job.method.default.smoothquant:
        from hqtflow.quantize.smoothquant import convert_smoothquant

        if weight_only:
            raise ConfigError(f"{job.method.default.name} smooths activations; it cannot be combined with --weight-only.")
        convert_smoothquant(model, job.plan["quantize"], job.meas.ranks[0], job.method.default.name, **kw)
    else:
        convert_model(model, job.plan["quantize"], job.meas.ranks[0], job.method, weight_only=weight_only,
                      round_weight=weight_rounding(job), progress=Progress(None), **kw)


def quantize_in_memory(s: QuantizeSettings, dtype: str | None = None, *, trust_pickle: bool = False):
    """bf16 model + measurement -> (FP8 model, tokenizer) in memory, nothing written (`serve fp8 MODEL -m DIR`).

    Scales come from the weights as stored; `dtype` (bf16/fp16/fp32, "auto": the fastest here; None: the model's
    own) is the compute dtype afterwards, as `hqtflow.load(checkpoint, dtype=...)` gives it; `trust_pickle`:
    models.load_model's."""
    import torch

    from hqtflow import models

    job = plan_job(s, trust_pickle=trust_pickle)
    model = models.load_model(job.model_dir, job.dtype, trust_pickle=job.trust_pickle)
    with torch.no_grad():
        _convert(model, job, weight_only=s.weight_only)
    if dtype is not None:
        from hqtflow.hardware import resolve_dtype
        from hqtflow.quantize.fp8_linear import compute_in

        compute_in(model, models.torch_dtype(resolve_dtype(dtype)))
    return model, models.load_tokenizer(job.model_dir)


def quantize(s: QuantizeSettings, *, trust_pickle: bool = False, skeleton=None) -> Path:
    """Plan (`plan_job`), then the one writer of the output kind asked for (INC scale files, a checkpoint streamed
    from disk, a checkpoint converted in memory), then the manifest, all inside one staged output directory.
    `trust_pickle`: load a model whose weights are only pickles (models.load_model); `skeleton`: plan_job's."""
    from hqtflow.formats.artifact import check_output_dir

    check_output_dir(Path(s.output), s.overwrite, [s.measurement, s.config, s.model if s.model and Path(s.model).exists() else None])
    job = plan_job(s, trust_pickle=trust_pickle, skeleton=skeleton)
    kv_stats = _kv_stats(s, job)
    if s.scales_only:
        if s.disk_offload:
            raise ConfigError("--disk-offload writes an FP8 checkpoint; it cannot be combined with --scales-only.")
        writer = _scale_files_writer(s, job)
    elif s.disk_offload:
        writer = _offload_writer(s, job, kv_stats)
    else:
        writer = _in_memory_writer(s, job, kv_stats)
    with staged_output(Path(s.output), overwrite=s.overwrite, inputs=[job.meas.directory, job.model_dir, s.config]) as tmp:
        kind, data = writer(tmp)
        data = {**_provenance(job), **data}
        data["notes"] = [*data.get("notes", []), *gaudi_only_note(job.meas.ranks[0].nodes)]
        write_manifest(tmp, kind, model=job.fingerprint, config=job.cfg.to_dict(), data=data)
    return Path(s.output)


def _kv_stats(s: QuantizeSettings, job: Job) -> dict | None:
    """The measurement's KV-cache statistics when `--kv-cache fp8` asks for KV scales, else None."""
    if parse(KVCache, s.kv_cache, "--kv-cache") != KVCache.FP8:
        return None
    from hqtflow.formats.measurement import KV_FILE

    if s.scales_only:
        raise ConfigError("--kv-cache fp8 puts KV scales into an FP8 checkpoint; it cannot be combined with --scales-only.")
    from hqtflow import models

    models.check_kv_cache(job.skeleton, "--kv-cache fp8", "quantize with --kv-cache bf16")
    stats = job.meas.kv_stats()
    if not stats:
        raise ArtifactError(f"{job.meas.directory} has no KV-cache statistics ({KV_FILE}): {_why_no_kv(job.meas)}")
    return stats


def _why_no_kv(meas) -> str:
    """Why a measurement has no KV-cache statistics, and what gives them."""
    data = meas.manifest.data
    if meas.world_size > 1 or (data.get("unified_from") or {}).get("world_size", 1) > 1:
        return ("a measurement on several ranks (and one unified from it) carries none; measure on one rank "
                "(--tp 1) for --kv-cache fp8.")
    if data.get("provenance_known") is False:
        return "an imported HQT dump carries none; measure with hqtflow on one rank for --kv-cache fp8."
    return "measure again on one rank with this hqtflow for --kv-cache fp8."


def _provenance(job: Job) -> dict:
    """What every quantize artifact's manifest records about its method, inputs and plan."""
    meas, cfg = job.meas, job.cfg
    return {"scale_method": cfg.scale_method if isinstance(cfg.scale_method, dict) else job.method.default.name,
            "target": job.target, "fp8": cfg.fp8_config, "hp_dtype": cfg.hp_dtype,
            "weight_rounding": "gptq" if job.hessians is not None else "nearest",
            "source_measurement": str(meas.directory.resolve()), "source_digest": meas.digest(),
            "provenance_known": meas.manifest.data.get("provenance_known", True),
            "skipped": job.plan["skipped"], "quantized": sorted(job.plan["quantize"]), "model_path": os.path.abspath(job.model_dir)}


def _scale_files_writer(s: QuantizeSettings, job: Job):
    """Per-rank INC scale files and the QUANTIZE QUANT_CONFIG (`--scales-only`)."""
    from hqtflow import models
    from hqtflow.quantize.scales_only import write_scale_files

    model = models.load_model(job.model_dir, job.dtype, trust_pickle=job.trust_pickle)

    def write(tmp: Path):
        files = write_scale_files(tmp, Path(s.output), model, job.meas, job.cfg, job.method, job.target)
        return ArtifactKind.SCALES, {"world_size": job.meas.world_size, "files": files}
    return write


def _checkpoint_data(s: QuantizeSettings, job: Job, dynamic, written: Path) -> dict:
    return {"kv_cache": s.kv_cache, "mode": "weight-only" if s.weight_only else
            ("w8a8-dynamic" if dynamic else "w8a8-static"), "settings": asdict(s), "notes": _notes(written)}


def _notes(checkpoint: Path) -> list[str]:
    """What a user of the checkpoint outside hqtflow must know: MoE experts stored under hqtflow's own per-expert
    names (a model whose checkpoint keeps its experts fused, GraniteMoE's `input_linear`, has no per-expert names)."""
    from hqtflow.formats.hf_names import per_expert_containers
    from hqtflow.formats.safetensors_files import safetensors_header, weight_files

    own = per_expert_containers(k for f in weight_files(checkpoint) for k in safetensors_header(f)[1])
    if not own:
        return []
    return [f"the MoE experts ({sorted(own)[0]}{' and others' if len(own) > 1 else ''}) are stored one by one under "
            "hqtflow's own names, since the model's checkpoint has no per-expert names: hqtflow loads them, "
            "transformers and vLLM do not (blocklist the experts' type to keep them fused, in high precision)"]


def _dynamic_rule(s: QuantizeSettings, job: Job):
    """The checkpoint's dynamic activation method, None for static activations or weight-only."""
    if s.weight_only:
        return None
    return next((m for m in (job.method(n) for n in job.plan["quantize"]) if m.dynamic), None)


def _offload_writer(s: QuantizeSettings, job: Job, kv_stats: dict | None):
    """A checkpoint streamed from the model's files one tensor at a time (`--disk-offload`)."""
    from hqtflow.progress import Progress
    from hqtflow.formats.checkpoint import copy_side_files
    from hqtflow.quantize.offload import prepare, write_offloaded
    from hqtflow.scales import HP_DTYPES

    cfg, method = job.cfg, job.method.default
    kv_values = None
    if kv_stats:
        from hqtflow.quantize.convert import kv_cache_scales

        kv_values = kv_cache_scales(job.skeleton, kv_stats, method, target=job.target,
                                    fp8=cfg.fp8_config, hp_dtype=cfg.hp_dtype)
    plan = prepare(job.model_dir, job.plan, Path(s.output), dtype=job.dtype, weight_only=s.weight_only,
                   per_channel=method.weight.granularity == "PCS", extra_values=kv_values,
                   hp_dtype=HP_DTYPES[cfg.hp_dtype], opt_weight=method.weight.value == "OPT", gptq=job.hessians is not None)

    def write(tmp: Path):
        write_offloaded(plan, tmp, job.meas.ranks[0], method, target=job.target, fp8=cfg.fp8_config,
                        hp_dtype=cfg.hp_dtype, round_weight=weight_rounding(job), progress=Progress(None))
        copy_side_files(job.model_dir, tmp)
        return ArtifactKind.CHECKPOINT, {**_checkpoint_data(s, job, _dynamic_rule(s, job), tmp), "disk_offload": True}
    return write


def _in_memory_writer(s: QuantizeSettings, job: Job, kv_stats: dict | None):
    """A checkpoint from the model converted in memory (every method, SmoothQuant and per-layer rules included)."""
    import torch

    from hqtflow import models
    from hqtflow.formats.checkpoint import copy_side_files, save_checkpoint

    cfg = job.cfg
    model = models.load_model(job.model_dir, job.dtype, trust_pickle=job.trust_pickle)
    per_channel = any(job.method(n).weight.granularity == "PCS" for n in job.plan["quantize"])
    dynamic = _dynamic_rule(s, job)

    def write(tmp: Path):
        with torch.no_grad():
            _convert(model, job, weight_only=s.weight_only)
            if kv_stats:
                from hqtflow.quantize.convert import kv_cache_scales

                kv_cache_scales(model, kv_stats, job.method.default, target=job.target, fp8=cfg.fp8_config,
                                hp_dtype=cfg.hp_dtype)
        save_checkpoint(model, tmp, ignore=job.plan["ignore"], per_channel=per_channel,
                        static_input=not s.weight_only, kv_cache=bool(kv_stats), dynamic=dynamic,
                        carried_from=job.model_dir)
        copy_side_files(job.model_dir, tmp)
        return ArtifactKind.CHECKPOINT, _checkpoint_data(s, job, dynamic, tmp)
    return write


def plan_modules(model, cfg: QuantConfig, meas: Measurement, *, unfuse: bool = True, world_size: int = 1,
                 weight_only: bool = False) -> dict:
    """Which Linear modules get quantized; the rest are kept in high precision with a reason. Fused MoE experts of
    Mixtral's layout are unfused first (`hqtflow.quantize.experts`): each expert's `gate_up_proj` and `down_proj` is
    then a Linear like any other; an expert no calibration token reached keeps high precision, listed.
    `unfused`: the experts modules the converted model must unfuse (`_convert` does). `unfuse` False (INC scale
    files, which have no entry for them): fused experts are listed as kept. `meas`: one rank's of `world_size` (a
    row-parallel layer's per-channel statistics then cover its share of the inputs). `weight_only`: a measured node
    needs no input statistics (its scale comes from the weight)."""
    import numpy as np
    from torch import nn

    from hqtflow.measure.hooks import is_fused_experts, other_experts, unsupported
    from hqtflow.quantize.experts import unfuse_experts, why_not_unfused

    quantize, ignore, skipped, missing, experts = [], [], {}, [], []
    for name, mod in model.named_modules():
        if not is_fused_experts(mod):
            if other_experts(mod):  # experts of another layout (Nemotron-H's)
                skipped[name] = f"{unsupported(mod).removeprefix('its ')}: kept in high precision"
            continue
        if type(mod).__name__ in cfg.blocklist.types or cfg.blocklist.matches_name(name):
            skipped[name] = "excluded by blocklist"
        elif not unfuse:
            skipped[name] = "fused MoE experts: INC's scale files have no entry for them (INC on Gaudi runs MoE through its own modules)"
        elif why := why_not_unfused(mod):
            skipped[name] = f"{why}: kept in high precision"
        else:
            experts.append(name)
    unfuse_experts(model, experts)
    _check_expert_nodes(model, experts, meas)
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        expert = any(name.startswith(f"{c}.") for c in experts)
        if not cfg.selects(name, type(mod).__name__):
            ignore.append(name)
            skipped[name] = "excluded by allowlist/blocklist"
        elif name not in meas.nodes or not (meas.nodes[name].inputs or weight_only):
            if expert or cfg.ignore_modules_wo_measures:
                ignore.append(name)
                skipped[name] = _no_statistics(name, meas) if expert else "no statistics (ignore_modules_wo_measures)"
            else:
                missing.append(name)
        else:
            values = int(np.size(meas.nodes[name].inputs[0])) if meas.nodes[name].inputs else 1
            if values not in (1, mod.in_features, mod.in_features // world_size):
                raise ArtifactError(f"The measurement's input statistics of {name} have {values} values, but the layer "
                                    f"has {mod.in_features} inputs (per channel{', or a rank its share' * (world_size > 1)})"
                                    " or one tensor: the measurement was made on another model or is damaged.")
            quantize.append(name)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ArtifactError(f"The measurement has no input statistics for {shown}; re-measure, blocklist them, "
                            "or set ignore_modules_wo_measures (--weight-only needs none).")
    return {"quantize": quantize, "ignore": ignore, "skipped": skipped, "unfused": experts}


def _check_expert_nodes(model, experts: list[str], meas: Measurement) -> None:
    """A measurement's nodes of the unfused experts `experts` must fit them: no expert past the module's number."""
    import re

    for c in experts:
        count = model.get_submodule(c).num_experts
        pattern = re.compile(rf"^{re.escape(c)}\.(\d+)\.(gate_up_proj|down_proj)$")
        if past := sorted(int(m.group(1)) for node in meas.nodes if (m := pattern.match(node)) and int(m.group(1)) >= count):
            raise ArtifactError(f"The measurement has statistics for expert {past[0]} of {c}, which has {count} experts: "
                                "it was made on another model or is damaged.")


def _no_statistics(name: str, meas: Measurement) -> str:
    """Why an expert's projection has no statistics: no token reached the expert, or (its other projection has
    some, and the same tokens pass through both) it was not measured."""
    base, _, proj = name.rpartition(".")
    other = f"{base}.{'down_proj' if proj == 'gate_up_proj' else 'gate_up_proj'}"
    if other in meas.nodes and meas.nodes[other].inputs:
        return f"MoE expert projection without statistics (not measured; its {other.rpartition('.')[2]} was)"
    return "MoE expert without statistics (no calibration token was routed to it)"


def summary(out: Path) -> str:
    m = read_manifest(out, artifact_kind(out), verify=False)
    d = m.data
    what = "scale files" if m.type == ArtifactKind.SCALES else "FP8 checkpoint"
    notes = "".join(f"\nNote: {n}." for n in d.get("notes") or ())
    return (f"Wrote {out}: {what}, {d['scale_method']} for {d['target']}, {len(d['quantized'])} modules quantized, "
            f"{len(d['skipped'])} kept in high precision.{notes}")
