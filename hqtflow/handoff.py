"""`hqtflow handoff`: the Gaudi command lines for what hqtflow made (optimum-habana's scripts, TGI-Gaudi's docker run).

optimum-habana pins its own transformers and imports only with the Habana stack, so it never shares hqtflow's
environment: hqtflow writes the commands instead. Pure functions: a recipe and/or an artifact (a measurement, unified
or not, or `quantize --scales-only` scale files) in, a `Plan` out: command lines, each a list of shell words
(leading `NAME=value` words are environment assignments), plus the QUANT_CONFIG files they name, which the caller
writes into the hand-off directory (the user's artifact is never edited). Nothing here runs on Gaudi: this project
has no Gaudi hardware, so the commands are checked for their paths and their QUANT_CONFIG parsing, never executed.

A recipe's optional `gaudi` section gives the scripts and flags of the seeds' runs:

    gaudi:
      measure: {script: run_lm_eval.py, args: "-o acc.txt --use_hpu_graphs --bf16 --batch_size 1"}
      quantize:                       # one mapping, or a list: the entry whose `cards` equals the world size,
        - {cards: 8, script: run_lm_eval.py, args: "..."}    # else the one without `cards`
        - {cards: 1, script: run_generation.py, env: {TQDM_DISABLE: "1"}, args: "... --disk_offload"}
      tgi: {env: {BATCH_BUCKET_SIZE: "64"}, args: "--max-input-tokens 1024 --max-total-tokens 2048"}

`--model_name_or_path` / `--model-id` and the world size are hqtflow's (from the recipe or artifact), never the args'.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hqtflow import bundled
from hqtflow.errors import ArtifactError, ConfigError, brief, not_a_directory, not_there
from hqtflow.formats.artifact import ArtifactKind

TARGETS = ("optimum-habana", "tgi-gaudi")
MODES = ("measure", "quantize")
TGI_IMAGE = "ghcr.io/huggingface/tgi-gaudi:2.0.1"
SRC = "/usr/src"  # TGI-Gaudi's working directory: the seeds mount quantization_config and hqt_output under it
GAUDI_TARGETS = ("gaudi2", "gaudi3")
DEFAULTS = {  # without a recipe's gaudi section: the seeds' common flags
    "measure": {"script": "run_lm_eval.py", "args": ["-o", "acc_measure.txt",  # run_lm_eval.py requires its output file
                                                     "--use_hpu_graphs", "--use_kv_cache", "--bf16", "--batch_size", "1"]},
    "quantize": {"script": "run_generation.py", "args": ["--use_hpu_graphs", "--use_kv_cache", "--limit_hpu_graphs",
                                                         "--bf16", "--batch_size", "1", "--max_new_tokens", "128"]},
    "tgi": {"env": {"PREFILL_BATCH_BUCKET_SIZE": "1", "BATCH_BUCKET_SIZE": "64", "PAD_SEQUENCE_TO_MULTIPLE_OF": "128"},
            "args": ["--max-input-tokens", "1024", "--max-batch-prefill-tokens", "4096", "--max-total-tokens", "2048",
                     "--max-batch-size", "64"]},  # the TGI-Gaudi README's "LLama 7b FP8 on 1 Gaudi2 card"
}
ENTRY_KEYS = {"script", "args", "env", "cards"}


@dataclass(frozen=True)
class Artifact:
    """What a hand-off needs from an hqtflow measurement or scales artifact (read and checked by `read_artifact`)."""

    directory: Path  # resolved
    kind: str  # "measurement" or "scales"
    world_size: int
    base: str  # dump_stats_path's basename: the files are <base>_hooks_<observer>...
    config: dict  # its quant_config.json
    model: str | None  # the model folder it was made from
    recipe: str | None  # the recipe its measurement was made with, when recorded
    fingerprint: dict | None = None  # the fingerprint of that model (hqtflow.models.fingerprint), when recorded
    observer: str = "maxabs"  # the measurement's observer: its files are <base>_hooks_<observer>...
    attention_measured: bool = False  # it has optimum-habana's attention nodes (matmul_qk ...: measured on Gaudi)
    measured_with: dict | None = None  # a measurement's MEASURE config, as its manifest records it


@dataclass(frozen=True)
class Job:
    mode: str
    world_size: int
    model: str
    gaudi: dict  # the recipe's gaudi section (validated), or {}
    config: dict  # QUANT_CONFIG before its dump_stats_path is pointed at the files
    config_name: str  # file name of the QUANT_CONFIG copy
    artifact: Artifact | None  # None in measure mode
    recipe_cards: int | None = None  # the card count the recipe (and its gaudi section) was written for
    notes: tuple[str, ...] = ()  # what was changed in the config for INC (quant_config.for_inc)


@dataclass
class Plan:
    commands: list[list[str]]
    configs: dict[str, dict] = field(default_factory=dict)  # name (relative to the hand-off dir) -> QUANT_CONFIG
    dirs: list[str] = field(default_factory=list)  # directories (relative) the commands need to exist
    notes: list[str] = field(default_factory=list)


def shell_line(words: list[str]) -> str:
    """Words as one shell line; `NAME=value` words before the program stay assignments (only the value is quoted)."""
    out, assigning = [], True
    for w in words:
        name, eq, value = w.partition("=")
        if assigning and eq and name.isidentifier():
            out.append(f"{name}={shlex.quote(value)}")
        else:
            assigning = False
            out.append(shlex.quote(w))
    return " ".join(out)


def _load_json(path: Path, what: str) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{what} {path} cannot be read as JSON ({type(e).__name__}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {path} must be a JSON object.")
    return raw


def _recorded_recipe(data: dict, hops: int = 3) -> str | None:
    """The recipe a measurement was made with, following unified_from / source_measurement back to it."""
    recipe = (data.get("settings") or {}).get("recipe") if isinstance(data.get("settings"), dict) else None
    if recipe or hops == 0:
        return recipe
    parent = (data.get("unified_from") or {}).get("directory") or data.get("source_measurement")
    if not isinstance(parent, str):
        return None
    from hqtflow.formats.artifact import read_manifest

    try:  # the parent is only a hint: gone or changed since, it names no recipe
        return _recorded_recipe(read_manifest(Path(parent), ArtifactKind.MEASUREMENT, verify=False).data, hops - 1)
    except ArtifactError:
        return None


def read_artifact(directory: str | Path) -> Artifact:
    """An hqtflow measurement or scales artifact, checked: every rank's files INC reads are there and unchanged."""
    from hqtflow.formats.artifact import artifact_kind, read_manifest
    from hqtflow.formats.measurement import INC_CONFIG, gaudi_only, measurement_stem, read_measurement, refuse_foreign_dump
    from hqtflow.formats.scale_files import read_scale_file, scale_stem

    directory = Path(directory)
    if not directory.is_dir():
        raise ArtifactError(f"Artifact {directory} {not_a_directory(directory)}.")
    refuse_foreign_dump(directory)
    type_ = artifact_kind(directory)
    kind = {ArtifactKind.MEASUREMENT: "measurement", ArtifactKind.SCALES: "scales"}.get(type_)
    if kind is None:
        raise ArtifactError(f"{directory} holds a {type_!r} artifact; a hand-off needs a measurement "
                            "(measure, unify, import-hqt) or scale files (quantize --scales-only).")
    m = read_manifest(directory, type_, verify=False)  # the files are verified last, after naming missing ranks
    raw = m.raw
    data = raw.get("data") or {}
    if not (directory / INC_CONFIG).is_file():
        raise ArtifactError(f"{directory} has no {INC_CONFIG}; it is not a complete hqtflow {kind} artifact.")
    config = _load_json(directory / INC_CONFIG, "QUANT_CONFIG")
    try:
        world = data["world_size"]  # (a whole number >= 1: read_manifest checks it)
        if world > len(raw["files"]):  # (each rank has files of its own)
            raise ValueError
        observer = str(data.get("observer") or config.get("observer") or "maxabs")
        if kind == "measurement":
            stems = [str(r["stem"]) for r in data["ranks"]]
            base = stems[0].split("_hooks_")[0]
        else:
            base = Path(str(config["dump_stats_path"])).name
            stems = [measurement_stem(base, observer, r if world > 1 else None, world) for r in range(world)]
    except (KeyError, TypeError, ValueError, IndexError):
        raise ArtifactError(f"{m.path} is corrupt (no valid ranks / world_size).") from None
    if len(stems) != world:
        raise ArtifactError(f"{directory} lists {len(stems)} rank file(s) for world size {world}; it is corrupt.")
    needed = {r: [f"{s}.json", f"{s}.npz"] for r, s in enumerate(stems)}  # INC reads the .npz
    if kind == "scales":
        target = data.get("target")
        if target not in GAUDI_TARGETS:
            raise ArtifactError(f"The scale files in {directory} were made for {target!r}, not Gaudi; make them with "
                                "`hqtflow quantize --scales-only --scales-for gaudi2` (or gaudi3).")
        method = str(data.get("scale_method") or "")
        for r in range(world):
            stem = scale_stem(base, observer, method, r if world > 1 else None, world)
            needed[r] += [stem + ".json", stem + ".npz"]
    missing = sorted({r for r, names in needed.items() if not all((directory / n).is_file() for n in names)})
    if missing:
        raise ArtifactError(f"{directory} is a {world}-rank {kind} but the files of rank(s) "
                            f"{', '.join(map(str, missing))} are missing.")
    read_manifest(directory, type_)  # every listed file present and unchanged
    if kind == "scales":  # what INC will load (the .npz) is written from the same nodes as the JSON twin checked here
        for names in needed.values():
            read_scale_file(directory / names[-2])
    attention = bool(gaudi_only(read_measurement(directory / needed[0][0]).nodes))
    return Artifact(directory.resolve(), kind, world, base, config, data.get("model_path"), _recorded_recipe(data),
                    m.model if isinstance(m.model, dict) else None, observer, attention,
                    raw.get("config") if kind == "measurement" and isinstance(raw.get("config"), dict) else None)


