"""`hqtflow import-hqt`: wrap HQT / Neural Compressor measurement files made elsewhere (e.g. on Gaudi) into an
hqtflow measurement artifact, so `hqtflow quantize -m OUT` (and unify) read them with a manifest.

This is the only door for foreign dumps: `quantize`, `unify`, `inspect` and `handoff` read artifacts only. The JSON
twins are parsed (`hqtflow.formats.measurement.read_dump`); `.npz` files are pickles and are never opened nor copied:
each rank's `.npz` (which INC reads) is written afresh from the statistics parsed and checked here, as `measure`
writes it, and foreign scale `.npz` files are left out. With `--trust-pickle` the `.npz` files are copied byte for
byte, and a rank with no JSON twin has its `.npz` unpickled once, here, and its JSON twin written into the artifact, so
no later stage ever opens a pickle. `--world-size` picks one measurement when the directory holds several (e.g.
8-rank and 2-rank files side by side). Ranks that disagree
(NumSamples, node sets) are refused as `unify` refuses them; `--force` imports them anyway, recorded in `forced`. Scale files (`*_hooks_maxabs_<SCALE_METHOD>[_r_W].json/.npz`) found beside the
measurement are copied too (their `.npz` only with `--trust-pickle`) and listed in the manifest (`scale_files`), but
not interpreted. The manifest says
`"provenance_known": false`: hqtflow did not see the calibration, so model, data and dtype are the user's word.
optimum-habana's Gaudi-only attention nodes (`measurement.GAUDI_ONLY_NODES`: matmul_qk, k_cache, ...) are no module of
the Hugging Face model: `--model` accepts them inside one of its modules, and they are kept (INC on Gaudi reads
them) with a note that hqtflow does not use them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hqtflow.errors import ArtifactError, ConfigError, not_a_directory
from hqtflow.formats import measurement as mf
from hqtflow.formats.artifact import ArtifactKind, check_not_partial, check_output_dir, read_manifest, staged_output


def import_hqt(directory: str | Path, output: str | Path, *, model: str | None = None, dtype: str = "bf16",
               overwrite: bool = False, trust_pickle: bool = False, world_size: int | None = None,
               force: bool = False) -> Path:
    directory, output = Path(directory), Path(output)
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, not {world_size}.")
    from hqtflow.choices import parse_dtype

    parse_dtype(dtype, auto=False)
    if not directory.is_dir():
        raise ArtifactError(f"HQT measurement directory {directory} {not_a_directory(directory)}.")
    check_not_partial(directory)
    check_output_dir(output, overwrite, [directory])
    meas = mf.read_dump(directory, trust_pickle=trust_pickle, world_size=world_size)  # an .npz only with trust_pickle
    world = meas.world_size
    for st, r in zip(meas.stems, meas.ranks):
        mf.require_dynamic_range(r, f"{directory / st}.json")
        if not r.nodes:
            raise ArtifactError(f"{directory / st}.json has no measured nodes.")
    from hqtflow.unify import check_same_run

    forced = check_same_run(meas, force=force)

    fp, model_dir = None, None
    if model is not None:
        from hqtflow import models

        model_dir = models.resolve_model(model)
        fp = models.fingerprint(model_dir)
        known = _node_names(models.skeleton(model_dir))
        for r, rank in enumerate(meas.ranks):
            gaudi = {n for n in mf.gaudi_only(rank.nodes) if n.rpartition(".")[0] in known}  # in a module of ours
            unknown = [n for n in rank.nodes if n not in known and n not in gaudi]
            if unknown:
                raise ArtifactError(f"Node {unknown[0]} of rank {r} of the measurement is not a module of {model_dir}; "
                                    "was it measured on another model?")

    base, observer = meas.base, meas.observer
    with staged_output(output, overwrite=overwrite, inputs=[directory, model_dir]) as tmp:
        stems = [mf.measurement_stem(base, observer, r if world > 1 else None, world) for r in range(world)]
        records = []
        for r, stem in enumerate(stems):
            copied = mf.RANK_FILES if trust_pickle else (".json", "_mod_list.json")  # a foreign .npz: an unchecked pickle
            files = mf.copy_measurement_files(directory, meas.stems[r:r + 1], tmp, [stem], suffixes=copied)
            fresh = tuple(t for t in mf.RANK_FILES if f"{stem}{t}" not in files)
            if fresh:  # every rank file not copied, as `measure` writes it, from the statistics read and checked here:
                # the JSON twin stages read (from its .npz, --trust-pickle), the .npz and module list INC reads
                js = mf.write_measurement(tmp, stem, meas.ranks[r].nodes, local_rank=meas.ranks[r].local_rank,
                                          num_samples=meas.ranks[r].num_samples, twins=fresh)
                files = sorted({*files, *(p.name for p in js)})
            records.append({"rank": r, "stem": stem, "files": files, "layers": {}, "unmeasured": [], "skipped": {},
                            "nodes": len(meas.ranks[r].nodes), "num_samples": meas.ranks[r].num_samples})
        scale_names = []
        for p in mf.scan_dump(directory).scale_files:
            if p.suffix == ".npz" and not trust_pickle:  # a pickle nothing here checks: left out
                continue
            shutil.copy2(p, tmp / p.name)
            scale_names.append(p.name)
        data = {
            "world_size": world,
            "observer": observer,
            "dump_stats_path": base,
            "statistics_dtype": "unknown (INC keeps statistics in hp_dtype)",
            "model_dtype": dtype,
            "ranks": records,
            "scale_files": scale_names,
            "imported_from": str(directory.resolve()),
            "provenance_known": False,
            "forced": forced,  # what --force overrode (empty: the ranks agreed)
            "calibration": {"sources": [], "samples": meas.ranks[0].num_samples, "tokens": None},
            "notes": mf.gaudi_only_note(meas.ranks[0].nodes),
        }
        if model_dir is not None:
            data["model_path"] = os.path.abspath(model_dir)
        mf.write_artifact(tmp, output, base=base, inc_config={"observer": observer, "scale_method": "maxabs_hw"},
                          model=fp, config={"observer": observer, "dump_stats_path": base}, data=data)
    return output


def _node_names(model) -> set[str]:
    """The node names a measurement of `model` can hold: its modules, and `<experts>.<e>.gate_up_proj|down_proj` for
    each expert e of its fused-experts modules (as `measure` names them)."""
    from hqtflow.measure.hooks import is_fused_experts

    names = set()
    for name, mod in model.named_modules():
        names.add(name)
        if is_fused_experts(mod):
            names |= {f"{name}.{e}.{p}" for e in range(mod.gate_up_proj.shape[0]) for p in ("gate_up_proj", "down_proj")}
    return names


def summary(out: Path) -> str:
    d = read_manifest(out, ArtifactKind.MEASUREMENT, verify=False).data
    nodes = sum(r["nodes"] for r in d["ranks"])
    model = f", model {d['model_path']}" if d.get("model_path") else " (no model recorded: pass MODEL to quantize)"
    notes = "".join(f"\nNote: {n}." for n in d.get("notes") or ())
    return f"Wrote {out}: {nodes} nodes over {d['world_size']} rank(s) imported{model}.{notes}"
