"""YAML recipes: one file per model and card count naming everything a run needs.

Keys (all optional except `model`): version (the recipe schema, 1; a newer one is refused), name, model, model_type, cards, dtype, config, calibration {tasks,
include_path, data_dir, text, text_field, limit}, batch_size, max_length, output, quant_config, eval {tasks,
include_path, data_dir, limit, ppl_file, ppl_windows, batch_size} (for `hqtflow run`), gaudi (the optimum-habana /
TGI-Gaudi commands of `hqtflow handoff`, see hqtflow/handoff.py), notes.
Relative paths of inputs (config, calibration files, include paths, data dir) are resolved against the recipe's
own directory; `output` is relative to where you run hqtflow. CLI flags override recipe values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hqtflow.errors import ConfigError

RECIPE_VERSION = 1
TOP_KEYS = {"version", "name", "model", "model_type", "cards", "dtype", "config", "calibration", "batch_size",
            "max_length", "output", "quant_config", "kv_cache", "eval", "gaudi", "notes"}
EVAL_KEYS = {"tasks", "include_path", "data_dir", "limit", "ppl_file", "ppl_windows", "batch_size"}
CAL_KEYS = {"tasks", "include_path", "data_dir", "text", "text_field", "limit"}


def merge_flags(recipe_settings: dict[str, Any] | None, flags: dict[str, Any]) -> dict[str, Any]:
    """The one recipe/flag merge (`measure --recipe`, `run`): MeasureSettings keyword arguments from the recipe's
    values, each overridden by a flag that was given (not None). An output directory is required."""
    values = {k: v for k, v in (recipe_settings or {}).items() if v is not None}
    values.update({k: v for k, v in flags.items() if v is not None})
    if not values.get("output"):
        raise ConfigError("No output directory: pass -o DIR (or set `output` in the recipe).")
    return values


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read a recipe into MeasureSettings keyword arguments (plus `name`, `model_type`, `quant_config`)."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Recipe {path} does not exist.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"Recipe {path} is not valid YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"Recipe {path} must be a YAML mapping.")
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(f"Recipe {path} has unknown key(s) {', '.join(sorted(unknown))}; valid keys are {', '.join(sorted(TOP_KEYS))}.")
    version = raw.get("version", RECIPE_VERSION)
    if version != RECIPE_VERSION or isinstance(version, bool):
        raise ConfigError(f"Recipe {path} has version {version!r}; this hqtflow reads recipe version {RECIPE_VERSION}.")
    cal = raw.get("calibration") or {}
    if not isinstance(cal, dict):
        raise ConfigError(f"Recipe {path}: 'calibration' must be a mapping.")
    unknown = set(cal) - CAL_KEYS
    if unknown:
        raise ConfigError(f"Recipe {path}: 'calibration' has unknown key(s) {', '.join(sorted(unknown))}; valid keys are {', '.join(sorted(CAL_KEYS))}.")
    base = path.parent

    def rel(p: str | None) -> str | None:
        if p is None:
            return None
        if not isinstance(p, str):
            raise ConfigError(f"Recipe {path}: expected a path, got {p!r}.")
        q = Path(p).expanduser()
        return str(q if q.is_absolute() else (base / q).resolve())

    def as_list(key: str, value: Any) -> list:
        if value is None:
            return []
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()] if key == "tasks" else [value]
        if not isinstance(value, list):
            raise ConfigError(f"Recipe {path}: '{key}' must be a list.")
        return value

    out: dict[str, Any] = {
        "model": raw.get("model"),
        "config": rel(raw.get("config")),
        "tasks": tuple(as_list("tasks", cal.get("tasks"))),
        "include_path": tuple(rel(p) for p in as_list("include_path", cal.get("include_path"))),
        "data_dir": rel(cal.get("data_dir")),
        "text": tuple(rel(p) for p in as_list("text", cal.get("text"))),
        "text_field": cal.get("text_field", "text"),
        "limit": cal.get("limit"),
        "batch_size": raw.get("batch_size", 8),
        "max_length": raw.get("max_length", 512),
        "tp": raw.get("cards", 1),
        "dtype": raw.get("dtype", "bf16"),
        "output": raw.get("output"),
        "recipe": str(path),
    }
    labels = {"tp": "cards", "limit": "calibration.limit"}
    for key in ("limit", "batch_size", "max_length", "tp"):
        v = out[key]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"Recipe {path}: '{labels.get(key, key)}' must be a positive integer, not {v!r}.")
    for key in ("tasks",):
        if not all(isinstance(t, str) for t in out[key]):
            raise ConfigError(f"Recipe {path}: 'calibration.{key}' must be a list of names.")
    ev = raw.get("eval") or {}
    if not isinstance(ev, dict) or set(ev) - EVAL_KEYS:
        raise ConfigError(f"Recipe {path}: 'eval' must be a mapping with keys among {', '.join(sorted(EVAL_KEYS))}.")
    eval_settings = {
        "tasks": tuple(as_list("tasks", ev.get("tasks"))),
        "include_path": tuple(rel(p) for p in as_list("include_path", ev.get("include_path"))),
        "data_dir": rel(ev.get("data_dir")),
        "limit": ev.get("limit"),
        "ppl_file": rel(ev.get("ppl_file")),
        "ppl_windows": ev.get("ppl_windows"),
        "batch_size": ev.get("batch_size", out["batch_size"]),
    }
    from hqtflow.choices import KVCache, parse

    kv = str(parse(KVCache, raw.get("kv_cache", "bf16"), f"Recipe {path}: kv_cache"))
    meta = {"name": raw.get("name", path.stem), "model_type": raw.get("model_type"),
            "quant_config": rel(raw.get("quant_config")), "kv_cache": kv, "eval": eval_settings,
            "gaudi": raw.get("gaudi")}
    return {"settings": out, "meta": meta}