def _gaudi_section(recipe_path: str | None, gaudi: Any) -> dict:
    if gaudi is None:
        return {}
    where = f"Recipe {recipe_path}: 'gaudi'"
    if not isinstance(gaudi, dict) or set(gaudi) - {"measure", "quantize", "tgi"}:
        raise ConfigError(f"{where} must be a mapping with keys among measure, quantize, tgi.")
    out: dict = {}
    for key, value in gaudi.items():
        entries = value if isinstance(value, list) else [value]
        checked = []
        for e in entries:
            if not isinstance(e, dict) or set(e) - ENTRY_KEYS:
                raise ConfigError(f"{where}.{key} entries must be mappings with keys among {', '.join(sorted(ENTRY_KEYS))}.")
            args = e.get("args", [])
            args = shlex.split(args) if isinstance(args, str) else args
            env = e.get("env") or {}
            if not isinstance(args, list) or not all(isinstance(a, (str, int, float)) for a in args):
                raise ConfigError(f"{where}.{key}.args must be a string or a list of words.")
            if not isinstance(env, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                    and isinstance(v, (str, int, float)) for k, v in env.items()):
                raise ConfigError(f"{where}.{key}.env must map variable names to values.")
            cards = e.get("cards")
            if cards is not None and (not isinstance(cards, int) or isinstance(cards, bool) or cards < 1):
                raise ConfigError(f"{where}.{key}.cards must be a positive integer, not {brief(cards)}.")
            if key != "tgi" and not isinstance(e.get("script"), str):
                raise ConfigError(f"{where}.{key} needs a `script` (run_generation.py or run_lm_eval.py).")
            checked.append({"script": e.get("script"), "args": [str(a) for a in args],
                            "env": {k: str(v) for k, v in env.items()}, "cards": cards})
        out[key] = checked
    return out


