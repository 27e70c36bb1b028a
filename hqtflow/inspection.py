"""`hqtflow inspect`: what a measurement, scales or checkpoint artifact says about each layer, in numbers.

Artifacts are read through their manifest (`read_manifest`, hashes checked) and their JSON / safetensors files; an
`.npz` is never unpickled. The report (a dict, see `inspect_artifact`) has these parts, each with simple rules:

- coverage: modules measured / quantized, and those that were not, with the reason the manifest records
  (`ranks[].skipped` and `ranks[].unmeasured` of a measurement, `data.skipped` of a checkpoint or scales artifact).
- ranges: the top-N layers by input and by output maxabs. A layer is an **outlier** when its maxabs is more than
  `OUTLIER_FACTOR` (8) times the median maxabs of the layers of its kind (kind = the last name component, e.g.
  `down_proj`), computed separately for inputs, outputs and weights. Multi-rank statistics are merged by max.
- scales (all in the FP8 format's full scale F: 448 for E4M3, 240 on Gaudi2):
  * measurement: the per-tensor scale `maxabs_pow2` would give (`hqtflow.scales`, backoff 0.25 activations, 0.5
    weights) is flagged `tiny` below 2^-20 (a statistic near zero: a dead or never-fed layer), `zero` when the
    statistic is 0, and `huge` above 2^7 (beyond the largest Gaudi3 hardware scale).
  * checkpoint / scales: headroom = input_scale * F / measured input maxabs (the measured maxabs comes from the
    source measurement of a checkpoint, or the measurement files copied into a scales artifact). headroom < 1: the
    scale **saturates** (measured activations clip); headroom > 2^10: it is so wide that activations near the
    measured maxabs use less than 1/1024 of the FP8 range (**underflow** risk). If the measurement is gone or does
    not match the recorded digest, this check is skipped and the report says so.
  * checkpoint weights: occupancy = max|q| / F of the FP8 weight (the dequantized max is occupancy * F * scale),
    zero fraction = share of FP8 weights that are exactly 0, and the smallest normal value 2^-6 * scale. A weight is
    flagged **underflow** when occupancy < 1/256 or more than half of its FP8 values are 0.
- weight error: relative RMS error ||W - dq(q(W))|| / ||W|| and SQNR (dB, = -20 log10 rel RMS) per layer, against
  the bf16 source model (`data.model_path`, loaded with `hqtflow.models.load_model`; one whose weights are only
  pickles only with `--trust-pickle`); for a scales artifact the weight is quantized with its scale. If the source
  model is unavailable or refused the report says so.
- compare (`--compare OTHER`, same artifact kind): per node the ratio OTHER / ARTIFACT of each statistic (input,
  output, weight maxabs for measurements; input and weight scales otherwise), nodes only in one, and the largest
  changes by |log2 ratio|.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from statistics import median
from typing import Any

from hqtflow.errors import ArtifactError, ConfigError, HqtflowError, InspectError  # noqa: F401 - InspectError re-exported (it lived here)
from hqtflow.formats.artifact import ArtifactKind, write_json_atomic, write_text_atomic

MEASUREMENT, SCALES, CHECKPOINT = ArtifactKind.MEASUREMENT, ArtifactKind.SCALES, ArtifactKind.CHECKPOINT
KINDS = {MEASUREMENT: "measurement", SCALES: "scales", CHECKPOINT: "checkpoint"}
OUTLIER_FACTOR = 8.0
TINY_SCALE, HUGE_SCALE = 2.0**-20, 2.0**7
SATURATE_BELOW, WIDE_ABOVE = 1.0, 2.0**10
WEIGHT_OCCUPANCY_MIN, WEIGHT_ZERO_MAX = 1 / 256, 0.5

RULES = {
    "outlier": f"maxabs > {OUTLIER_FACTOR:g} x the median maxabs of layers of the same kind (last name component)",
    "measurement_scale": "maxabs_pow2 per-tensor scale < 2^-20 (tiny), == 0 (zero) or > 2^7 (huge)",
    "activation_headroom": "input_scale * F / measured input maxabs < 1 (saturates) or > 2^10 (underflow risk)",
    "weight_underflow": "max|q| / F < 1/256 or more than 50% of FP8 weights are 0",
    "weight_error": "relative RMS ||W - dq(q(W))|| / ||W||; SQNR dB = -20 log10(relative RMS)",
}


# ---- reading -------------------------------------------------------------------------------------
def _artifact_type(directory: Path) -> str:
    from hqtflow.formats.artifact import artifact_kind
    from hqtflow.formats.measurement import refuse_foreign_dump

    refuse_foreign_dump(directory)  # a Gaudi dump: the import-hqt command that brings it in
    t = artifact_kind(directory)
    if t not in KINDS:
        raise InspectError(f"{directory} holds a {t!r} artifact; inspect reads {', '.join(KINDS)}.")
    return t


def _is_tune(directory) -> bool:
    from hqtflow.formats.artifact import artifact_kind

    try:
        return artifact_kind(directory) == ArtifactKind.TUNE
    except ArtifactError:
        return False  # _artifact_type says what is wrong


def _fmax(a) -> float:
    import numpy as np

    return float(np.max(np.abs(np.asarray(a, dtype=np.float64)))) if np.size(a) else float("nan")


def _merge(dst: dict, name: str, key: str, value: float) -> None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return
    node = dst.setdefault(name, {})
    node[key] = max(node.get(key, value), value)


def _stats_from_hqt(meas_list) -> dict[str, dict]:
    """{name: {input, output, weight}} maxabs, merged over ranks by max."""
    out: dict[str, dict] = {}
    for m in meas_list:
        for name, n in m.nodes.items():
            out.setdefault(name, {})
            if n.inputs:
                _merge(out, name, "input", max(_fmax(a) for a in n.inputs))
            if n.outputs:
                _merge(out, name, "output", max(_fmax(a) for a in n.outputs))
            if "weight" in n.params:
                _merge(out, name, "weight", _fmax(n.params["weight"]))
    return out


def _measurement_view(meas) -> dict:
    """What the report shows of a measurement (`hqtflow.formats.measurement.LoadedMeasurement`)."""
    m = meas.manifest
    stats = _stats_from_hqt(meas.ranks)
    types = {}
    skipped, unmeasured = {}, {}
    for r in meas.records:  # what the manifest says about each rank (read as far as it has the expected shape)
        for name, info in _obj(_obj(r).get("layers")).items():
            types[name] = _obj(info).get("type")
        skipped.update(_obj(_obj(r).get("skipped")))
        for name in _obj(r).get("unmeasured") if isinstance(_obj(r).get("unmeasured"), list) else []:
            unmeasured[str(name)] = "registered but never called during calibration (no statistics)"
    cal = _obj(_obj(m.data if m else {}).get("calibration"))
    return {"manifest": m, "stats": stats, "types": types, "skipped": skipped, "unmeasured": unmeasured,
            "world_size": meas.world_size, "samples": cal.get("samples"), "tokens": cal.get("tokens")}


def _obj(x) -> dict:
    """`x` when it is a JSON object, else {} (a manifest edited by hand)."""
    return x if isinstance(x, dict) else {}


def _scale_value(v) -> float:
    """A scale file entry: a number, [number], or a per-channel {"0": [...], "1": [...]} (max of "0")."""
    if isinstance(v, dict):
        v = v.get("0", [])
    return _fmax(v)


def _load_scales(directory: Path) -> dict:
    from hqtflow.formats.artifact import confined, read_manifest
    from hqtflow.formats.measurement import read_measurement
    from hqtflow.formats.scale_files import is_scale_file, read_scale_file
    from hqtflow.scales import full_scale

    m = read_manifest(directory, SCALES)
    d = m.data
    scales: dict[str, dict] = {}
    weight_scales: dict[str, list] = {}
    meas = []
    for rel in d.get("files") or []:
        if not rel.endswith(".json") or rel.endswith("_mod_list.json"):
            continue
        path = confined(Path(directory), rel)
        if not is_scale_file(path):
            meas.append(read_measurement(path))
            continue
        for name, n in read_scale_file(path).items():  # (checked there: every scale a number in range)
            inputs = [_scale_value(x) for x in n.get("inputs") or []]
            w = (n.get("params") or {}).get("weight")
            weight = None if w is None else _scale_value(w)
            if inputs:
                _merge(scales, name, "input_scale", max(inputs))
            if weight is not None:
                _merge(scales, name, "weight_scale", weight)
                weight_scales.setdefault(name, []).append(w)
    F = full_scale(d.get("fp8", "E4M3"), d.get("target", "cpu"))
    return {"manifest": m, "scales": scales, "raw_weight_scales": weight_scales,
            "measured": _stats_from_hqt(meas) if meas else None, "full_scale": F, "skipped": d.get("skipped") or {},
            "quantized": d.get("quantized") or sorted(scales)}


def _checkpoint_tensors(directory: Path) -> dict[str, dict]:
    """{layer: {weight, weight_scale, input_scale}} read from the safetensors files (torch tensors); scales checked
    as the loader checks them (positive, finite, per tensor or per output channel)."""
    from hqtflow.formats.checkpoint import check_scales, read_tensors, skeleton_of

    tensors = read_tensors(directory)
    check_scales(directory, tensors)
    from hqtflow.formats.hf_names import to_model_names

    tensors = to_model_names(skeleton_of(directory), tensors, str(directory))  # MoE experts: measurement names
    layers: dict[str, dict] = {}
    for key, t in tensors.items():
        for suffix in ("weight_scale", "input_scale", "weight"):
            if key.endswith("." + suffix):
                layers.setdefault(key[: -len(suffix) - 1], {})[suffix] = t
                break
    layers = {k: v for k, v in layers.items() if "weight_scale" in v and "weight" in v}
    for name, t in layers.items():
        if t["weight_scale"].numel() not in (1, t["weight"].shape[0]):
            raise ArtifactError(f"{directory}: {name}.weight_scale has shape {list(t['weight_scale'].shape)} for a weight of "
                                f"shape {list(t['weight'].shape)}; inspect reads per-tensor and per-channel scales.")
    return layers


# ---- analysis ------------------------------------------------------------------------------------
def _kind(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _outliers(values: dict[str, float], stat: str) -> list[dict]:
    by_kind: dict[str, list[float]] = {}
    for n, v in values.items():
        by_kind.setdefault(_kind(n), []).append(v)
    meds = {k: median(v) for k, v in by_kind.items()}
    out = []
    for n, v in values.items():
        med = meds[_kind(n)]
        if med > 0 and v > OUTLIER_FACTOR * med:
            out.append({"name": n, "stat": stat, "maxabs": v, "kind_median": med, "ratio": v / med})
    return sorted(out, key=lambda r: -r["ratio"])


def _top(values: dict[str, float], n: int) -> list[dict]:
    return [{"name": k, "maxabs": v} for k, v in sorted(values.items(), key=lambda kv: -kv[1])[:n]]


def _ranges(stats: dict[str, dict], top: int) -> dict:
    res: dict[str, Any] = {"outliers": []}
    for stat in ("input", "output", "weight"):
        vals = {n: s[stat] for n, s in stats.items() if stat in s}
        res[f"top_{stat}"] = _top(vals, top)
        res["outliers"] += _outliers(vals, stat)
    return res


def _pow2_flags(stats: dict[str, dict]) -> tuple[dict[str, dict], list[dict]]:
    import torch

    from hqtflow.scales import apply_rounding, full_scale, scale_method

    method = scale_method("maxabs_pow2")
    implied, flags = {}, []
    for name, s in stats.items():
        row = {}
        for stat, rule in (("input", method.activation), ("output", method.activation), ("weight", method.weight)):
            if stat not in s:
                continue
            # the pow2 scale the statistic implies before hqtflow's floor (`scales.floored`): near-zero shows as tiny
            raw = torch.tensor(s[stat]).to(torch.bfloat16) / (full_scale() * rule.backoff)
            sc = float(apply_rounding(raw, rule.rounding, "cpu")) if s[stat] > 0 else 0.0
            row[stat] = sc
            why = "zero" if sc == 0 else "tiny" if sc < TINY_SCALE else "huge" if sc > HUGE_SCALE else None
            if why:
                flags.append({"name": name, "stat": stat, "maxabs": s[stat], "scale": sc, "flag": why})
        implied[name] = row
    return implied, flags


def _headroom(scales: dict[str, dict], measured: dict[str, dict] | None, F: float) -> list[dict]:
    rows = []
    for name, s in scales.items():
        if "input_scale" not in s or not measured or "input" not in measured.get(name, {}):
            continue
        mx = measured[name]["input"]
        head = s["input_scale"] * F / mx if mx > 0 else float("inf")
        flag = "saturates" if head < SATURATE_BELOW else "underflow" if head > WIDE_ABOVE else None
        rows.append({"name": name, "input_scale": s["input_scale"], "representable_max": s["input_scale"] * F,
                     "measured_maxabs": mx, "headroom": head, "flag": flag})
    return rows


def _weight_stats(q, scale, F: float) -> dict:
    import torch

    qa = q.float().abs()
    occ = float(qa.max()) / F
    zero = float((qa == 0).float().mean())
    s = float(scale.float().max())
    flag = "underflow" if occ < WEIGHT_OCCUPANCY_MIN or zero > WEIGHT_ZERO_MAX else None
    dq_max = float((q.float() * scale.float().reshape(-1, 1) if scale.numel() > 1 else q.float() * scale.float()).abs().max())
    return {"weight_scale": s, "occupancy": occ, "zero_fraction": zero, "dequantized_max": dq_max,
            "smallest_normal": 2.0**-6 * float(scale.float().min()), "per_channel": scale.numel() > 1, "flag": flag,
            "dtype": str(q.dtype).replace("torch.", "") if isinstance(q, torch.Tensor) else None}


def _err(w, wq) -> dict:
    w, wq = w.float(), wq.float()
    num = float((w - wq).pow(2).sum().sqrt())
    den = float(w.pow(2).sum().sqrt())
    rel = num / den if den > 0 else float("nan")
    return {"rel_rms": rel, "sqnr_db": -20 * math.log10(rel) if rel > 0 else float("inf")}


def _source_model(data: dict, fp: dict | None, dtype: str = "bf16", trust_pickle: bool = False):
    """(model, note): the bf16 source model, or None and why not (`trust_pickle`: load one whose weights are only
    pickles, models.load_model)."""
    path = data.get("model_path")
    if not path or not Path(path).is_dir():
        return None, f"source model {path or '(not recorded)'} is unavailable; weight error not computed"
    from hqtflow import models

    try:
        if fp and fp.get("id") and not models.same_model(fp, models.fingerprint(Path(path))):
            return None, f"source model {path} has changed since quantization (fingerprint differs); weight error not computed"
        from hqtflow.quantize.experts import unfuse_experts

        model = models.load_model(Path(path), dtype, trust_pickle=trust_pickle)
        unfuse_experts(model)  # MoE experts by the names the checkpoint gives them (`<experts>.<e>.gate_up_proj`)
        return model, f"weight error against {path}"
    except HqtflowError as e:
        return None, f"source model {path} could not be loaded ({e}); weight error not computed"
    except Exception as e:  # a broken folder: report, do not crash the inspection
        return None, f"source model {path} could not be loaded ({type(e).__name__}); weight error not computed"


def _source_weight(model, name: str):
    try:
        return model.get_submodule(name).weight.detach()
    except AttributeError:
        return None


# ---- the three kinds -----------------------------------------------------------------------------
def _inspect_measurement(directory: Path, top: int, trust_pickle: bool = False) -> dict:
    from hqtflow.formats.measurement import load_measurement

    meas = load_measurement(directory)
    ld = _measurement_view(meas)
    hessians = meas.manifest.data.get("hessians") if meas.manifest is not None else None
    hessians = hessians if isinstance(hessians, dict) else {}
    stats = ld["stats"]
    implied, flags = _pow2_flags(stats)
    measured = sorted(n for n, s in stats.items() if "input" in s or "output" in s)
    not_measured = {**ld["skipped"], **ld["unmeasured"]}
    for n, s in stats.items():
        if n not in measured and n not in not_measured:
            not_measured[n] = "node present but without activation statistics"
    layers = [{"name": n, "type": ld["types"].get(n), **{f"{k}_maxabs": v for k, v in stats[n].items()},
               **{f"{k}_scale_pow2": v for k, v in implied[n].items()}} for n in stats]
    return {
        "kind": "measurement",
        "summary": {"nodes": len(stats), "nodes_measured": len(measured), "nodes_not_measured": len(not_measured),
                    "world_size": ld["world_size"], "samples": ld["samples"], "tokens": ld["tokens"],
                    "hessians": f"{hessians['matrices']} matrices for {hessians['modules']} Linears (quantize --gptq)"
                    if hessians.get("matrices") else "none (measure --hessians for quantize --gptq)",
                    "outliers": 0, "flagged_scales": len(flags)},
        "coverage": {"measured": measured, "not_measured": not_measured},
        "ranges": _ranges(stats, top),
        "scales": {"method": "maxabs_pow2", "flags": flags},
        "layers": layers,
        "_compare_stats": {n: {k: v for k, v in s.items()} for n, s in stats.items()},
    }


def _inspect_checkpoint(directory: Path, top: int, trust_pickle: bool = False) -> dict:
    from hqtflow.formats.artifact import read_manifest
    from hqtflow.scales import full_scale

    from hqtflow.formats.checkpoint import quantization_scheme

    m = read_manifest(directory, CHECKPOINT)
    quantization_scheme(directory)  # a scheme generate and export refuse is refused here too
    d = m.data
    F = full_scale(d.get("fp8", "E4M3"), "cpu")  # compressed-tensors checkpoints are float8_e4m3fn
    tensors = _checkpoint_tensors(directory)
    notes = []
    measured = None
    src = d.get("source_measurement")
    if not src or not Path(src).is_dir():
        notes.append(f"source measurement {src or '(not recorded)'} is gone; saturation check against measured maxabs skipped")
    else:
        from hqtflow.formats.measurement import load_measurement

        try:
            sm = load_measurement(src)
            if d.get("source_digest") and sm.digest() != d["source_digest"]:
                notes.append(f"source measurement {src} changed since quantization; saturation check skipped")
            else:
                measured = _measurement_view(sm)["stats"]
        except HqtflowError as e:
            notes.append(f"source measurement {src} is unusable ({e}); saturation check skipped")
    scales = {n: {"weight_scale": float(t["weight_scale"].float().max()),
                  **({"input_scale": float(t["input_scale"].float().max())} if "input_scale" in t else {})}
              for n, t in tensors.items()}
    weights = {n: _weight_stats(t["weight"], t["weight_scale"], F) for n, t in tensors.items()}
    from hqtflow.formats.checkpoint import HP_DTYPE_NAMES

    dtype = HP_DTYPE_NAMES.get(next(iter(tensors.values()))["weight_scale"].dtype, "bf16") if tensors else "bf16"
    model, note = _source_model(d, m.model, dtype, trust_pickle)
    notes.append(note)
    errors = {}
    if model is not None:
        import torch

        from hqtflow.scales import dequantize

        for n, t in tensors.items():
            w = _source_weight(model, n)
            if w is None or tuple(w.shape) != tuple(t["weight"].shape):
                continue
            s = t["weight_scale"]
            errors[n] = _err(w, dequantize(t["weight"], s.reshape(-1, 1) if s.numel() > 1 else s, torch.float32))
    return _scaled_report("checkpoint", d, scales, measured, F, top, notes, weights, errors, model is not None,
                          quantized=sorted(tensors))


def _inspect_scales(directory: Path, top: int, trust_pickle: bool = False) -> dict:
    ld = _load_scales(directory)
    d = ld["manifest"].data
    notes = []
    if ld["measured"] is None:
        notes.append("no measurement files in the artifact; saturation check against measured maxabs skipped")
    world = d.get("world_size") or 1
    if world > 1:  # each rank's scales are of its own weight shard: no whole weight to compare with
        model, note = None, f"weight error not computed: the scales of a {world}-rank artifact are per weight shard"
    else:
        model, note = _source_model(d, ld["manifest"].model, "bf16", trust_pickle)
    notes.append(note)
    errors = {}
    if model is not None:
        import torch

        from hqtflow.scales import dequantize, quantize

        fp8 = d.get("fp8", "E4M3")
        for n, ws in ld["raw_weight_scales"].items():
            w = _source_weight(model, n)
            if w is None:
                continue
            s = ws[0]
            st = torch.tensor(s["0"], dtype=torch.float32).reshape(-1, 1) if isinstance(s, dict) else \
                torch.tensor(_scale_value(s), dtype=torch.float32)
            if st.numel() > 1 and st.shape[0] != w.shape[0]:
                continue
            errors[n] = _err(w, dequantize(quantize(w, st, fp8, ld["full_scale"]), st, torch.float32))
    return _scaled_report("scales", d, ld["scales"], ld["measured"], ld["full_scale"], top, notes, {}, errors,
                          model is not None, quantized=sorted(ld["scales"]))


def _scaled_report(kind, d, scales, measured, F, top, notes, weights, errors, have_model, quantized) -> dict:
    if d.get("weight_rounding") == "gptq" and errors:
        notes = [*notes, "weights rounded by GPTQ: each weight's own error is larger than round-to-nearest's by design "
                         "(GPTQ makes each layer's output error small, not each weight's)"]
    head = _headroom(scales, measured, F)
    hflags = [r for r in head if r["flag"]]
    wflags = [{"name": n, **w} for n, w in weights.items() if w["flag"]]
    hmap = {r["name"]: r for r in head}
    layers = []
    for n in sorted(scales):
        row = {"name": n, **scales[n]}
        if n in hmap:
            row.update(measured_input_maxabs=hmap[n]["measured_maxabs"], headroom=hmap[n]["headroom"],
                       headroom_flag=hmap[n]["flag"])
        if n in weights:
            row.update({f"w_{k}": v for k, v in weights[n].items() if k != "weight_scale"})
        if n in errors:
            row.update(errors[n])
        layers.append(row)
    ranges = _ranges(measured, top) if measured else {"top_input": [], "top_output": [], "top_weight": [], "outliers": []}
    err_rows = sorted(({"name": n, **e} for n, e in errors.items()), key=lambda r: -r["rel_rms"] if not math.isnan(r["rel_rms"]) else 0)
    return {
        "kind": kind,
        "summary": {"nodes_quantized": len(quantized), "nodes_not_quantized": len(d.get("skipped") or {}),
                    "scale_method": d.get("scale_method"), "target": d.get("target"), "fp8": d.get("fp8"),
                    "full_scale": F, "mode": d.get("mode"), "weight_rounding": d.get("weight_rounding", "nearest"),
                    "outliers": 0, "saturating": len([r for r in hflags if r["flag"] == "saturates"]),
                    "activation_underflow": len([r for r in hflags if r["flag"] == "underflow"]),
                    "weight_underflow": len(wflags),
                    "worst_sqnr_db": min((e["sqnr_db"] for e in errors.values()), default=None)},
        "coverage": {"quantized": quantized, "not_quantized": dict(d.get("skipped") or {})},
        "ranges": ranges,
        "scales": {"measured_maxabs_available": measured is not None, "headroom_flags": hflags, "weight_flags": wflags},
        "weight_error": {"available": have_model, "layers": err_rows},
        "layers": layers,
        "notes": notes,
        "_compare_stats": {n: dict(s) for n, s in scales.items()},
    }


# ---- compare -------------------------------------------------------------------------------------
def _compare(a: dict, b: dict, top: int) -> dict:
    sa, sb = a["_compare_stats"], b["_compare_stats"]
    rows, changes = [], []
    for n in sorted(set(sa) & set(sb)):
        row = {"name": n}
        for k in sorted(set(sa[n]) & set(sb[n])):
            va, vb = sa[n][k], sb[n][k]
            r = vb / va if va > 0 else (1.0 if vb == 0 else float("inf"))
            row[k] = {"this": va, "other": vb, "ratio": r}
            if r > 0 and math.isfinite(r):
                changes.append({"name": n, "stat": k, "this": va, "other": vb, "ratio": r, "log2_ratio": math.log2(r)})
            else:
                changes.append({"name": n, "stat": k, "this": va, "other": vb, "ratio": r, "log2_ratio": float("inf")})
        rows.append(row)
    changes.sort(key=lambda c: -abs(c["log2_ratio"]))
    ranges = {}  # stat -> [smallest, largest] finite ratio over the common nodes
    for c in changes:
        if math.isfinite(c["log2_ratio"]):
            lo, hi = ranges.get(c["stat"], (c["ratio"], c["ratio"]))
            ranges[c["stat"]] = [min(lo, c["ratio"]), max(hi, c["ratio"])]
    return {"common": len(rows), "only_in_this": sorted(set(sa) - set(sb)), "only_in_other": sorted(set(sb) - set(sa)),
            "ratio_ranges": dict(sorted(ranges.items())), "largest_changes": changes[:top], "nodes": rows}


# ---- entry point ---------------------------------------------------------------------------------
def inspect_artifact(path: str | Path, *, compare: str | Path | None = None, top: int = 10,
                     trust_pickle: bool = False) -> dict:
    """The whole report as a JSON-serialisable dict (no files written); `trust_pickle`: load a source model whose
    weights are only pickles (for the weight error; without it such a model is left out with a note)."""
    if top < 1:
        raise ConfigError(f"--top must be at least 1, not {top}.")
    path = Path(path)
    t = _artifact_type(path)
    if compare is not None:
        tc = _artifact_type(Path(compare))
        if tc != t:
            raise InspectError(f"Cannot compare {path} ({KINDS[t]}) with {compare} ({KINDS[tc]}): both must be the same kind.")
    fn = {MEASUREMENT: _inspect_measurement, SCALES: _inspect_scales, CHECKPOINT: _inspect_checkpoint}[t]
    rep = fn(path, top, trust_pickle)
    rep["summary"]["outliers"] = len(rep["ranges"]["outliers"])
    rep = {"artifact": str(path.resolve()), **rep, "rules": RULES}
    if compare is not None:
        other = fn(Path(compare), top, trust_pickle)
        rep["compare"] = {"other": str(Path(compare).resolve()), **_compare(rep, other, top)}
    rep.pop("_compare_stats", None)
    rep.setdefault("notes", [])
    return _clean(rep)


def _clean(x):
    """JSON-safe: non-finite floats become strings ('inf', 'nan')."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


