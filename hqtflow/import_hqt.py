"""`hqtflow import-hqt`: wrap HQT / Neural Compressor measurement files made elsewhere (e.g. on Gaudi) into an
hqtflow measurement artifact, so `hqtflow quantize -m OUT` (and unify) read them with a manifest.

Only the JSON twins are parsed (`hqtflow.formats.hqt.read_measurement`); `.npz` files are pickles and are copied
byte for byte, never opened. Scale files (`*_hooks_maxabs_<SCALE_METHOD>[_r_W].json/.npz`) found beside the
measurement are copied too and listed in the manifest (`scale_files`), but not interpreted. The manifest says
`"provenance_known": false`: hqtflow did not see the calibration, so model, data and dtype are the user's word.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hqtflow.errors import ArtifactError
from hqtflow.formats import hqt
from hqtflow.formats.artifact import MANIFEST, ArtifactKind, check_not_partial, check_output_dir, staged_output, write_json_atomic, write_manifest

SCHEMA, SCHEMA_VERSION = ArtifactKind.MEASUREMENT, 1


def _scan(directory: Path) -> tuple[dict, list[Path]]:
    """{(base, observer, world): {rank: {ext: path}}} and the scale files."""
    groups: dict = {}
    scales = []
    for p in sorted(directory.iterdir()):
        if not p.is_file():
            continue
        f = hqt.parse_measurement_file(p.name)
        if f is not None:
            groups.setdefault((f.base, f.observer, f.world or 1), {}).setdefault(f.rank or 0, {})[f.ext] = p
        elif hqt.SCALE_FILE.match(p.name):
            scales.append(p)
    return groups, scales


def import_hqt(directory: str | Path, output: str | Path, *, model: str | None = None, dtype: str = "bf16",
               overwrite: bool = False) -> Path:
    directory, output = Path(directory), Path(output)
    if not directory.is_dir():
        raise ArtifactError(f"HQT measurement directory {directory} does not exist.")
    check_not_partial(directory)
    check_output_dir(output, overwrite, [directory])
    groups, scales = _scan(directory)
    if not groups:
        raise ArtifactError(f"{directory} holds no HQT/INC measurement files (*_hooks_maxabs[_<rank>_<world>].json).")
    if len(groups) > 1:
        shown = ", ".join(f"{b}_hooks_{o} ({w} rank(s))" for b, o, w in sorted(groups))
        raise ArtifactError(f"{directory} holds several measurements ({shown}); copy one of them into a directory of its own.")
    (base, observer, world), ranks = next(iter(groups.items()))
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        raise ArtifactError(f"{directory} is a {world}-rank measurement but rank(s) {', '.join(map(str, missing))} are missing.")
    extra = sorted(set(ranks) - set(range(world)))
    if extra:
        raise ArtifactError(f"{directory} has files for rank {extra[0]}, outside its world size {world}.")
    parsed = {}
    for r in range(world):
        if ".json" not in ranks[r]:
            raise ArtifactError(f"Rank {r} of {directory} has no measurement .json (an .npz alone is a pickle, which "
                                "hqtflow does not open); copy the JSON twin INC writes beside it.")
        meas = hqt.read_measurement(ranks[r][".json"])
        if meas.mode != "DynamicRange":
            raise ArtifactError(f"{ranks[r]['.json']} has Mode {meas.mode!r}; a measurement file has Mode 'DynamicRange'.")
        if not meas.nodes:
            raise ArtifactError(f"{ranks[r]['.json']} has no measured nodes.")
        parsed[r] = meas
    from hqtflow.unify import Source, check_same_run

    check_same_run(Source(directory, None, world, [ranks[r][".json"].name[:-5] for r in range(world)],
                          [parsed[r] for r in range(world)], [{} for _ in range(world)]))

    fp, model_dir = None, None
    if model is not None:
        from hqtflow import models

        model_dir = models.resolve_model(model)
        fp = models.fingerprint(model_dir)
        known = {n for n, _ in models.skeleton(model_dir).named_modules()}
        unknown = [n for n in parsed[0].nodes if n not in known and not re.search(r"\.\d+\.(gate_up_proj|down_proj)$", n)]
        if unknown:
            raise ArtifactError(f"Node {unknown[0]} of the measurement is not a module of {model_dir}; was it measured on another model?")

    with staged_output(output, overwrite=overwrite, inputs=[directory, model_dir]) as tmp:
        records = []
        for r in range(world):
            stem = hqt.measurement_stem(base, observer, r if world > 1 else None, world)
            files = []
            for ext in (".json", ".npz", "_mod_list.json"):
                if ext in ranks[r]:
                    shutil.copy2(ranks[r][ext], tmp / f"{stem}{ext}")
                    files.append(f"{stem}{ext}")
            records.append({"rank": r, "stem": stem, "files": files, "layers": {}, "unmeasured": [], "skipped": {},
                            "nodes": len(parsed[r].nodes), "num_samples": parsed[r].num_samples})
        scale_names = []
        for p in scales:
            shutil.copy2(p, tmp / p.name)
            scale_names.append(p.name)
        out = output.resolve()
        inc_cfg = {"mode": "QUANTIZE", "observer": observer, "scale_method": "maxabs_hw",
                   "dump_stats_path": str(out / base), "recalc_scales": True}
        write_json_atomic(tmp / "quant_config.json", inc_cfg)
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
            "calibration": {"sources": [], "samples": parsed[0].num_samples, "tokens": None},
        }
        if model_dir is not None:
            data["model_path"] = str(model_dir)
        write_manifest(tmp, SCHEMA, SCHEMA_VERSION, model=fp, config={"observer": observer, "dump_stats_path": base},
                       data=data)
    return output


def summary(out: Path) -> str:
    import json

    d = json.loads((Path(out) / MANIFEST).read_text())["data"]
    nodes = sum(r["nodes"] for r in d["ranks"])
    model = f", model {d['model_path']}" if d.get("model_path") else " (no model recorded: pass MODEL to quantize)"
    return f"Wrote {out}: {nodes} nodes over {d['world_size']} rank(s) imported{model}."