def _fewer_cards(job: Job, entry: dict) -> list[str]:
    """Notes when the artifact's rank count is not the recipe's card count, and when a recipe entry written for more
    cards (no `cards` of its own) runs on fewer: its batch sizes and token limits were sized for all of them."""
    n = job.recipe_cards
    if not n or job.world_size == n:
        return []
    notes = [f"the artifact holds {job.world_size} rank(s), so this runs on {job.world_size} card(s); the recipe "
             f"measures on {n} (cards: {n})."]
    if entry.get("cards") is None and job.gaudi and job.world_size < n:
        notes.append(f"the batch sizes and token limits below come from the recipe's {n}-card run; on "
                     f"{job.world_size} card(s) lower them in proportion, or give the recipe's gaudi section an entry "
                     f"with cards: {job.world_size}.")
    return notes


def _entry(job: Job, key: str) -> dict:
    entries = job.gaudi.get(key)
    if not entries:
        return {"env": {}, "cards": None, "script": None, **DEFAULTS[key]}
    for e in entries:
        if e["cards"] == job.world_size:
            return e
    for e in entries:
        if e["cards"] is None:
            return e
    raise ConfigError(f"The recipe's gaudi.{key} has no command for {job.world_size} card(s) "
                      f"(it has {', '.join(str(e['cards']) for e in entries)}).")


