"""HQT / Neural Compressor measurement files, named and laid out exactly as INC writes them.

`<dump_stats_path>_hooks_<observer>[_<rank>_<world>]` + `.json` (canonical, what hqtflow reads), `.npz`
(INC's QUANTIZE reads it; it is `np.savez(path, dict)`, a pickled object array, so hqtflow writes it but never
reads one back) and `_mod_list.json`. Each per-tensor statistic is the observer's (1, 1) state as nested lists;
per-channel statistics are (C, 1).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hqtflow.errors import ArtifactError


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
    def from_json(cls, d: dict, *, where: str) -> NodeStats:
        try:
            return cls(
                inputs=[_array(x) for x in d.get("inputs", [])],
                outputs=[_array(x) for x in d.get("outputs", [])],
                params={k: _array(v) for k, v in d.get("params", {}).items()},
            )
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


def _array(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"expected a 2-D statistic, got shape {a.shape}")
    return a


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


def write_measurement(
    directory: Path,
    stem: str,
    nodes: dict[str, NodeStats],
    *,
    local_rank: int | None,
    num_samples: int,
) -> list[Path]:
    """Write `<stem>.json`, `<stem>.npz` and `<stem>_mod_list.json`; return their paths."""
    directory = Path(directory)
    header = {"GlobalRank": None, "LocalRank": local_rank, "Mode": "DynamicRange"}
    if num_samples > 0:
        header = {"NumSamples": num_samples, **header}
    js = directory / f"{stem}.json"
    js.write_text(json.dumps({**header, "Nodes": {k: v.to_json() for k, v in nodes.items()}}, indent=4))
    npz = directory / f"{stem}.npz"
    np.savez(npz, {**header, "Nodes": {k: v.to_numpy() for k, v in nodes.items()}})
    mods = directory / f"{stem}_mod_list.json"
    mods.write_text(json.dumps(list(nodes), indent=4))
    return [js, npz, mods]


def copy_measurement_files(directory: Path, stems: list[str], out: Path) -> list[str]:
    """Copy each rank's `.json`, `.npz` and `_mod_list.json` (those that exist) from `directory` into `out`."""
    import shutil

    names = []
    for st in stems:
        for suffix in (".json", ".npz", "_mod_list.json"):
            p = Path(directory) / f"{st}{suffix}"
            if p.exists():
                shutil.copy2(p, Path(out) / p.name)
                names.append(p.name)
    return names


@dataclass
class Measurement:
    """A parsed measurement JSON file."""

    nodes: dict[str, NodeStats]
    local_rank: int | None
    num_samples: int
    mode: str


def read_measurement(path: Path) -> Measurement:
    """Read a measurement `.json` (never the pickled `.npz`)."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"Measurement file {path} does not exist.")
    try:
        raw = json.loads(path.read_text())
        nodes = raw["Nodes"]
        mode = raw.get("Mode", "DynamicRange")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise ArtifactError(f"{path} is not an HQT measurement file (corrupt JSON or no 'Nodes').") from None
    if not isinstance(nodes, dict) or not isinstance(raw, dict):
        raise ArtifactError(f"{path} is not an HQT measurement file ('Nodes' is not an object).")
    bad = next((k for k in nodes if not NODE_NAME.match(k)), None)
    if bad is not None:
        raise ArtifactError(f"{path} has a node named {bad!r}, which is not a module name; the file is corrupt or hostile.")
    try:
        samples = int(raw.get("NumSamples", 0))
    except (TypeError, ValueError):
        raise ArtifactError(f"{path} has NumSamples {raw.get('NumSamples')!r}, not a number.") from None
    meas = Measurement(
        nodes={k: NodeStats.from_json(v, where=str(path)) for k, v in nodes.items()},
        local_rank=raw.get("LocalRank"),
        num_samples=samples,
        mode=mode,
    )
    check_statistics(meas, str(path))
    return meas
