"""INC scale files (the `hqtflow.scales` artifact, `quantize --scales-only`): written and read here.

Per rank, named and laid out as Neural Compressor writes them:
`<dump basename>_hooks_<observer>_<SCALE_METHOD>[_<rank>_<world>].json` (+ `.npz`, which INC reads), `"Mode": "Scale"`,
each node `{"inputs": [s_in], "outputs": [s_in * s_w], "params": {"weight": s_w}}`; a per-channel weight scale is
`{"0": [per output channel], "1": [ones per input channel]}` (int keys 0/1 in the `.npz`, as INC reads them). The
measurement files are copied beside them, and `quant_config.json` (INC's QUANTIZE config) points at the directory,
so a W-card Gaudi run loads them through INC as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hqtflow.errors import ArtifactError
from hqtflow.formats.artifact import write_json_atomic
from hqtflow.formats.measurement import INC_CONFIG, rank_suffix

# A scale's bounds: every scale method floors its scales at the smallest normal number of its dtype (float32's at the
# least), and a scale past f32max / 57344 (E5M2's largest value) overflows float32 when dequantizing.
MIN_SCALE = float(np.finfo(np.float32).tiny)
MAX_SCALE = float(np.finfo(np.float32).max) / 57344.0


def scale_stem(dump_stats_path: str, observer: str, method_name: str, rank: int | None, world: int) -> str:
    return f"{Path(dump_stats_path).name}_hooks_{observer}_{method_name.upper()}{rank_suffix(rank, world)}"


def scale_entry(input_scale, weight_scale, output_scale, in_features: int) -> dict:
    """One node's entry from its scales (tensors): per-tensor floats, or INC's per-channel `{"0": ..., "1": ...}`."""
    if weight_scale.numel() > 1:
        w = {"0": weight_scale.float().tolist(), "1": [1.0] * in_features}
        out = output_scale.float().tolist()
    else:
        w, out = float(weight_scale), float(output_scale)
    return {"inputs": [float(input_scale)], "outputs": [out], "params": {"weight": w}}


def write_scale_file(directory: Path, stem: str, nodes: dict[str, dict], *, local_rank: int | None) -> list[str]:
    """`<stem>.json` and `<stem>.npz` (INC's pickled dict) of one rank's entries; returns the names."""
    header = {"GlobalRank": None, "LocalRank": local_rank, "Mode": "Scale"}
    (Path(directory) / f"{stem}.json").write_text(json.dumps({**header, "Nodes": nodes}, indent=4))
    np.savez(Path(directory) / f"{stem}.npz", {**header, "Nodes": _to_numpy(nodes)})
    return [f"{stem}.json", f"{stem}.npz"]


def read_scale_file(path: Path) -> dict[str, dict]:
    """A scale file's entries, from its JSON twin (never the `.npz`); anything else is one ArtifactError."""
    try:
        raw = json.loads(Path(path).read_text())
        nodes, mode = raw["Nodes"], raw.get("Mode")
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        raise ArtifactError(f"{path} is not an INC scale file (unreadable JSON or no 'Nodes').") from None
    if mode != "Scale" or not isinstance(nodes, dict) or not all(isinstance(n, dict) for n in nodes.values()):
        raise ArtifactError(f"{path} is not an INC scale file (Mode {mode!r}, or its nodes are not objects).")
    if not nodes:
        raise ArtifactError(f"{path} holds no scales; it is corrupt.")
    for name, node in nodes.items():
        if (problem := node_problem(node)) is not None:
            raise ArtifactError(f"{path}: node {name[:80]!r} {problem}; the file is corrupt.")
    return nodes


def _numbers(v) -> list | None:
    """A scale (a number) or a list of them as a list; None for anything else (strings and booleans included)."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if number(v):
        return [v]
    return list(v) if isinstance(v, list) and all(number(x) for x in v) else None


def node_problem(node: dict) -> str | None:
    """Why a node is not as `scale_entry` writes it, or None: `inputs` a list of scales; `outputs` a list of scales or
    of per-channel lists; `params.weight` a scale or INC's per-channel {"0": [...], "1": [...]}; every scale a number
    in [MIN_SCALE, MAX_SCALE]."""
    params = node.get("params", {})
    if set(node) - {"inputs", "outputs", "params"} or not isinstance(params, dict) or set(params) - {"weight"}:
        return "has fields a scale file does not have"
    groups = [node.get("inputs", []), *node.get("outputs", [])] if isinstance(node.get("outputs", []), list) else [None]
    weight = params.get("weight", [])
    if isinstance(weight, dict):
        groups += [weight.get("0"), weight.get("1")] if set(weight) == {"0", "1"} else [None]
    else:
        groups.append(weight)
    values = [_numbers(g) for g in groups]
    if any(v is None for v in values) or not isinstance(node.get("inputs", []), list):
        return "has a scale that is not a number or a list of numbers"
    bad = [x for v in values for x in v if not MIN_SCALE <= x <= MAX_SCALE]  # NaN fails both
    if bad:
        return f"has a scale of {bad[0]!r}, outside [{MIN_SCALE:.3g}, {MAX_SCALE:.3g}] (no scale method makes one)"
    return None


def is_scale_file(path: Path) -> bool:
    """Whether a `.json` holds scales (Mode 'Scale') rather than a measurement."""
    try:
        return json.loads(Path(path).read_text()).get("Mode") == "Scale"
    except (OSError, ValueError, RecursionError, AttributeError):
        return False


def write_quant_config(out: Path, final: Path, cfg, base: str, target: str, observer: str, nodes) -> None:
    """INC's QUANTIZE config (from a `QuantConfig`) for the scales artifact `final`, being written in `out`.

    `observer` is the measurement's: INC builds every file name from it (`<base>_hooks_<observer>...`), so the
    QUANTIZE config's own observer (maxabs by default) would send INC to files that are not there. `nodes`: the
    measurement's node names; with none of optimum-habana's attention nodes among them (a measurement made here, on
    Hugging Face modeling code) `ignore_modules_wo_measures` is set, or INC on Gaudi would replace those unmeasured
    modules by ones that fail when called."""
    from hqtflow.formats.measurement import gaudi_only
    from hqtflow.formats.quant_config import fitted_to_measurement, for_inc

    config = {**cfg.to_dict(), "mode": "QUANTIZE", "dump_stats_path": str(Path(final).resolve() / base)}
    inc = for_inc(fitted_to_measurement(config, observer, bool(gaudi_only(nodes)))[0])[0]
    if target == "cpu":
        inc["use_qdq"] = True  # INC refuses the CPU device without QDQ
    write_json_atomic(Path(out) / INC_CONFIG, inc)


def _to_numpy(nodes: dict) -> dict:
    def conv(v):
        if isinstance(v, dict):  # INC reads per-channel keys as ints 0/1 from the .npz
            return {(int(k) if isinstance(k, str) and k.isdigit() else k): conv(x) for k, x in v.items()}
        if isinstance(v, list) and v and isinstance(v[0], (list, dict)):
            return [conv(x) for x in v]
        return np.asarray(v, dtype=np.float32)

    return {k: {kk: ([conv(x) for x in vv] if isinstance(vv, list) else conv(vv)) for kk, vv in n.items()} for k, n in nodes.items()}