def plan_job(source: str | Path, *, mode: str = "quantize", world_size: int | None = None, model: str | None = None,
             measurement: str | Path | None = None, recipe: str | Path | None = None) -> Job:
    """Resolve SOURCE (a recipe .yaml or an artifact dir) plus overrides into what the target functions need."""
    from hqtflow.formats.quant_config import QuantConfig, fitted_to_measurement, for_inc, not_in_inc
    from hqtflow.recipes import load_recipe

    if mode not in MODES:
        raise ConfigError(f"Unknown --mode {mode!r}; valid values are {', '.join(MODES)}.")
    if world_size is not None and world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, not {world_size}.")
    source = Path(source)
    if not source.exists():  # no artifact folder or recipe of that name here: a bare name's bundled recipe
        source = bundled.resolve(source, bundled.RECIPES, ".yaml")
    if source.suffix in (".yaml", ".yml"):
        if recipe is not None:
            raise ConfigError("SOURCE is already a recipe; --recipe goes with an artifact SOURCE.")
        recipe, art_dir = source, measurement
        if mode == "quantize" and art_dir is None:
            out = load_recipe(recipe).measure.output
            if not out:
                raise ConfigError(f"Recipe {recipe} names no `output` measurement; pass -m DIR.")
            art_dir = out
    else:
        if measurement is not None:
            raise ConfigError("-m goes with a recipe SOURCE; SOURCE is already the artifact.")
        art_dir = source
    artifact = None
    if mode == "quantize" or source.suffix not in (".yaml", ".yml"):
        if art_dir is not None and not Path(art_dir).exists():
            hint = f" (run `hqtflow measure --recipe {source}` first, or hand off --mode measure)" if recipe == source \
                else bundled.hint(art_dir, bundled.RECIPES, ".yaml", label="bundled recipes")
            raise ArtifactError(f"Artifact {art_dir} {not_there(art_dir)}{hint}.")
        artifact = read_artifact(art_dir)
        if recipe is None and artifact.recipe and Path(artifact.recipe).is_file():
            recipe = artifact.recipe
    r = load_recipe(recipe) if recipe is not None else None
    gaudi = _gaudi_section(str(recipe), r.gaudi) if r else {}

    if mode == "measure":
        if artifact is not None and artifact.kind != "measurement":
            raise ConfigError("--mode measure hands off a recipe (or a measurement's recipe), not scale files.")
        world = world_size or (r.measure.tp if r else None) or (artifact.world_size if artifact else 1)
        if not (r and r.measure.config) and artifact is not None and artifact.measured_with:
            config = {**artifact.measured_with, "mode": "MEASURE"}
            name = f"{artifact.observer}_measure.json"  # (its copy's file name)
        else:  # the recipe's, else the bundled per-tensor one
            cfg_path = Path(r.measure.config) if r and r.measure.config else bundled.CONFIGS / "maxabs_measure.json"
            config, name = _load_json(cfg_path, "QUANT_CONFIG"), cfg_path.name
    else:
        world = artifact.world_size
        if world_size is not None and world_size != world:
            raise ConfigError(f"{artifact.directory} holds {world} rank(s), not {world_size}; unify it first "
                              f"(`hqtflow unify -g ... -m {artifact.directory} -o DIR` makes {world_size} group(s)).")
        quant = r.quantize.config if r else None
        if artifact.kind == "measurement" and quant:
            config, name = _load_json(Path(quant), "QUANT_CONFIG"), Path(quant).name
            config = {**config, "recalc_scales": True}  # never reuse a stale scale file beside the measurement
        else:  # scale files: their own config (scale method and format the files were made with)
            config, name = dict(artifact.config), "quant_config.json"
        config["mode"] = "QUANTIZE"
    method = QuantConfig.from_dict(config, source=name).scale_method  # one sentence for a wrong key or value
    if why := not_in_inc(method):  # (INC parses the scale method in a MEASURE config too)
        raise ConfigError(f"QUANT_CONFIG {name}: {why}; run it here (`hqtflow quantize`, then serve the FP8 "
                          "checkpoint) or hand off an INC scale method.")
    notes = []
    if artifact is not None and mode == "quantize":
        config, notes = fitted_to_measurement(config, artifact.observer, artifact.attention_measured)
    config, changed = for_inc(config)
    notes += changed
    if mode == "measure" and str(config.get("mode", "")).upper() != "MEASURE":
        raise ConfigError(f"QUANT_CONFIG {name} has mode {config.get('mode')!r}; --mode measure needs a MEASURE config.")
    given = model
    if model is None:  # a recipe SOURCE names the model; an artifact, the folder it was made from
        from_recipe = r.measure.model if r else None
        model = from_recipe if recipe == source else (artifact.model if artifact else None) or from_recipe
        model = _check_model(str(model)) if model else model  # (a --model given may be a path on the Gaudi host)
    if not model:
        raise ConfigError("No model: the artifact records none; pass --model.")
    if r and artifact and (given or r.measure.model):  # the model handed off: --model, else the recipe's
        _check_measured_model(str(given or r.measure.model), artifact, recipe)
    return Job(mode, world, str(model), gaudi, config, name, artifact, r.measure.tp if r else None, tuple(notes))


