"""INC scale files (`--scales-only`): per rank, named and laid out as Neural Compressor writes them.

`<dump basename>_hooks_<observer>_<SCALE_METHOD>[_<rank>_<world>].json` (+ `.npz` for INC), `"Mode": "Scale"`,
each node `{"inputs": [s_in], "outputs": [s_in * s_w], "params": {"weight": s_w}}`; a per-channel weight scale is
`{"0": [per output channel], "1": [ones per input channel]}` (int keys 0/1 in the `.npz`, as INC reads them). The measurement files are copied beside them and a
QUANT_CONFIG pointing at the directory is written, so a W-card Gaudi run loads them through INC as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hqtflow.config import QuantConfig
from hqtflow.errors import ArtifactError
from hqtflow.formats.artifact import write_json_atomic
from hqtflow.formats.measurement import INC_CONFIG, copy_measurement_files, rank_suffix
from hqtflow.scales import ScaleRules, linear_scales


def scale_stem(dump_stats_path: str, observer: str, method_name: str, rank: int | None, world: int) -> str:
    return f"{Path(dump_stats_path).name}_hooks_{observer}_{method_name.upper()}{rank_suffix(rank, world)}"


def _local_weight(w: torch.Tensor, info: dict | None, rank: int, world: int) -> torch.Tensor:
    """The shard of a full weight that rank `rank` held, from the style the measurement recorded."""
    if world == 1 or info is None or info.get("style") in (None, "replicated"):
        return w
    shape = info["weight_shape"]
    dim = {"column": 0, "row": 1}[info["style"]]
    return w.narrow(dim, rank * shape[dim], shape[dim])


def _node_scales(sc, weight: torch.Tensor) -> dict:
    s_in = float(sc.input)
    if sc.weight.numel() > 1:
        w = {"0": sc.weight.float().tolist(), "1": [1.0] * weight.shape[1]}
        out = (sc.input.float() * sc.weight.float()).tolist()
    else:
        w = float(sc.weight)
        out = float(sc.output)
    return {"inputs": [s_in], "outputs": [out], "params": {"weight": w}}


def write_scale_files(out: Path, final: Path, model, meas, cfg: QuantConfig, rules: ScaleRules, target: str) -> list[str]:
    """Write into `out` (a staging dir that becomes `final`). Each node gets the scales of its own method
    (`rules`, INC's per-node resolution); the files are named after the default method, as INC names them."""
    method = rules.default
    layers_by_rank = [r["layers"] for r in meas.manifest.data["ranks"]] if meas.manifest else [None] * len(meas.ranks)
    if meas.world_size > 1 and meas.manifest is None:
        raise ArtifactError("Scales for a multi-rank foreign dump need to know how each weight was sharded; "
                            "import it with an hqtflow manifest or unify it first.")
    method_name = method.name if method.name != "custom" else "custom"
    observer = (meas.manifest.data.get("observer") if meas.manifest else None) or cfg.observer
    dump = (meas.manifest.data.get("dump_stats_path") if meas.manifest else None) or cfg.dump_stats_path
    files = copy_measurement_files(meas.directory, meas.stems, out)
    for rank, (rm, layers) in enumerate(zip(meas.ranks, layers_by_rank)):
        nodes = {}
        for name, node in rm.nodes.items():
            try:
                mod = model.get_submodule(name)
            except AttributeError:
                continue  # e.g. per-expert nodes of fused MoE weights: no Linear to quantize
            if not hasattr(mod, "weight") or not node.inputs or not cfg.selects(name, type(mod).__name__):
                continue
            w = _local_weight(mod.weight.detach(), (layers or {}).get(name), rank, meas.world_size)
            sc = linear_scales(rules(name, type(mod).__name__), node.inputs[0], w, target=target, fp8=cfg.fp8_config,
                               hp_dtype=cfg.hp_dtype)
            nodes[name] = _node_scales(sc, w)
        stem = scale_stem(dump, observer, method_name, rank if meas.world_size > 1 else None, meas.world_size)
        header = {"GlobalRank": None, "LocalRank": rank if meas.world_size > 1 else None, "Mode": "Scale"}
        (out / f"{stem}.json").write_text(json.dumps({**header, "Nodes": nodes}, indent=4))
        np.savez(out / f"{stem}.npz", {**header, "Nodes": _to_numpy(nodes)})
        files += [f"{stem}.json", f"{stem}.npz"]
    write_quant_config(out, final, cfg, Path(dump).name, target)
    return files


def write_quant_config(out: Path, final: Path, cfg: QuantConfig, base: str, target: str) -> None:
    """INC's QUANTIZE config for the scales artifact `final` (being written in `out`), pointing at its files."""
    inc = {**cfg.to_dict(), "mode": "QUANTIZE", "dump_stats_path": str(Path(final).resolve() / base)}
    if target in ("cpu", "cuda"):
        inc.pop("device_for_scales", None)
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
