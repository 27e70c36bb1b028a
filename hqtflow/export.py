"""`hqtflow export`: an hqtflow FP8 checkpoint (compressed-tensors) -> another runtime's FP8 layout.

- `fp8`: the AutoFP8 / vLLM `quant_method: fp8` layout. Per quantized Linear: `weight` float8_e4m3fn [out, in]
  (the same bytes), `weight_scale` float32 scalar (shape []), `input_scale` float32 scalar (static only);
  config.json `quantization_config = {"quant_method": "fp8", "activation_scheme": "static"|"dynamic",
  "ignored_layers": [...]}`. Per-tensor weights are exported exactly (the bf16 scale is exact in float32). A
  per-channel checkpoint is re-quantized to one scale per tensor (the largest channel scale), within FP8
  rounding. A weight-only checkpoint becomes `activation_scheme: dynamic` (vLLM then quantizes activations per
  tensor at run time: not weight-only any more; this is recorded in the manifest). KV-cache `k_scale`/`v_scale`
  are written only when the source has them (hqtflow checkpoints do not measure the KV cache yet).
  Fused projections: vLLM fuses q/k/v and gate/up into one GEMM and, when the shards' scales differ, takes the
  largest scale and re-quantizes the other shards (a small extra rounding); hqtflow keeps the modules separate,
  so every shard keeps its own scale here.
- `compressed-tensors`: the same layout hqtflow writes, with the weights re-targeted to per-channel
  (`--per-channel`: each output channel re-quantized with its own scale = channel maxabs / 448 of the
  dequantized weight) or back to per-tensor (scale = tensor maxabs / 448). Scales keep their dtype, rounded up
  so that nothing saturates.

- `inc`: Neural Compressor's `save(model, path, format="huggingface")` layout (neural-compressor-pt 3.10), as
  INC writes it for a model converted with `use_qdq=True` and `scale_format: scalar` (the only FP8 mode INC
  runs on CPU). Per quantized Linear: `weight` float8_e4m3fn TRANSPOSED to [in, out] (INC's PatchedLinear keeps
  `weight.t()`), `quant_input.scale` and `quant_input.scale_inv` (the static input scale and its inverse),
  `dequant_weights.scale` (the per-tensor weight scale), all 0-d tensors in the model's high-precision dtype.
  config.json `quantization_config` (and `quantization_config.json`, which INC also writes) is INC's
  `FP8Config.to_dict()` with `mode: LOAD`, `world_size: -1` (single device, as INC records it), `use_qdq: "True"`,
  the checkpoint's scale method and `blocklist.names` = the layers kept in high precision; INC's
  `load(OUT, format="huggingface", device="cpu"|"hpu")` rebuilds the model from it. Static W8A8 only (a
  weight-only checkpoint is refused); per-channel weights are re-quantized to one scale per tensor (INC's CPU
  path keeps per-tensor scales scalar) and the scale method is then recorded as `maxabs_arbitrary`.
  On Gaudi the QDQ config loads too (INC then runs quantize/dequantize ops around a bf16 GEMM); INC's native
  Gaudi layout (`use_qdq: False`: `scale_input`, `scale_weight`, `quant_input.scale_inv`, FP8 GEMM) cannot be
  produced or loaded by INC on CPU, so it is not written here. Gaudi2 holds float8_e4m3fn in +-240: load a
  checkpoint quantized for `--scales-for gaudi2` there (weights made for 448 would saturate).

The output also gets the tokenizer and generation config of the source and an `hqtflow.export` manifest.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from hqtflow.errors import ArtifactError, ConfigError, not_a_directory
from hqtflow.formats.artifact import (MANIFEST, ArtifactKind, read_checkpoint_manifest, read_manifest, staged_output,
                                     write_manifest)
from hqtflow.formats.checkpoint import (HP_DTYPE_NAMES, KV_SUFFIXES, autofp8_tensors, check_scales, copy_side_files,
                                        inc_tensors, load_checkpoint, read_tensors, requantize, write_safetensors)
from hqtflow.formats.compressed_tensors import autofp8_quantization_config, inc_quantization_config
from hqtflow.formats.hf_names import per_expert_containers

FORMATS = ("fp8", "compressed-tensors", "inc")
LOADABLE_FORMATS = ("fp8", "compressed-tensors")  # what hqtflow.load runs ("inc" is Neural Compressor's)


def _source_manifest(path: Path):
    """The manifest of an hqtflow checkpoint or of an earlier compressed-tensors export (checked), or None."""
    return read_checkpoint_manifest(path) if (path / MANIFEST).exists() else None


def _read_source(path: Path) -> tuple[dict, dict, dict[str, torch.Tensor], list[str]]:
    from hqtflow.formats.artifact import check_not_partial
    from hqtflow.formats.compressed_tensors import parse_quantization_config
    from hqtflow.models import load_config

    check_not_partial(path)
    if not (path / "config.json").is_file():
        from hqtflow.formats.artifact import checkpoint_without_config, kind_named

        kind = kind_named(path)
        if kind == "checkpoint":
            raise checkpoint_without_config(path)
        what = f"an hqtflow {kind} artifact" if kind else "not a checkpoint directory (no config.json)"
        raise ArtifactError(f"{path} is {what}; export reads an FP8 checkpoint (`hqtflow quantize` writes one).")
    _source_manifest(path)
    raw = load_config(path)
    qc = raw.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise ArtifactError(f"{path / 'config.json'}'s quantization_config is not an object ({type(qc).__name__}).")
    if qc.get("quant_method") != "compressed-tensors":
        raise ArtifactError(f"{path} is not a compressed-tensors FP8 checkpoint (quant_method {qc.get('quant_method')!r}).")
    parsed = parse_quantization_config(qc)
    if parsed.get("strategy", "channel" if parsed["per_channel"] else "tensor") not in ("tensor", "channel") or \
            parsed.get("activation", "static" if parsed["static_input"] else None) not in ("static", None):
        raise ArtifactError(f"{path} has block-wise weights or dynamic activations; export reads hqtflow's own "
                            "checkpoints (per-tensor or per-channel weights, static or no activation quantization).")
    tensors = read_tensors(path)
    if e5m2 := sorted(k for k, v in tensors.items() if v.dtype == torch.float8_e5m2):
        raise ArtifactError(f"{path} holds float8_e5m2 weights ({e5m2[0]}); the layouts export writes are E4M3.")
    check_scales(path, tensors)
    load_checkpoint(path, tensors=dict(tensors))  # the checks `generate` makes: tensors that fit config.json
    linears = sorted(k[: -len(".weight")] for k, v in tensors.items()
                     if k.endswith(".weight") and v.dtype == torch.float8_e4m3fn)
    if not linears:
        raise ArtifactError(f"{path} has no float8_e4m3fn weights.")
    return raw, parsed, tensors, linears


def export(checkpoint: str | Path, output: str | Path, *, fmt: str, per_channel: bool | None = None,
           overwrite: bool = False) -> Path:
    from hqtflow.formats.compressed_tensors import quantization_config

    checkpoint, output = Path(checkpoint), Path(output)
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not supported; valid values are {', '.join(FORMATS)}.")
    if not checkpoint.is_dir():
        raise ArtifactError(f"Checkpoint {checkpoint} {not_a_directory(checkpoint)}.")
    if fmt == "fp8" and per_channel:
        raise ConfigError("--per-channel applies to --format compressed-tensors; the fp8 (AutoFP8) layout has one scale per tensor.")
    if fmt == "inc" and per_channel is not None:
        raise ConfigError("--per-channel/--per-tensor apply to --format compressed-tensors; the inc layout has one scale per tensor.")
    from hqtflow.formats.artifact import check_output_dir

    check_output_dir(output, overwrite, [checkpoint])
    raw, parsed, tensors, linears = _read_source(checkpoint)
    src_pc, static = parsed["per_channel"], parsed["static_input"]
    ignore = parsed["ignore"]
    notes: list[str] = []
    experts = sorted(k for k in linears if re.search(r"\.experts\.\d+\.", k))
    if experts and fmt == "inc":
        raise ConfigError(f"{checkpoint} holds MoE experts quantized one by one ({experts[0]}); Neural Compressor's "
                          "huggingface loader has no module for them, so --format inc cannot write them (quantize "
                          "with the experts module's type in the config's blocklist types).")
    if per_expert_containers(tensors):
        notes.append("MoE experts are under hqtflow's own per-expert names (<experts>.<e>.gate_up_proj), which "
                     "hqtflow reads; vLLM and transformers expect the original checkpoint's names and do not")
    out_t: dict[str, torch.Tensor] = {}
    extra_files: dict[str, str] = {}
    if fmt == "inc":
        if not static:
            raise ConfigError(f"{checkpoint} is a weight-only checkpoint; --format inc writes INC's static W8A8 "
                              "layout, which needs an input scale per Linear.")
        out_t, requantized = inc_tensors(tensors, linears)
        src_m = _source_manifest(checkpoint)
        from_ck = src_m is not None and src_m.type == ArtifactKind.CHECKPOINT
        base = (src_m.raw.get("config") or {}) if from_ck else {}
        method = (src_m.data.get("scale_method") if from_ck else None) or "maxabs_arbitrary"
        if requantized:
            method = "maxabs_arbitrary"
            notes.append("per-channel weights re-quantized to one scale per tensor (maxabs / 448 of the dequantized "
                         "weight), scale_method recorded as maxabs_arbitrary")
        if any(k.endswith(KV_SUFFIXES) for k in tensors):
            notes.append("KV-cache scales dropped (INC's KV-cache layout is not written)")
        hp = tensors[f"{linears[0]}.weight_scale"].dtype
        if hp not in HP_DTYPE_NAMES:
            from hqtflow.choices import HP_DTYPES, valid_values

            raise ArtifactError(f"{checkpoint}: scales in {hp}; INC's hp_dtype is {valid_values(HP_DTYPES)}.")
        if from_ck and src_m.data.get("target") != "gaudi2":
            notes.append("weights use the full float8_e4m3fn range (448): for Gaudi2 (+-240) quantize with --scales-for gaudi2")
        qcfg = inc_quantization_config(scale_method=method, hp_dtype=HP_DTYPE_NAMES[hp], blocklist=ignore, base=base)
        extra_files["quantization_config.json"] = json.dumps(qcfg, indent=2)
        target_pc = False
    elif fmt == "fp8":
        out_t = autofp8_tensors(tensors, linears, static=static)
        notes.append("for vLLM (and hqtflow): transformers' `quant_method: fp8` loader expects block-wise scales and drops "
                     "these per-tensor ones (its logits are then wrong); for transformers export compressed-tensors")
        if src_pc:
            notes.append("per-channel weights re-quantized to one scale per tensor (largest channel scale)")
        if not static:
            notes.append("weight-only source exported as activation_scheme dynamic (vLLM quantizes activations per tensor at run time)")
        qcfg = autofp8_quantization_config(static=static, ignore=ignore,
                                           kv_cache=any(k.endswith(KV_SUFFIXES) for k in tensors))
        target_pc = False
    else:
        target_pc = src_pc if per_channel is None else per_channel
        out_t = dict(tensors)
        if target_pc != src_pc:
            for n in linears:
                out_t[f"{n}.weight"], out_t[f"{n}.weight_scale"] = requantize(tensors[f"{n}.weight"],
                                                                              tensors[f"{n}.weight_scale"], target_pc)
            notes.append(f"weights re-quantized from per-{'channel' if src_pc else 'tensor'} to "
                         f"per-{'channel' if target_pc else 'tensor'} scales (maxabs / 448 of the dequantized weight)")
        qcfg = quantization_config(per_channel=target_pc, static_input=static, ignore=ignore)
        if raw.get("quantization_config", {}).get("kv_cache_scheme"):
            qcfg["kv_cache_scheme"] = raw["quantization_config"]["kv_cache_scheme"]
    with staged_output(output, overwrite=overwrite, inputs=[checkpoint]) as tmp:
        write_safetensors(tmp / "model.safetensors", out_t)
        cfg = {**raw, "quantization_config": qcfg}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, text in extra_files.items():
            (tmp / name).write_text(text)
        copy_side_files(checkpoint, tmp)
        src_manifest = _source_manifest(checkpoint)
        write_manifest(tmp, ArtifactKind.EXPORT, model=src_manifest.model if src_manifest else None,
                       config={"format": fmt, "per_channel": target_pc},
                       data={"source": str(checkpoint.resolve()),
                             "source_digest": src_manifest.digest() if src_manifest else None,
                             "format": fmt, "activation": "static" if static else None,
                             "weights": "per-channel" if target_pc else "per-tensor",
                             "quantized": linears, "ignore": sorted(ignore), "notes": notes})
    return output


def summary(out: Path) -> str:
    d = read_manifest(out, ArtifactKind.EXPORT, verify=False).data
    extra = f" ({'; '.join(d['notes'])})" if d["notes"] else ""
    return f"Wrote {out}: {d['format']} layout, {len(d['quantized'])} FP8 Linear modules, {d['weights']} weights{extra}."