def _check_model(model: str) -> str:
    """A model folder here or a hub id; a path that is not here is refused (an older hqtflow recorded the model
    relative to where it ran: `../tiny` would name another folder on the Gaudi host, not a hub id)."""
    p = Path(model).expanduser()
    if not p.exists() and (model.startswith((".", "~", "/")) or ".." in p.parts):
        from hqtflow.errors import ModelError

        raise ModelError(f"The model {model} recorded in the artifact or recipe is a path that does not exist here (an "
                         "older hqtflow recorded it relative to where it ran); pass --model with its path or hub id.")
    return model


def _check_measured_model(recipe_model: str, artifact: Artifact, recipe) -> None:
    """An artifact handed off with a recipe was made from the model handed off (models.same_model: an older hqtflow's
    fingerprint, or a tokenizer changed since, still agree). A model not here (a hub id not cached, a path on the
    Gaudi host) cannot be compared and is not checked."""
    from hqtflow import models
    from hqtflow.errors import ModelError

    if artifact.fingerprint is None:
        return
    try:
        model_dir = models.resolve_model(recipe_model)
    except (ModelError, ArtifactError):
        return
    if not models.same_model(artifact.fingerprint, models.fingerprint(model_dir), str(artifact.directory)):
        raise ArtifactError(f"{artifact.directory} was made from the model {artifact.model}, not from recipe {recipe}'s "
                            f"model {recipe_model} ({model_dir}); hand it off with its own recipe (--recipe) or none.")


