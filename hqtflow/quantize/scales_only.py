"""`quantize --scales-only`: each measured Linear's scales per rank, written as INC scale files
(`hqtflow.formats.scale_files` holds the layout)."""

from __future__ import annotations

from pathlib import Path

import torch

from hqtflow.errors import ArtifactError
from hqtflow.formats.measurement import copy_measurement_files, shard_span
from hqtflow.formats.quant_config import QuantConfig
from hqtflow.formats.scale_files import scale_entry, scale_stem, write_quant_config, write_scale_file
from hqtflow.scales import HP_DTYPES, ScaleRules, linear_scales


def _local_weight(w: torch.Tensor, layers: list[dict], name: str, rank: int) -> torch.Tensor:
    """The shard of a full weight that rank `rank` held, from the styles and shapes the measurement recorded
    (a packed weight, e.g. fused gate/up, holds its slice of each part)."""
    span = shard_span(layers, name, rank)
    if span is None:
        return w
    dim, offset, size = span
    parts = int(layers[rank][name].get("packed_parts", 1))
    return torch.cat([p.narrow(dim, offset // parts, size // parts) for p in w.chunk(parts, dim)], dim)


def write_scale_files(out: Path, final: Path, model, meas, cfg: QuantConfig, rules: ScaleRules, target: str) -> list[str]:
    """Write into `out` (a staging dir that becomes `final`). Each node gets the scales of its own method
    (`rules`, INC's per-node resolution); the files are named after the default method, as INC names them."""
    data = meas.manifest.data
    layers_by_rank = meas.layers
    if meas.world_size > 1 and not any(layers_by_rank):
        raise ArtifactError(f"{meas.directory} is a {meas.world_size}-rank import: HQT dumps do not record how each "
                            "weight was sharded, so per-rank scales cannot be computed; unify it to one rank first "
                            "(`hqtflow unify ... --parallel-plan FILE`) or measure with `hqtflow measure --tp`.")
    observer = data.get("observer") or cfg.observer
    dump = data.get("dump_stats_path") or cfg.dump_stats_path
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
            w = _local_weight(mod.weight.detach(), layers_by_rank, name, rank)
            sc = linear_scales(rules(name, type(mod).__name__), node.inputs[0], w, target=target, fp8=cfg.fp8_config,
                               hp_dtype=cfg.hp_dtype, name=name, store=HP_DTYPES[cfg.hp_dtype])  # as INC reads them
            nodes[name] = scale_entry(sc.input, sc.weight, sc.output, w.shape[1])
        local = rank if meas.world_size > 1 else None
        files += write_scale_file(out, scale_stem(dump, observer, rules.default.name, local, meas.world_size), nodes,
                                  local_rank=local)
    write_quant_config(out, final, cfg, Path(dump).name, target, observer, meas.ranks[0].nodes)
    return files
