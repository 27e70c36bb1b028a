"""`hqtflow unify`: merge the per-rank measurements of card groups, so a model measured on N cards runs on fewer.

Merge rules, per node and statistic (the layer's style comes from what `hqtflow measure --tp` recorded):
- per-tensor statistics, and anything replicated across the group: element-wise max;
- per-channel statistics along a sharded dimension: concatenated in rank order (column-parallel outputs and weight
  dim 0; row-parallel inputs), packed (fused gate/up) shards de-interleaved part by part; max along replicated ones;
- row-parallel outputs: hqtflow observes them after transformers' all-reduce, so every rank holds the exact full
  value and the max is exact (recorded in the manifest);
- a node present on only some ranks (MoE experts under expert parallelism): the union, from the ranks that have it.
Imported HQT dumps (`import-hqt`: no recorded styles): max for per-tensor statistics; per-channel ones need
`--parallel-plan FILE`.

Ranks that do not belong together are refused, naming the rank and the field: a Mode other than "DynamicRange"
(a scale file is not a measurement; never merged), a different NumSamples, or a different set of nodes (expert
nodes, `experts.<n>`, may differ: expert parallelism, where two ranks hold the same experts or other ones, never
some of the same). `--force` merges the last two anyway and prints each
override as a warning.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np

from hqtflow.errors import ArtifactError, ConfigError, ProvenanceWarning, regex_problem
from hqtflow.formats.artifact import check_output_dir, sha256_file, staged_output
from hqtflow.formats.measurement import SHARDED_DIM, LoadedMeasurement, check_rank_numbers, NodeStats, load_measurement, rank_suffix, write_artifact, write_measurement


# ---- groups -------------------------------------------------------------------------------------
def parse_groups(tokens: list[str], world: int) -> list[list[int]]:
    """`0123 4567` (HQT: one digit a rank), `0-7`, `0,1,2,3 4,5,6,7`; every rank exactly once, equal sizes. A token
    holding several groups separated by spaces (`-g "0123 4567"`) is split."""
    tokens = [t for tok in tokens for t in tok.split()]  # `-g "0123 4567"` as `-g 0123 4567`
    if not tokens:
        raise ConfigError("No groups: pass -g, e.g. -g 0123 4567.")
    groups = []
    for tok in tokens:
        ranks: list[int] = []
        for part in tok.split(","):
            part = part.strip()
            if re.fullmatch(r"[0-9]+-[0-9]+", part):  # ASCII digits: int() would read other scripts' too
                a, b = map(int, part.split("-"))
                if b < a:
                    raise ConfigError(f"Group {tok!r}: range {part} runs backwards.")
                if b >= world:  # refused before it is built: a range can be far too long to list
                    lo = max(a, world)
                    shown = _ranks(list(range(lo, b + 1))) if b - lo < 16 else f"{lo}-{b}"
                    raise ConfigError(f"Groups {' '.join(tokens)}: rank(s) {shown} do not exist in this {world}-rank measurement.")
                ranks += range(a, b + 1)
            elif re.fullmatch(r"[0-9]+", part):
                ranks += [int(part)] if "," in tok else [int(c) for c in part]
            else:
                raise ConfigError(f"Group {tok!r} is not a list of ranks (forms: 0123, 0-7, 0,1,2,3).")
        groups.append(ranks)
    flat = [r for g in groups for r in g]
    repeated = sorted({r for r in flat if flat.count(r) > 1})
    missing = sorted(set(range(world)) - set(flat))
    extra = sorted(set(flat) - set(range(world)))
    problems = []
    if repeated:
        problems.append(f"rank(s) {_ranks(repeated)} appear more than once")
    if missing:
        problems.append(f"rank(s) {_ranks(missing)} are missing")
    if extra:
        problems.append(f"rank(s) {_ranks(extra)} do not exist in this {world}-rank measurement")
    if problems:
        hint = " (a run of digits is one digit a rank, as in HQT: 0123 is ranks 0 to 3; write ranks past 9 in a comma " \
               "list, 8,9,10,11, or a range, 8-11)" if world > 10 and any(re.fullmatch(r"[0-9]{2,}", t) for t in tokens) else ""
        raise ConfigError(f"Groups {' '.join(tokens)}: {'; '.join(problems)}{hint}.")
    if len({len(g) for g in groups}) > 1:
        raise ConfigError(f"Groups {' '.join(tokens)} have different sizes {[len(g) for g in groups]}; they must be equal.")
    return [sorted(g) for g in groups]


def check_rank_order(parsed: list[list[int]], tokens: list[str], *, force: bool = False) -> list[str]:
    """Merged rank k takes the k-th slice of the fewer-card tensor-parallel layout, so its group must be ranks k*n ..
    (k+1)*n - 1 (`0123 4567`). Other groups are refused; `force` merges them anyway (per-tensor statistics only:
    a concatenated per-channel vector of such a group is no rank's slice) and returns what it overrode."""
    n = len(parsed[0])
    expected = [list(range(k * n, (k + 1) * n)) for k in range(len(parsed))]
    if parsed == expected:
        return []
    what = (f"Groups {' '.join(tokens)} are not consecutive ranks in order ({' '.join(_span(g) for g in expected)}): "
            "merged rank k runs the k-th slice of each sharded layer on fewer cards, so its statistics must come from "
            "the ranks that held that slice")
    if not force:
        raise ConfigError(f"{what} (--force merges per-tensor statistics of these groups anyway).")
    warnings.warn(f"--force: {what}.", ProvenanceWarning, stacklevel=2)
    return [f"groups {' '.join(tokens)} out of rank order"]


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def _ranks(rs: list[int]) -> str:
    return ", ".join(map(str, rs))


_EXPERT = re.compile(r"(^|\.)experts?\.\d+(\.|$)")


def check_same_run(src: LoadedMeasurement, *, force: bool = False) -> list[str]:
    """Every rank file must come from the same measurement run: rank number (formats.measurement.check_rank_numbers),
    Mode, NumSamples and node set agree with rank 0's (see the module doc); `force` turns the NumSamples and node-set
    refusals into warnings."""
    check_rank_numbers(src)
    first = src.ranks[0]
    common = {n for n in first.nodes if not _EXPERT.search(n)}
    experts = [{n for n in meas.nodes if _EXPERT.search(n)} for meas in src.ranks]
    overridden = []
    for r, meas in enumerate(src.ranks):
        where = f"{src.directory / src.stems[r]}.json"
        if meas.mode != "DynamicRange":
            raise ArtifactError(f"{where} (rank {r}) has Mode {meas.mode!r}; only measurement files (Mode 'DynamicRange') "
                                "are merged.")
        problems = []
        if meas.num_samples != first.num_samples:
            problems.append(f"NumSamples {meas.num_samples} differs from rank 0's {first.num_samples}")
        nodes = {n for n in meas.nodes if not _EXPERT.search(n)}
        if nodes != common:
            odd = sorted(nodes ^ common)
            problems.append(f"its nodes differ from rank 0's ({len(odd)} node(s), e.g. {odd[0]}): another model or run")
        mixed = next((q for q in range(r) if experts[q] & experts[r] and experts[q] != experts[r]), None)
        if mixed is not None:  # ranks hold the same experts (tensor parallel) or other ones (expert parallel)
            odd = sorted(experts[mixed] ^ experts[r])
            problems.append(f"its expert nodes overlap rank {mixed}'s without being the same ({len(odd)} node(s), e.g. "
                            f"{odd[0]}): another model or run")
        for p in problems:
            if not force:
                raise ArtifactError(f"Rank {r} ({where}): {p}; refusing to merge ranks that do not belong together "
                                    "(--force merges them anyway).")
            warnings.warn(f"--force: merging rank {r} although {p}.", ProvenanceWarning, stacklevel=2)
            overridden.append(f"rank {r}: {p}")
    return overridden


# ---- merging ------------------------------------------------------------------------------------
def _concat(parts: list[np.ndarray], packed: int) -> np.ndarray:
    """Concatenate (C_r, 1) shards in rank order; packed shards are de-interleaved part by part."""
    if packed <= 1:
        return np.concatenate(parts, axis=0)
    split = [np.split(p, packed, axis=0) for p in parts]
    return np.concatenate([s[k] for k in range(packed) for s in split], axis=0)


def merge_stat(kind: str, arrays: list[np.ndarray], info: dict | None, plan_style: str | None,
               in_order: bool = True) -> np.ndarray:
    """Merge one statistic of one node across a group. kind: input | output | weight. in_order: the groups are
    consecutive ranks in order (a sharded per-channel statistic is concatenated only then)."""
    if all(a.shape == (1, 1) for a in arrays):
        return np.max(np.stack(arrays), axis=0)
    style = (info or {}).get("style") or plan_style
    if style is None:
        raise ArtifactError("per-channel statistics without a recorded parallel style; pass --parallel-plan FILE.")
    packed = int((info or {}).get("packed_parts", 1))
    sharded = {
        ("column", "weight"): True, ("column", "input"): False, ("row", "weight"): False, ("row", "input"): True,
        ("row", "output"): False, ("replicated", "weight"): False, ("replicated", "input"): False,
        ("replicated", "output"): False,
    }.get((style, kind))
    if (style, kind) == ("column", "output"):  # sharded unless transformers gathered it (e.g. lm_head)
        local_out = (info or {}).get("weight_shape", [None])[0]
        sharded = (info or {}).get("output_dim", local_out) == local_out if info else True
    if sharded is None:
        raise ArtifactError(f"unknown parallel style {style!r}.")
    if sharded and not in_order:
        raise ConfigError(f"its {kind} statistics are per channel and sharded across ranks: concatenating the shards "
                          "of groups out of rank order gives no rank's slice, even with --force.")
    return _concat(arrays, packed) if sharded else np.max(np.stack(arrays), axis=0)


def merge_group(src: LoadedMeasurement, group: list[int], plan: dict[str, str],
                in_order: bool = True) -> tuple[dict[str, NodeStats], dict[str, dict]]:
    names: list[str] = []
    for r in group:
        names += [n for n in src.ranks[r].nodes if n not in names]
    nodes, layers, records = {}, {}, src.layers
    for name in names:
        have = [r for r in group if name in src.ranks[r].nodes]
        stats = [src.ranks[r].nodes[name] for r in have]
        info = records[have[0]].get(name)
        plan_style = next((s for pat, s in plan.items() if re.search(pat, name)), None)
        try:
            inputs = [merge_stat("input", [s.inputs[i] for s in stats], info, plan_style, in_order)
                      for i in range(len(stats[0].inputs))]
            outputs = [merge_stat("output", [s.outputs[i] for s in stats], info, plan_style, in_order)
                       for i in range(len(stats[0].outputs))]
            params = {k: merge_stat("weight", [s.params[k] for s in stats], info, plan_style, in_order) for k in stats[0].params}
        except (ArtifactError, ConfigError) as e:
            raise type(e)(f"Node {name}: {e}") from None
        except (ValueError, IndexError):
            raise ArtifactError(f"Node {name} has statistics of different shapes or counts on ranks {have}.") from None
        nodes[name] = NodeStats(inputs, outputs, params)
        if info:
            layers[name] = _merged_info([records[r].get(name, info) for r in have])
    return nodes, layers


def _merged_info(infos: list[dict]) -> dict:
    """The layer record of a merged rank from its group's records: a sharded dimension is the sum of the shards
    (which differ by one row where a dimension does not divide by the rank count)."""
    info = infos[0]
    out = dict(info)
    shape = list(info.get("weight_shape", []))
    dim = SHARDED_DIM.get(info.get("style"))
    if shape and dim is not None:
        shape[dim] = sum(i["weight_shape"][dim] for i in infos)
        out["weight_shape"] = shape
        if dim == 0 and info.get("output_dim") == info["weight_shape"][0]:
            out["output_dim"] = shape[0]
        if dim == 1:
            out["input_dim"] = shape[1]
    if shape and shape == info.get("global_weight_shape"):
        out["style"] = "replicated"
    return out


# ---- the stage ----------------------------------------------------------------------------------
def unify(measurement: str | Path, groups: list[str], output: str | Path, *, overwrite: bool = False,
          parallel_plan: str | Path | None = None, force: bool = False) -> Path:
    src = load_measurement(Path(measurement))
    forced = check_same_run(src, force=force)
    parsed = parse_groups(groups, src.world_size)
    out_of_order = check_rank_order(parsed, groups, force=force)
    forced += out_of_order
    plan = _read_plan(parallel_plan)
    check_output_dir(Path(output), overwrite, [src.directory])
    merged = [merge_group(src, g, plan, in_order=not out_of_order) for g in parsed]
    n = len(parsed)
    m = src.manifest.raw
    data = dict(m.get("data") or {})
    known = data.get("provenance_known", True)
    observer = data.get("observer") or src.observer
    prefix = f"{src.base}_hooks_{src.observer}"  # each merged rank's stem: prefix + rank suffix
    with staged_output(Path(output), overwrite=overwrite, inputs=[src.directory]) as tmp:
        records = []
        for i, (nodes, layers) in enumerate(merged):
            stem = f"{prefix}{rank_suffix(i, n)}"
            samples = sum(src.ranks[r].num_samples for r in parsed[i]) // len(parsed[i])
            files = write_measurement(tmp, stem, nodes, local_rank=i if n > 1 else None, num_samples=samples)
            records.append({"rank": i, "stem": stem, "files": [f.name for f in files], "layers": layers,
                            "unmeasured": [], "skipped": {}, "source_ranks": parsed[i]})
        source_files = {f"{s}.json": sha256_file(src.directory / f"{s}.json") for s in src.stems}
        data.update({
            "world_size": n,
            "observer": observer,
            "ranks": records,
            "unified_from": {"directory": str(src.directory.resolve()), "world_size": src.world_size, "groups": parsed,
                             "files": source_files, "provenance_known": known},
            "forced": forced,  # what --force overrode (empty: the ranks agreed)
            "merge": {"per_tensor": "max", "per_channel": "concatenated along sharded dims in rank order, max along replicated",
                      "row_parallel_outputs": "observed after the all-reduce: exact" if known else "max (imported dump)"},
        })
        carried = _carry_side_files(src, tmp) if n == 1 and src.world_size == 1 else []
        if "hessians.safetensors" not in carried:
            data["hessians"] = None
        write_artifact(tmp, Path(output), base=src.base, inc_config=m.get("config") or {"observer": observer},
                       model=m.get("model"), config=m.get("config"), data=data)
    return Path(output)


def _carry_side_files(src, out: Path) -> list[str]:
    """A one-rank measurement unified to one rank keeps its KV-cache statistics and Hessians (files the manifest
    vouched for; their shapes do not depend on the rank layout)."""
    import shutil

    from hqtflow.formats.hessians import HESSIAN_FILE
    from hqtflow.formats.measurement import KV_FILE

    carried = [f for f in (KV_FILE, HESSIAN_FILE) if f in src.manifest.files]
    for f in carried:
        shutil.copyfile(src.directory / f, Path(out) / f)
    return carried


def _read_plan(path) -> dict[str, str]:
    if path is None:
        return {}
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"Parallel plan {path} cannot be read as JSON ({e}).") from None
    if not isinstance(plan, dict) or not all(v in ("column", "row", "replicated") for v in plan.values()):
        raise ConfigError(f"Parallel plan {path} must map module-name regexes to column, row or replicated.")
    for pattern in plan:
        if (problem := regex_problem(pattern)) is not None:
            raise ConfigError(f"Parallel plan {path} has an invalid regex {pattern!r} ({problem}).")
    return plan