def _model_arg(model: str) -> str:
    """The model as optimum-habana loads it: a folder here by its absolute path (an embedded name, `smollm2`, by
    its prepared folder), else as given (a hub id, or a path on the Gaudi host)."""
    from hqtflow.models import EMBEDDED_MODELS, resolve_model

    p = Path(model).expanduser()
    if model in EMBEDDED_MODELS and not p.exists():
        return str(resolve_model(model))
    return str(p.resolve()) if p.exists() else model


def optimum_habana(job: Job, handoff_dir: Path) -> Plan:
    """`QUANT_CONFIG=... python [../gaudi_spawn.py --use_deepspeed --world_size N] run_*.py --model_name_or_path M ...`,
    run from optimum-habana's examples/text-generation directory on the Gaudi host."""
    handoff_dir = Path(handoff_dir).resolve()
    rel_cfg = f"quantization_config/{job.config_name}"
    config = dict(job.config)
    plan = Plan([], dirs=["quantization_config"])
    if job.mode == "measure":
        plan.dirs.append("hqt_output")
        base = Path(str(config.get("dump_stats_path", "./hqt_output/measure"))).name
        config["dump_stats_path"] = str(handoff_dir / "hqt_output" / base)
        plan.notes.append(f"then bring the measurement back: hqtflow import-hqt {shlex.quote(str(handoff_dir / 'hqt_output'))} "
                          f"-o MEASUREMENT --model {shlex.quote(job.model)}")
    else:
        config["dump_stats_path"] = str(job.artifact.directory / job.artifact.base)
    plan.configs[rel_cfg] = config
    e = _entry(job, job.mode)
    plan.notes += [*job.notes, *_fewer_cards(job, e)]
    env = [f"QUANT_CONFIG={handoff_dir / rel_cfg}", *(f"{k}={v}" for k, v in e["env"].items())]
    launch = ["python"] + (["../gaudi_spawn.py", "--use_deepspeed", "--world_size", str(job.world_size)]
                           if job.world_size > 1 else [])
    plan.commands.append([*env, *launch, e["script"], "--model_name_or_path", _model_arg(job.model), *e["args"]])
    return plan


def tgi_gaudi(job: Job, handoff_dir: Path, *, image: str = TGI_IMAGE, port: int = 8080, volume: Path | None = None) -> Plan:
    """TGI-Gaudi's `docker run` with QUANT_CONFIG: the measurement (or scale files) mounted at /usr/src/hqt_output and a
    copy of the config, pointing there, mounted at /usr/src/quantization_config; a local model at /data/model."""
    from hqtflow.runtime.transport import check_port

    check_port(port)
    if job.mode != "quantize":
        raise ConfigError("TGI-Gaudi only serves a measured model (QUANTIZE); measure with --to optimum-habana.")
    handoff_dir = Path(handoff_dir).resolve()
    volume = Path(volume).resolve() if volume else handoff_dir / "data"
    config = {**job.config, "dump_stats_path": f"{SRC}/hqt_output/{job.artifact.base}"}
    rel_cfg = f"quantization_config/{job.config_name}"
    plan = Plan([], configs={rel_cfg: config}, dirs=["quantization_config"] + (["data"] if volume == handoff_dir / "data" else []))
    e = _entry(job, "tgi")
    plan.notes += [*job.notes, *_fewer_cards(job, e)]
    local = Path(_model_arg(job.model))
    mounts = [f"{volume}:/data", f"{handoff_dir / 'quantization_config'}:{SRC}/quantization_config",
              f"{job.artifact.directory}:{SRC}/hqt_output"]
    model_id = job.model
    if local.exists():
        mounts.append(f"{local.resolve()}:/data/model:ro")
        model_id = "/data/model"
    env = {"HABANA_VISIBLE_DEVICES": "all", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
           "HF_HUB_ENABLE_HF_TRANSFER": "1"}
    if job.world_size > 1:
        env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] = "true"
    env.update(e["env"])
    env["QUANT_CONFIG"] = f"{SRC}/{rel_cfg}"
    words = ["docker", "run", "-p", f"{port}:80", "--runtime=habana"]
    for m in mounts:
        words += ["-v", m]
    words += ["-e", "HUGGING_FACE_HUB_TOKEN"]  # passed through from the caller's environment, never written here
    for k, v in env.items():
        words += ["-e", f"{k}={v}"]
    words += ["--cap-add=sys_nice", "--ipc=host", image, "--model-id", model_id, *e["args"]]
    if job.world_size > 1:
        words += ["--sharded", "true", "--num-shard", str(job.world_size)]
    plan.commands.append(words)
    plan.notes.append("INC may write scale files beside the measurement in the mounted hqt_output directory.")
    return plan