# ---- terminal ------------------------------------------------------------------------------------
def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(rows: list[dict], cols: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def render_text(rep: dict) -> str:
    out = [f"{rep['kind']} artifact {rep['artifact']}", ""]
    out += [f"  {k}: {_fmt(v)}" for k, v in rep["summary"].items()]
    cov = rep["coverage"]
    missing = cov.get("not_measured", cov.get("not_quantized", {}))
    out += ["", f"Not {'measured' if rep['kind'] == 'measurement' else 'quantized'} ({len(missing)}):"]
    out += [f"  {n}: {why}" for n, why in missing.items()] or ["  (none)"]
    rg = rep["ranges"]
    for stat in ("input", "output"):
        if rg.get(f"top_{stat}"):
            out += ["", f"Largest {stat} maxabs:", table(rg[f"top_{stat}"], ["name", "maxabs"])]
    out += ["", f"Outliers ({RULES['outlier']}):"]
    out += [table(rg["outliers"], ["name", "stat", "maxabs", "kind_median", "ratio"])] if rg["outliers"] else ["  (none)"]
    sc = rep["scales"]
    if rep["kind"] == "measurement":
        out += ["", f"Scale flags ({RULES['measurement_scale']}):"]
        out += [table(sc["flags"], ["name", "stat", "maxabs", "scale", "flag"])] if sc["flags"] else ["  (none)"]
    else:
        out += ["", f"Activation headroom flags ({RULES['activation_headroom']}):"]
        if not sc["measured_maxabs_available"]:
            out += ["  (skipped: no measured maxabs)"]
        else:
            out += [table(sc["headroom_flags"], ["name", "input_scale", "measured_maxabs", "headroom", "flag"])] \
                if sc["headroom_flags"] else ["  (none)"]
        if rep["kind"] == "checkpoint":
            out += ["", f"Weight underflow flags ({RULES['weight_underflow']}):"]
            out += [table(sc["weight_flags"], ["name", "weight_scale", "occupancy", "zero_fraction", "flag"])] \
                if sc["weight_flags"] else ["  (none)"]
        we = rep["weight_error"]
        out += ["", "Weight quantization error (worst first):"]
        out += [table(we["layers"][: max(10, len(rg.get("top_input", [])))], ["name", "rel_rms", "sqnr_db"])] \
            if we["available"] and we["layers"] else ["  (not computed: see the Note below)"]
    if "compare" in rep:
        c = rep["compare"]
        out += ["", f"Compared with {c['other']}: {c['common']} common nodes, {len(c['only_in_this'])} only here, "
                    f"{len(c['only_in_other'])} only there."]
        out += [f"  only here: {n}" for n in c["only_in_this"]] + [f"  only there: {n}" for n in c["only_in_other"]]
        if c["ratio_ranges"]:
            out.append("Ratios (other / this): " + ", ".join(
                f"{k} equal" if lo == hi == 1 else f"{k} {lo:.3f}-{hi:.3f}" for k, (lo, hi) in c["ratio_ranges"].items()))
        if c["largest_changes"]:
            out += ["Largest changes (other / this):", table(c["largest_changes"], ["name", "stat", "this", "other", "ratio"])]
    for n in rep.get("notes", []):
        out.append(f"Note: {n}")
    return "\n".join(out)


def _earlier_report(path: Path, html: bool) -> bool:
    """Whether `path` is a report an earlier `hqtflow inspect` wrote (the only existing file --json / --html replace)."""
    try:
        if not path.is_file() or path.is_symlink():
            return False
        if html:
            from hqtflow.report_html import HTML_HEAD

            with open(path, "rb") as f:
                return f.read(256).startswith(HTML_HEAD.encode())
        if path.stat().st_size > 256 << 20:
            return False
        rep = json.loads(path.read_text())
        return isinstance(rep, dict) and {"artifact", "kind"} <= rep.keys()
    except (OSError, ValueError):
        return False


def _check_writable(path: Path | None, inputs=(), html: bool = False) -> None:
    if path is None:
        return
    if os.path.lexists(path) and not _earlier_report(Path(path), html):
        raise ArtifactError(f"Cannot write {path}: it exists and is not an earlier hqtflow inspect report; remove it or "
                            "pick another path.")
    for i in inputs:
        if i is not None and Path(path).resolve().is_relative_to(Path(i).resolve()):
            raise ArtifactError(f"Cannot write {path}: it lies inside the inspected artifact {i}, which is never modified.")
    from hqtflow.formats.artifact import why_unwritable

    parent = Path(path).parent if str(Path(path).parent) else Path(".")
    if not parent.is_dir():
        raise ArtifactError(f"Cannot write {path}: its directory {parent} does not exist.")
    if why := why_unwritable(parent):
        raise ArtifactError(f"Cannot write {path}: its directory {parent} is not writable ({why}).")
    if Path(path).is_dir():
        raise ArtifactError(f"Cannot write {path}: it is a directory.")


def run_inspect(artifact, *, compare=None, json_path=None, html_path=None, top: int = 10, trust_pickle: bool = False) -> str:
    """Build the report, write --json / --html (only after everything succeeded), return the terminal text."""
    if _is_tune(artifact):  # `hqtflow tune` output: its sensitivity chart
        if compare is not None or html_path is not None:
            raise ConfigError("A tune artifact is shown as its sensitivity chart (and --json); --compare and --html do not apply.")
        from hqtflow.tune import sensitivity_chart

        _check_writable(json_path, (artifact,))
        rep, text = sensitivity_chart(artifact, top=max(top, 1))
        if json_path is not None:
            write_json_atomic(Path(json_path), _clean(rep))
        return text
    _check_writable(json_path, (artifact, compare))
    _check_writable(html_path, (artifact, compare), html=True)
    rep = inspect_artifact(artifact, compare=compare, top=top, trust_pickle=trust_pickle)
    html = None
    if html_path is not None:
        from hqtflow.report_html import render_html

        html = render_html(rep)
    if json_path is not None:
        write_json_atomic(Path(json_path), rep)
    if html is not None:
        write_text_atomic(Path(html_path), html)
    return render_text(rep)
