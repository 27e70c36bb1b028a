"""The measurement artifact (`hqtflow.measurement`: measure, unify, import-hqt): its files, written and read here.

Per rank, HQT / Neural Compressor's files, named and laid out exactly as INC writes them:
`<dump_stats_path>_hooks_<observer>[_<rank>_<world>]` + `.json` (canonical, what hqtflow reads), `.npz` (INC's
QUANTIZE reads it; it is `np.savez(path, dict)`, a pickled object array, so hqtflow writes it but reads one only
in `import-hqt --trust-pickle`) and `_mod_list.json`. Each per-tensor statistic is the observer's (1, 1)
state as nested lists; per-channel statistics are (C, 1). Beside them: `kv_cache_maxabs.json` (hqtflow's KV-cache
statistics, one rank), `hessians.safetensors` (GPTQ's statistics with `--hessians`; `formats/hessians.py`),
`quant_config.json` (INC's QUANTIZE config pointing at the files) and the manifest, last.

`load_measurement` is the one reader of artifacts (through the manifest); a foreign dump (no manifest) is read by its
file names (`read_dump`) only by `import-hqt`, which wraps it into an artifact.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hqtflow.errors import ArtifactError, not_a_directory, not_a_file
from hqtflow.formats import APPLEDOUBLE
from hqtflow.formats.artifact import (MANIFEST, ArtifactKind, Manifest, check_not_partial, read_manifest,
                                      sha256_file, verified_bytes, verify_files, whole, write_json_atomic,
                                      write_manifest)

FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass
class NodeStats:
    """One observed module: maxabs of each input, each output (if measured) and each parameter."""

    inputs: list[np.ndarray] = field(default_factory=list)
    outputs: list[np.ndarray] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)

    def to_json(self) -> dict:
        d: dict = {"inputs": [a.tolist() for a in self.inputs]}
        if self.outputs:
            d["outputs"] = [a.tolist() for a in self.outputs]
        if self.params:
            d["params"] = {k: v.tolist() for k, v in self.params.items()}
        return d

    def to_numpy(self) -> dict:
        d: dict = {"inputs": list(self.inputs)}
        if self.outputs:
            d["outputs"] = list(self.outputs)
        if self.params:
            d["params"] = dict(self.params)
        return d

    @classmethod
    def from_json(cls, d: dict, *, where: str, name: str = "") -> NodeStats:
        """A node of a measurement file; the legacy keys `input`/`output` read as `inputs`/`outputs` (INC's
        `fix_fields`), any other key is refused (INC's ModuleConfig refuses it too)."""
        if not isinstance(d, dict):
            raise ArtifactError(f"{where}: node {name} is not an object.")
        for old, new in (("input", "inputs"), ("output", "outputs")):
            if old in d:
                if new in d:
                    raise ArtifactError(f"{where}: node {name} has both '{old}' and its current spelling '{new}'.")
                d = {**{k: v for k, v in d.items() if k != old}, new: d[old]}
        unknown = sorted(set(d) - {"inputs", "outputs", "params"})
        if unknown:
            raise ArtifactError(f"{where}: node {name} has the unknown key(s) {', '.join(map(repr, unknown))}; a node "
                                "holds inputs, outputs and params.")
        try:
            return cls(
                inputs=[_array(x, "input") for x in d.get("inputs", [])],
                outputs=[_array(x, "output") for x in d.get("outputs", [])],
                params={k: _array(v, "weight") for k, v in d.get("params", {}).items()},
            )
        except StatisticOverflow as e:
            kind, value = e.args
            raise ArtifactError(f"{where}: module {name} holds the {kind} statistic {value:.3g}, beyond float32's "
                                f"range ({FLOAT32_MAX:.3g}) and so any model dtype's; re-measure it.") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(f"{where} has a malformed node ({e}).") from None


NODE_NAME = re.compile(r"^[\w\-]+(\.[\w\-]+)*$")  # a module path: never `..`, `/` or empty parts


def check_statistics(meas: "Measurement", where: str) -> None:
    """One rule for every statistic read or made: finite and non-negative (a maxabs), named by its node."""
    for name, node in meas.nodes.items():
        for kind, arrays in (("input", node.inputs), ("output", node.outputs), ("weight", list(node.params.values()))):
            for a in arrays:
                if not np.isfinite(a).all():
                    raise ArtifactError(f"{where}: module {name} has a non-finite {kind} statistic (NaN or inf); re-measure it.")
                if (a < 0).any():
                    raise ArtifactError(f"{where}: module {name} has a negative {kind} statistic ({float(a.min())}), "
                                        "which no maxabs can be; the file is corrupt.")


def _array(x, kind: str) -> np.ndarray:
    if np.asarray(x).dtype.kind not in "iuf":  # strings, booleans, ragged lists: numpy would turn "3.4" into 3.4
        raise ValueError("a statistic holds something other than numbers")
    wide = np.asarray(x, dtype=np.float64)
    if wide.ndim != 2:
        raise ValueError(f"expected a 2-D statistic, got shape {wide.shape}")
    with np.errstate(over="ignore"):
        a = wide.astype(np.float32)
    big = np.isfinite(wide) & ~np.isfinite(a)
    if big.any():  # finite in the file (1e39), inf in float32: not the "NaN or inf" check_statistics refuses
        raise StatisticOverflow(kind, float(wide[big][0]))
    return a


class StatisticOverflow(ValueError):
    """A finite statistic beyond float32's range (the dtype statistics are kept in): `NodeStats.from_json` names it."""


def rank_suffix(rank: int | None, world_size: int) -> str:
    """INC's per-rank suffix: `_<local_rank>_<world_size>`, none for a single process."""
    return "" if rank is None or world_size <= 1 else f"_{rank}_{world_size}"


def measurement_stem(dump_stats_path: str, observer: str, rank: int | None, world_size: int) -> str:
    """File stem (without extension) INC uses for a measurement: `measure_hooks_maxabs_0_8`."""
    return f"{Path(dump_stats_path).name}_hooks_{observer}{rank_suffix(rank, world_size)}"


# The one reading of measurement_stem's names (+ an extension): the inverse of the function above. Scale files
# (`..._hooks_maxabs_MAXABS_HW_0_2.json`) do not match.
MEASUREMENT_FILE = re.compile(r"^(?P<base>.+)_hooks_(?P<obs>maxabs(?:_per_channel)?)(?:_(?P<r>\d+)_(?P<w>\d+))?"
                              r"(?P<ext>\.json|\.npz|_mod_list\.json)$")


# INC's scale files: the measurement stem + `_<SCALE_METHOD>` (upper case) before the rank suffix.
SCALE_FILE = re.compile(r"^.+_hooks_maxabs(?:_per_channel)?_[A-Z0-9_]*[A-Z][A-Z0-9_]*?(?:_\d+_\d+)?\.(json|npz)$")


@dataclass(frozen=True)
class MeasurementFile:
    """A measurement file's name, parsed: `<base>_hooks_<observer>[_<rank>_<world>]<ext>`."""

    base: str
    observer: str
    rank: int | None
    world: int | None
    ext: str

    @property
    def stem(self) -> str:
        return f"{self.base}_hooks_{self.observer}" + ("" if self.rank is None else f"_{self.rank}_{self.world}")


def parse_measurement_file(name: str) -> MeasurementFile | None:
    """The parts of a measurement file name, or None for any other file (scale files included)."""
    m = MEASUREMENT_FILE.match(name)
    if m is None:
        return None
    rank, world = (int(m["r"]), int(m["w"])) if m["r"] is not None else (None, None)
    return MeasurementFile(m["base"], m["obs"], rank, world, m["ext"])


RANK_FILES = (".json", ".npz", "_mod_list.json")  # what INC writes per rank, after the stem


def write_measurement(
    directory: Path,
    stem: str,
    nodes: dict[str, NodeStats],
    *,
    local_rank: int | None,
    num_samples: int,
    twins: tuple[str, ...] = RANK_FILES,
) -> list[Path]:
    """Write `<stem>.json`, `<stem>.npz` and `<stem>_mod_list.json` (those of them in `twins`); return their paths."""
    directory = Path(directory)
    header = {"GlobalRank": None, "LocalRank": local_rank, "Mode": "DynamicRange"}
    if num_samples > 0:
        header = {"NumSamples": num_samples, **header}
    out = []
    if ".json" in twins:
        out.append(directory / f"{stem}.json")
        out[-1].write_text(json.dumps({**header, "Nodes": {k: v.to_json() for k, v in nodes.items()}}, indent=4))
    if ".npz" in twins:
        out.append(directory / f"{stem}.npz")
        np.savez(out[-1], {**header, "Nodes": {k: v.to_numpy() for k, v in nodes.items()}})
    if "_mod_list.json" in twins:
        out.append(directory / f"{stem}_mod_list.json")
        out[-1].write_text(json.dumps(list(nodes), indent=4))
    return out


def copy_measurement_files(directory: Path, stems: list[str], out: Path, new_stems: list[str] | None = None,
                           suffixes: tuple[str, ...] = RANK_FILES) -> list[str]:
    """Copy each rank's `.json`, `.npz` and `_mod_list.json` (those of `suffixes` that exist) from `directory` into
    `out`, renamed to `new_stems` if given; return the new names."""
    import shutil

    names = []
    for st, new in zip(stems, new_stems or stems):
        for suffix in suffixes:
            p = Path(directory) / f"{st}{suffix}"
            if p.exists():
                shutil.copy2(p, Path(out) / f"{new}{suffix}")
                names.append(f"{new}{suffix}")
    return names


@dataclass
class Measurement:
    """A parsed measurement JSON file."""

    nodes: dict[str, NodeStats]
    local_rank: int | None
    num_samples: int
    mode: str


def read_measurement(path: Path, data: bytes | None = None) -> Measurement:
    """Read a measurement `.json` (never the pickled `.npz`); `data`: its bytes, already read (artifact.verified_bytes)."""
    path = Path(path)
    if data is None and not path.is_file():
        raise ArtifactError(f"Measurement file {path} {not_a_file(path)}.")
    try:
        raw = json.loads(path.read_bytes() if data is None else data)
        nodes = raw["Nodes"]
        mode = raw.get("Mode", "DynamicRange")
    except (ValueError, RecursionError, KeyError, TypeError):
        raise ArtifactError(f"{path} is not an HQT measurement file (corrupt JSON or no 'Nodes').") from None
    if not isinstance(nodes, dict) or not isinstance(raw, dict):
        raise ArtifactError(f"{path} is not an HQT measurement file ('Nodes' is not an object).")
    bad = next((k for k in nodes if not NODE_NAME.match(k)), None)
    if bad is not None:
        raise ArtifactError(f"{path} has a node named {bad!r}, which is not a module name; the file is corrupt or hostile.")
    samples = raw.get("NumSamples", 0)
    if not whole(samples):
        raise ArtifactError(f"{path} has NumSamples {samples!r}, not a whole number.")
    if samples < 0:
        raise ArtifactError(f"{path} has NumSamples {samples}; a count of samples cannot be negative.")
    meas = Measurement(
        nodes={k: NodeStats.from_json(v, where=str(path), name=k) for k, v in nodes.items()},
        local_rank=raw.get("LocalRank"),
        num_samples=samples,
        mode=mode,
    )
    check_statistics(meas, str(path))
    return meas


# The attention nodes HQT observes on Gaudi in optimum-habana's models (GaudiLlamaAttention & co.: its Matmul, KVCache
# and ModuleFusedSDPA children) that no Hugging Face model has: kept in artifacts (INC on Gaudi reads them), unused here.
GAUDI_ONLY_NODES = ("matmul_qk", "matmul_av", "k_cache", "v_cache", "fused_scaled_dot_product_attention",
                    "fused_scaled_dot_product_attention_distributed")


def gaudi_only(nodes) -> list[str]:
    """The nodes among `nodes` named like optimum-habana's Gaudi-only attention nodes (GAUDI_ONLY_NODES)."""
    return [n for n in nodes if n.rpartition(".")[2] in GAUDI_ONLY_NODES]


def gaudi_only_note(nodes) -> list[str]:
    """The note (none, or one) saying that the Gaudi-only nodes among `nodes` are kept but not used by hqtflow."""
    found = gaudi_only(nodes)
    if not found:
        return []
    kinds = ", ".join(k for k in GAUDI_ONLY_NODES if any(n.rsplit(".", 1)[-1] == k for n in found))
    return [f"{len(found)} Gaudi-only node(s) ({kinds}) are kept for INC on Gaudi but not used by hqtflow's runtime"]


def require_dynamic_range(meas: Measurement, where: str) -> None:
    """A measurement file has Mode 'DynamicRange' (a scale file, Mode 'Scale', is not one)."""
    if meas.mode != "DynamicRange":
        raise ArtifactError(f"{where} has Mode {meas.mode!r}; a measurement file has Mode 'DynamicRange'.")


def _read_npz(path: Path) -> Measurement:
    """Only with --trust-pickle: INC's np.savez of a dict is a pickled object array. Opting in runs the pickle;
    whatever it holds, a result that is not INC's measurement dict is one clean error."""
    try:
        d = np.load(path, allow_pickle=True)["arr_0"].item()  # the user opted in with --trust-pickle
        as_lists = lambda v: {k: as_lists(x) for k, x in v.items()} if isinstance(v, dict) else (
            [as_lists(x) for x in v] if isinstance(v, (list, tuple)) else np.asarray(v).tolist())
        nodes = {k: NodeStats.from_json(as_lists(n), where=str(path), name=k) for k, n in d["Nodes"].items()}
        meas = Measurement(nodes, d.get("LocalRank"), int(d.get("NumSamples", 0)), d.get("Mode", "DynamicRange"))
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a foreign pickle holds
        raise ArtifactError(f"{path} is not an INC measurement .npz ({type(e).__name__}: {e}).") from None
    bad = next((k for k in meas.nodes if not NODE_NAME.match(str(k))), None)
    if bad is not None:
        raise ArtifactError(f"{path} has a node named {bad!r}, which is not a module name.")
    check_statistics(meas, str(path))
    return meas


# ---- KV-cache statistics (hqtflow's own file; one rank) -------------------------------------------
KV_FILE = "kv_cache_maxabs.json"
KV_FORMAT = "hqtflow-kv-maxabs"


def write_kv_stats(directory: Path, layers: dict[str, dict[str, float]]) -> Path:
    """`layers`: {attention module: {"k": maxabs of its cached keys (after rotary), "v": of its values}}."""
    path = Path(directory) / KV_FILE
    write_json_atomic(path, {"format": KV_FORMAT, "version": 1,
                             "statistic": "maxabs of cached keys (after rotary) and values", "layers": layers})
    return path



def read_kv_stats(path: Path, data: bytes) -> dict[str, dict[str, float]]:
    """{attention module: {"k": maxabs, "v": maxabs}} from a KV_FILE's bytes (`path` names it)."""
    import math

    try:
        data = json.loads(data)
        ok = data.get("format") == KV_FORMAT and data.get("version") == 1 and isinstance(data["layers"], dict)
    except (ValueError, RecursionError, AttributeError, KeyError):
        ok, data = False, {}
    if not ok:
        raise ArtifactError(f"{path} is not a KV-cache statistics file this hqtflow reads (format "
                            f"{data.get('format') if isinstance(data, dict) else None!r}, "
                            f"version {data.get('version') if isinstance(data, dict) else None}).")
    for name, kv in data["layers"].items():
        vals = [kv.get(x) if isinstance(kv, dict) else None for x in "kv"]
        if not all(type(v) in (int, float) and math.isfinite(v) and abs(v) <= FLOAT32_MAX for v in vals):
            raise ArtifactError(f"{path}: the statistics of {name} are not finite float32 numbers.")
        if min(vals) < 0:
            raise ArtifactError(f"{path}: the statistics of {name} are negative, which no maxabs can be; the file is corrupt.")
    return data["layers"]


# ---- the artifact: written --------------------------------------------------------------------------
INC_CONFIG = "quant_config.json"


def write_artifact(directory: Path, output: Path, *, base: str, inc_config: dict, model: dict | None, config,
                   data: dict) -> None:
    """Once every rank's files are in `directory` (a staging dir that becomes `output`): INC's QUANTIZE config
    pointing at them (`recalc_scales`, so INC never silently reuses a scale file left in the directory by an earlier
    run) and the manifest, last."""
    write_json_atomic(Path(directory) / INC_CONFIG, {**inc_config, "mode": "QUANTIZE", "recalc_scales": True,
                                                     "dump_stats_path": str(Path(output).resolve() / base)})
    write_manifest(directory, ArtifactKind.MEASUREMENT, model=model, config=config, data=data)


# ---- the artifact: read -----------------------------------------------------------------------------
@dataclass
class LoadedMeasurement:
    """A measurement read and checked: an artifact (`manifest` set), or a foreign HQT/INC dump on its way into
    `import-hqt` (`manifest` None)."""

    directory: Path
    manifest: Manifest | None
    ranks: list[Measurement]
    stems: list[str]
    world_size: int

    @property
    def records(self) -> list[dict]:
        """The manifest's per-rank records (stem, files, layers, skipped, unmeasured); none for a foreign dump."""
        return list(self.manifest.data["ranks"]) if self.manifest is not None else []

    @property
    def layers(self) -> list[dict]:
        """Per rank: node -> what `measure` recorded of its layer (type, parallel style, shapes); empty if foreign.
        The manifest is not hashed (it holds the hashes), so its fields are checked here."""
        out = [r.get("layers") or {} if isinstance(r, dict) else None for r in self.records]
        bad = next((i for i, layers in enumerate(out) if not _layer_records(layers)), None)
        if bad is not None:
            raise ArtifactError(f"{self.manifest.path} has a malformed layer record for rank {bad}; it is corrupt.")
        return out or [{} for _ in self.stems]

    @property
    def base(self) -> str:
        """dump_stats_path's basename: the files are `<base>_hooks_<observer>...`."""
        return self.stems[0].rpartition("_hooks_")[0]

    @property
    def observer(self) -> str:
        return parse_measurement_file(f"{self.stems[0]}.json").observer

    def digest(self) -> str:
        if self.manifest is not None:
            return self.manifest.digest()
        files = [self.directory / f"{s}{ext}" for s in self.stems for ext in (".json", ".npz")]
        return "sha256:" + "".join(sha256_file(f)[:16] for f in files if f.exists())

    def kv_stats(self) -> dict[str, dict[str, float]] | None:
        """The KV-cache statistics (KV_FILE), None when the artifact has none; its bytes are read once and checked
        against the manifest's hash (artifact.verified_bytes), so they are the measurement's even if it was replaced
        since it was loaded."""
        if not self._listed(KV_FILE, "measure again on one rank for --kv-cache fp8"):
            return None
        return read_kv_stats(self.directory / KV_FILE, verified_bytes(self.manifest, KV_FILE))

    def hessians(self):
        """GPTQ's Hessians (`measure --hessians`; hqtflow.formats.hessians), None when the artifact has none."""
        from hqtflow.formats.hessians import HESSIAN_FILE, read_hessians

        return read_hessians(self.directory) if self._listed(HESSIAN_FILE, "measure again with --hessians") else None

    def _listed(self, name: str, remedy: str) -> bool:
        """Whether the manifest lists the file `name` (and so hashed it): only such a file is read; one put there
        afterwards is refused, `remedy` saying what gives a real one."""
        listed = self.manifest is not None and name in self.manifest.files
        if not listed and os.path.lexists(self.directory / name):
            raise ArtifactError(f"{self.directory / name} is not listed in the measurement's manifest (it was added "
                                f"after the measurement was written); {remedy}.")
        return listed


def _layer_records(layers) -> bool:
    """What `measure` writes per layer: {node: {"style": str | None, "weight_shape": [int], "output_dim": int, ...}}."""
    def ints(v):
        return isinstance(v, list) and all(whole(x) for x in v)

    kinds = {"style": lambda v: v is None or isinstance(v, str), "weight_shape": ints, "global_weight_shape": ints,
             "output_dim": lambda v: v is None or whole(v), "input_dim": lambda v: v is None or whole(v)}
    return isinstance(layers, dict) and all(
        isinstance(info, dict) and all(ok(info[k]) for k, ok in kinds.items() if k in info) for info in layers.values())


SHARDED_DIM = {"column": 0, "row": 1}  # the weight dimension a tensor-parallel style splits


def shard_span(layers: list[dict], name: str, rank: int) -> tuple[int, int, int] | None:
    """(dim, offset, size) of rank `rank`'s shard of layer `name`'s weight, from the per-rank layer records
    (`LoadedMeasurement.layers`); None when it is not sharded. The offset is the sum of the preceding ranks'
    recorded sizes: a dimension that does not divide by the rank count gives the first ranks one row more."""
    info = layers[rank].get(name)
    dim = SHARDED_DIM.get((info or {}).get("style"))
    if dim is None or len(layers) == 1:
        return None
    offset = sum(r[name]["weight_shape"][dim] for r in layers[:rank] if name in r)
    return dim, offset, info["weight_shape"][dim]


def manifest_ranks(m: Manifest) -> tuple[list[str], int]:
    """The rank stems and world size a measurement manifest records (checked: one stem per rank)."""
    try:
        stems, world = [str(r["stem"]) for r in m.data["ranks"]], m.data["world_size"]
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(f"{m.path} is corrupt (no valid ranks / world_size).") from None
    if len(stems) != world:  # (world_size: a whole number >= 1, checked by read_manifest)
        raise ArtifactError(f"{m.path} lists {len(stems)} rank(s) for world size {world}; it is corrupt.")
    return stems, world


def refuse_foreign_dump(directory: Path) -> None:
    """A directory of HQT/INC files without a manifest is refused with the `import-hqt` command that brings it in."""
    directory = Path(directory)
    if directory.is_dir() and not (directory / MANIFEST).exists():
        check_not_partial(directory)
        if scan_dump(directory).groups:
            raise ArtifactError(f"{directory} holds HQT/INC measurement files but no hqtflow {MANIFEST}; bring them in "
                                f"first with `hqtflow import-hqt {directory} -o OUT [--model MODEL]` and use OUT.")


def load_measurement(directory: str | Path) -> LoadedMeasurement:
    """The one reader of measurement artifacts: through the manifest, every file's hash checked. A foreign HQT/INC
    dump (no manifest) is refused with the `import-hqt` command that brings it in."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"Measurement directory {directory} {not_a_directory(directory)}.")
    refuse_foreign_dump(directory)
    m = read_manifest(directory, ArtifactKind.MEASUREMENT, verify=False)
    stems, world = manifest_ranks(m)
    rank_files = [f"{s}.json" for s in stems]
    verify_files(m, read_later=rank_files)  # the rank files are hashed as they are parsed
    ranks = [read_measurement(directory / f, verified_bytes(m, f)) for f in rank_files]
    loaded = LoadedMeasurement(directory, m, ranks, stems, world)
    check_rank_numbers(loaded)
    return loaded


def check_rank_numbers(src: LoadedMeasurement) -> None:
    """Each rank file says it is the rank its place in the manifest (or dump) gives it; -1 is optimum-habana's
    unify_measurements.py's mark of a single group's file (INC writes no rank as null)."""
    for r, meas in enumerate(src.ranks):
        if meas.local_rank not in (None, -1) and meas.local_rank != r:
            raise ArtifactError(f"{src.directory / src.stems[r]}.json says it is rank {meas.local_rank}, not {r}.")


@dataclass
class DumpFiles:
    """A directory's HQT/INC files by name: {(base, observer, world): {rank: {ext: path}}}, and its scale files."""

    groups: dict[tuple[str, str, int], dict[int, dict[str, Path]]]
    scale_files: list[Path]


def scan_dump(directory: Path) -> DumpFiles:
    """The measurement and scale files of a directory by their names; AppleDouble `._*` twins are not read."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"HQT measurement directory {directory} {not_a_directory(directory)}.")
    check_not_partial(directory)
    groups: dict = {}
    scales = []
    for p in sorted(directory.iterdir()):
        if not p.is_file() or p.name.startswith(APPLEDOUBLE):
            continue
        f = parse_measurement_file(p.name)
        if f is not None:
            groups.setdefault((f.base, f.observer, f.world or 1), {}).setdefault(f.rank or 0, {})[f.ext] = p
        elif SCALE_FILE.match(p.name):
            scales.append(p)
    return DumpFiles(groups, scales)


def read_dump(directory: Path, *, trust_pickle: bool = False, world_size: int | None = None) -> LoadedMeasurement:
    """A foreign dump (no manifest): one measurement's files (`world_size` picks among several), every rank present,
    each read from its JSON twin (its `.npz` only with `trust_pickle`)."""
    directory = Path(directory)
    groups = scan_dump(directory).groups
    if not groups:
        raise ArtifactError(f"{directory} holds no HQT/INC measurement files (*_hooks_maxabs[_<rank>_<world>].json).")
    if world_size is not None:
        groups = {k: v for k, v in groups.items() if k[2] == world_size} or {("", "", world_size): {}}
    if len(groups) > 1:
        shown = ", ".join(f"{b}_hooks_{o} ({w} rank(s))" for b, o, w in sorted(groups))
        worlds = sorted({w for _, _, w in groups})
        hint = f"; world sizes {worlds}: `import-hqt --world-size` picks one" if len(worlds) > 1 else ""
        raise ArtifactError(f"{directory} holds several measurements ({shown}{hint}); copy one of them into a directory "
                            "of its own.")
    (_, _, world), files = next(iter(groups.items()))
    present = {r for r in files if 0 <= r < world}
    if len(present) < world:  # the first few missing ranks named (a file name may claim a world of 10**20)
        first = list(itertools.islice((r for r in range(world) if r not in present), 8))
        more = world - len(present) - len(first)
        shown = ", ".join(map(str, first)) + (f" and {more} more" if more else "")
        raise ArtifactError(f"{directory} lacks files of its {world}-rank measurement: rank(s) {shown} are missing.")
    extra = sorted(set(files) - set(range(world)))
    if extra:
        raise ArtifactError(f"{directory} has files for rank {extra[0]}, outside its world size {world}.")
    ranks, stems = [], []
    for r in range(world):
        twins = files[r]
        stem = parse_measurement_file(next(iter(twins.values())).name).stem
        if ".json" in twins:
            ranks.append(read_measurement(twins[".json"]))
        elif ".npz" in twins and trust_pickle:
            ranks.append(_read_npz(twins[".npz"]))
        elif ".npz" in twins:
            raise ArtifactError(f"Rank {r} of {directory} has no measurement .json; its .npz twin is a pickle, opened "
                                "only with `hqtflow import-hqt --trust-pickle` (which writes its JSON twin into the "
                                "artifact); otherwise copy the JSON twin INC writes beside it.")
        else:
            raise ArtifactError(f"Rank {r} of {directory} has no measurement .json (only {stem}_mod_list.json).")
        stems.append(stem)
    loaded = LoadedMeasurement(directory, None, ranks, stems, world)
    check_rank_numbers(loaded)
    return loaded