# How every hand-off script starts: `handoff -o` replaces only a file that begins so.
SCRIPT_HEAD = "#!/usr/bin/env bash\n# hqtflow handoff "


def render_script(plan: Plan, *, target: str, source: str) -> str:
    lines = [f"{SCRIPT_HEAD}{source} --to {target}: generated, never run by hqtflow (no Gaudi here); paths and "
             "QUANT_CONFIG checked.", "set -euo pipefail"]
    if target == "optimum-habana":
        lines.append('cd "${OPTIMUM_HABANA_EXAMPLES:-optimum-habana/examples/text-generation}"')
    lines += [f"# {n}" for n in plan.notes]
    lines += [shell_line(c) for c in plan.commands]
    return "\n".join(lines) + "\n"


def default_dir(job: Job, script: Path | None) -> Path:
    """The QUANT_CONFIG copies' folder when --dir is not given: beside the script, named after it (`run/` for
    `run.sh`), or `NAME-handoff` where that name is the artifact's own folder (`-o out/scales.sh` for `out/scales`)."""
    if script is None:
        return Path("hqtflow-handoff")
    folder, src = script.with_suffix(""), job.artifact.directory if job.artifact is not None else None
    inside = src is not None and folder.resolve().is_relative_to(src)
    return folder.with_name(f"{folder.name}-handoff") if inside else folder


def check_outside_artifact(job: Job, *paths: Path | None) -> None:
    """Refuse a hand-off output inside the artifact it reads: the artifact is never edited."""
    src = job.artifact.directory if job.artifact is not None else None
    for p in paths:
        if src is not None and p is not None and Path(p).resolve().is_relative_to(src):
            raise ArtifactError(f"{p} lies inside the artifact {src}, which is never edited; write the hand-off elsewhere.")


def write_handoff(plan: Plan, handoff_dir: Path) -> None:
    """Create the directories and write the QUANT_CONFIG copies the commands name (atomically)."""
    from hqtflow.formats.artifact import write_json_atomic

    handoff_dir = Path(handoff_dir)
    try:
        for d in plan.dirs:
            (handoff_dir / d).mkdir(parents=True, exist_ok=True)
        for rel, cfg in plan.configs.items():
            write_json_atomic(handoff_dir / rel, cfg)
    except OSError as e:
        raise ArtifactError(f"Cannot write the hand-off directory {handoff_dir} ({e.strerror}).") from None


def check_script_path(path: Path) -> None:
    """An existing file at the script's path is replaced only when an earlier hand-off wrote it."""
    if not os.path.lexists(path):
        return
    try:
        ours = path.is_file() and not path.is_symlink() and path.open("rb").read(len(SCRIPT_HEAD)) == SCRIPT_HEAD.encode()
    except OSError:
        ours = False
    if not ours:
        raise ArtifactError(f"Cannot write the script {path}: it exists and is not an earlier hqtflow hand-off script; "
                            "remove it or pick another path.")


def write_script(text: str, path: Path) -> None:
    from hqtflow.formats.artifact import write_text_atomic

    try:
        write_text_atomic(path, text, executable=True)
    except OSError as e:
        raise ArtifactError(f"Cannot write the script {path} ({e.strerror}).") from None

