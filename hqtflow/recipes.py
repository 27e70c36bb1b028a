"""YAML recipes: one file per model and card count naming everything a run needs, read into a typed `Recipe`.

A recipe has a section per stage, whose fields are the stage settings' own (the YAML layout stays flat where it
always was):

- measure (MeasureSettings): model, config, cards (-> tp), dtype, batch_size, max_length, output, and the
  `calibration` mapping {tasks, include_path, data_dir, text, text_field, limit};
- quantize (QuantizeSettings): quant_config (-> config), kv_cache, gptq (true: measure also records Hessians and
  quantize rounds the weights with GPTQ);
- eval (`hqtflow run`'s run_eval): the `eval` mapping {tasks, include_path, data_dir, limit, ppl_file, ppl_windows,
  batch_size (default: the measurement's), kv_cache (default: quantize's, the cache the checkpoint is made for)};
- gaudi: the optimum-habana / TGI-Gaudi commands of `hqtflow handoff` (checked there, see hqtflow/handoff.py);
- and version (the recipe schema, 1; a newer one is refused), name (default: the file's stem), model_type, notes.

Relative paths of inputs (model, config, quant_config, calibration files, include paths, data dirs, ppl_file) are
resolved against the recipe's own directory (a `model` that is no folder there is a bundled name, a hub id, or a folder
from where you run hqtflow, as `-m` takes it); `output` is relative to where you run hqtflow. CLI flags override recipe values
through `measure_settings`, the one merge of `measure --recipe` and `run`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from hqtflow.choices import KVCache, parse
from hqtflow.errors import ConfigError, brief, not_a_file, parse_problem
from hqtflow.measure.settings import MeasureSettings
from hqtflow.quantize.settings import QuantizeSettings
from hqtflow.task_yaml import is_task_file

RECIPE_VERSION = 1


def _value(kind: str, default: Any = None):
    """A section field read from YAML as `kind`: text, path, paths, names, count, flag or kv_cache."""
    return field(default=default, metadata={"kind": kind})


@dataclass(frozen=True)
class MeasureSection:
    """The recipe's measurement: MeasureSettings keyword arguments (defaults: MeasureSettings')."""

    model: str | None = _value("model")
    config: str | None = _value("config")
    tasks: tuple[str, ...] = _value("names", ())
    include_path: tuple[str, ...] = _value("paths", ())
    data_dir: str | None = _value("path")
    text: tuple[str, ...] = _value("paths", ())
    text_field: str = _value("text", MeasureSettings.text_field)
    limit: int | None = _value("count")
    batch_size: int = _value("count", MeasureSettings.batch_size)
    max_length: int | None = _value("count")  # given here: explicit, as --max-length (None: the model's context, up to 512)
    tp: int = _value("count", MeasureSettings.tp)
    dtype: str = _value("dtype", MeasureSettings.dtype)
    output: str | None = _value("text")


@dataclass(frozen=True)
class QuantizeSection:
    """The recipe's quantization: QuantizeSettings' config (the QUANTIZE QUANT_CONFIG), kv_cache and gptq."""

    config: str | None = _value("config")
    kv_cache: KVCache = _value("kv_cache", KVCache(QuantizeSettings.kv_cache))
    gptq: bool = _value("flag", QuantizeSettings.gptq)

    def settings(self, measurement: str, output: str, **more: Any) -> QuantizeSettings:
        return QuantizeSettings(measurement=measurement, output=output, config=self.config,
                                kv_cache=self.kv_cache.value, gptq=self.gptq, **more)


@dataclass(frozen=True)
class EvalSection:
    """What `hqtflow run` evaluates the checkpoint on (run_eval's keyword arguments)."""

    tasks: tuple[str, ...] = _value("names", ())
    include_path: tuple[str, ...] = _value("paths", ())
    data_dir: str | None = _value("path")
    limit: int | None = _value("count")
    ppl_file: str | None = _value("path")
    ppl_windows: int | None = _value("count")
    batch_size: int | None = _value("count")  # None in YAML: the measurement's batch size
    kv_cache: KVCache | None = _value("kv_cache")  # None: the quantize section's (`kv_cache_for`)

    @property
    def empty(self) -> bool:
        return not self.tasks and not self.ppl_file

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Recipe:
    """One recipe file, checked: its sections, and what describes it (`path` is the file, as given)."""

    path: str
    name: str
    version: int = RECIPE_VERSION
    model_type: str | None = None
    notes: str | None = None
    measure: MeasureSection = MeasureSection()
    quantize: QuantizeSection = QuantizeSection()
    eval: EvalSection = EvalSection()
    gaudi: Mapping[str, Any] | None = None


def kv_cache_for(recipe: Recipe) -> KVCache:
    """The KV cache `hqtflow run` scores the checkpoint with: the eval section's, else the one it is quantized for."""
    return recipe.eval.kv_cache or recipe.quantize.kv_cache


# YAML layout: a top-level key -> (section, field); a nested mapping -> its section (fields named as in YAML)
FLAT = {"model": ("measure", "model"), "config": ("measure", "config"), "cards": ("measure", "tp"),
        "dtype": ("measure", "dtype"), "batch_size": ("measure", "batch_size"),
        "max_length": ("measure", "max_length"), "output": ("measure", "output"),
        "quant_config": ("quantize", "config"), "kv_cache": ("quantize", "kv_cache"), "gptq": ("quantize", "gptq")}
NESTED = {"calibration": ("measure", ("tasks", "include_path", "data_dir", "text", "text_field", "limit")),
          "eval": ("eval", tuple(f.name for f in fields(EvalSection)))}
META = ("version", "name", "model_type", "notes", "gaudi")
TOP_KEYS = {*FLAT, *NESTED, *META}
SECTIONS = {"measure": MeasureSection, "quantize": QuantizeSection, "eval": EvalSection}


def merge_flags(recipe_values: Mapping[str, Any] | None, flags: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's values, each overridden by a flag that was given (not None). An output directory is required."""
    values = {k: v for k, v in (recipe_values or {}).items() if v is not None}
    values.update({k: v for k, v in flags.items() if v is not None})
    if not values.get("output"):
        raise ConfigError("No output directory: pass -o DIR (or set `output` in the recipe).")
    return values


def measure_settings(recipe: Recipe | None, flags: Mapping[str, Any], **fixed: Any) -> MeasureSettings:
    """MeasureSettings of `measure [--recipe]` and `run`: the recipe's measure section (if any), flags over it
    (a recipe with `gptq: true` records the Hessians its quantization needs)."""
    values = {**asdict(recipe.measure), "hessians": recipe.quantize.gptq or None, "recipe": recipe.path} \
        if recipe is not None else None
    return MeasureSettings(**merge_flags(values, flags), **fixed)


def _encodable(path: str) -> bool:
    """Text that can be written out and named in the file system (a lone surrogate cannot be encoded)."""
    try:
        os.fsencode(path)
    except UnicodeError:
        return False
    return True


def _nul_at(raw: dict) -> str | None:
    """The label of the first key or string value in `raw` holding a NUL ("gaudi.measure[0].args"), or None.
    Iterative, each list or mapping visited once (YAML aliases share them)."""
    stack, seen = [(raw, "")], set()
    while stack:
        value, where = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            label = f"{where}[{k}]" if isinstance(value, list) else f"{where}.{k}" if where else str(k)
            if "\0" in label or isinstance(v, str) and "\0" in v:
                return label.replace("\0", "\\0")
            if isinstance(v, (dict, list)):
                stack.append((v, label))
    return None


class _DuplicateKey(Exception):
    pass


def _unique_key_loader():
    """yaml's SafeLoader, except that a mapping giving a key twice is refused (plain YAML keeps the last one).
    Merge keys (`<<: *defaults`) are SafeLoader's: a key given beside them overrides the merged one."""
    import yaml

    class Loader(yaml.SafeLoader):
        checked: set[int]  # mappings checked before SafeLoader flattened their merges into them (in place)

        def construct_mapping(self, node, deep=False):
            self.refuse_duplicates(node, deep)
            return super().construct_mapping(node, deep=deep)

        def refuse_duplicates(self, node, deep):
            if not hasattr(self, "checked"):
                self.checked = set()
            if id(node) in self.checked:  # (a merged-in key and its override would now both be listed)
                return
            self.checked.add(id(node))
            seen = set()
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # each merged mapping is checked on its own
                    merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                    for m in merged:
                        if isinstance(m, yaml.MappingNode):
                            self.refuse_duplicates(m, deep)
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise _DuplicateKey(f"the key '{key}' twice (again at line {key_node.start_mark.line + 1})")
                    seen.add(key)
                except TypeError:  # an unhashable key: SafeLoader's own error below names it
                    pass

    return Loader


def load_recipe(path: str | Path) -> Recipe:
    """Read and check a recipe file (one sentence, a ConfigError, for what is wrong)."""
    import yaml

    from hqtflow import bundled

    path = bundled.resolve(path, bundled.RECIPES, ".yaml")
    if not path.is_file():
        raise ConfigError(f"Recipe {path} {not_a_file(path)}{bundled.hint(path, bundled.RECIPES, '.yaml')}.")
    try:
        raw = yaml.load(path.read_text(), Loader=_unique_key_loader())
    except (yaml.YAMLError, RecursionError, ValueError) as e:  # ValueError: undecodable, or an int of 4301+ digits
        raise ConfigError(f"Recipe {path} is not valid YAML ({parse_problem(e)}).") from None
    except _DuplicateKey as e:
        raise ConfigError(f"Recipe {path} gives {e}; keep one.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"Recipe {path} must be a YAML mapping.")
    if (label := _nul_at(raw)) is not None:
        raise ConfigError(f"Recipe {path}: '{label}' holds a NUL character, which no path, name or argument can hold.")
    _refuse_unknown(f"Recipe {path} has", raw, TOP_KEYS)
    _check_version(path, raw.get("version", RECIPE_VERSION))
    read = _Reader(path)
    entries: dict[str, dict[str, tuple[str, Any]]] = {name: {} for name in SECTIONS}  # field -> (YAML label, value)
    for key, value in raw.items():
        if key in FLAT:
            section, name = FLAT[key]
            entries[section][name] = (key, value)
        elif key in NESTED and value is not None:
            section, names = NESTED[key]
            if not isinstance(value, dict):
                raise ConfigError(f"Recipe {path}: '{key}' must be a mapping.")
            _refuse_unknown(f"Recipe {path}: '{key}' has", value, set(names))
            entries[section].update({k: (f"{key}.{k}", v) for k, v in value.items()})
    sections = {name: read.section(cls, entries[name]) for name, cls in SECTIONS.items()}
    if sections["eval"].batch_size is None:
        sections["eval"] = EvalSection(**{**asdict(sections["eval"]), "batch_size": sections["measure"].batch_size})
    return Recipe(path=str(path), name=read.one("text", "name", raw.get("name")) or path.stem,
                  version=raw.get("version", RECIPE_VERSION), model_type=read.one("text", "model_type", raw.get("model_type")),
                  notes=read.one("text", "notes", raw.get("notes")), gaudi=raw.get("gaudi"), **sections)


def _refuse_unknown(where: str, mapping: dict, valid: set[str]) -> None:
    unknown = set(map(str, mapping)) - valid
    if unknown:
        raise ConfigError(f"{where} unknown key(s) {', '.join(sorted(unknown))}; valid keys are {', '.join(sorted(valid))}.")


def _check_version(path: Path, version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"Recipe {path}: 'version' must be a positive integer, not {brief(version)}.")
    if version > RECIPE_VERSION:
        raise ConfigError(f"Recipe {path} has version {version}; this hqtflow reads recipe version {RECIPE_VERSION} "
                          "(a newer hqtflow wrote it: upgrade to read it).")


def with_data_dir(recipe: Recipe, data_dir: str | Path) -> Recipe:
    """The recipe with its data in `data_dir`: the calibration's and eval's data_dir, and its text and ppl files
    taken by name from there (`run --data-dir`: a bundled recipe's data is the checkout's, not the package's)."""
    from hqtflow.errors import CalibrationError, not_there

    if not Path(data_dir).expanduser().is_dir():
        why = "is not a directory" if Path(data_dir).expanduser().exists() else not_there(data_dir)
        raise CalibrationError(f"--data-dir {data_dir} {why}.")
    d = Path(data_dir).expanduser().resolve()
    m, e = recipe.measure, recipe.eval
    return replace(recipe, measure=replace(m, data_dir=str(d), text=tuple(str(d / Path(t).name) for t in m.text)),
                   eval=replace(e, data_dir=str(d), ppl_file=str(d / Path(e.ppl_file).name) if e.ppl_file else None))


class _Reader:
    """Checks and converts one recipe's YAML values by kind; paths are resolved against the recipe's folder."""

    def __init__(self, path: Path):
        self.file, self.base = path, path.parent

    def section(self, cls: type, entries: dict[str, tuple[str, Any]]):
        kinds = {f.name: f.metadata["kind"] for f in fields(cls)}
        values = {name: self.one(kinds[name], label, value) for name, (label, value) in entries.items()}
        return cls(**{k: v for k, v in values.items() if v is not None})

    def one(self, kind: str, label: str, value: Any) -> Any:
        if value is None:
            return None
        return getattr(self, kind)(label, value)

    def fail(self, label: str, what: str, value: Any):
        raise ConfigError(f"Recipe {self.file}: '{label}' must be {what}, not {brief(value)}.")

    def text(self, label: str, value: Any) -> str:
        if not isinstance(value, str):
            self.fail(label, "a string", value)
        return value if _encodable(value) else self.fail(label, "valid text (it holds a lone surrogate)", value)

    def count(self, label: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.fail(label, "a positive integer", value)
        return value

    def flag(self, label: str, value: Any) -> bool:
        return value if isinstance(value, bool) else self.fail(label, "true or false", value)

    def dtype(self, label: str, value: Any) -> str:
        from hqtflow.choices import HP_DTYPES, valid_values

        return value if isinstance(value, str) and value in HP_DTYPES else self.fail(label, valid_values(HP_DTYPES), value)

    def model(self, label: str, value: Any) -> str:
        """A model folder beside the recipe (its path, resolved), else the text as `-m` takes it (a bundled name such
        as `smollm2`, a hub id, a folder from the current directory); a relative path naming a folder both beside the
        recipe and from the current directory, two different ones, is refused as ambiguous."""
        value = self.text(label, value)
        p = Path(value).expanduser()
        if p.is_absolute() or not (self.base / p).exists():
            return value
        beside = self.path(label, value)
        if p.exists() and p.resolve() != Path(beside):
            raise ConfigError(f"Recipe {self.file}: '{label}' {value} names {beside} (beside the recipe, where a recipe's "
                              f"paths are resolved) and {p.resolve()} (from the current directory); give an absolute path.")
        return beside

    def kv_cache(self, label: str, value: Any) -> KVCache:
        return parse(KVCache, value, f"Recipe {self.file}: {label}")

    def path(self, label: str, value: Any) -> str:
        if not isinstance(value, str) or "\0" in value or not _encodable(value):  # NUL: no file name holds one
            self.fail(label, "a path", value)
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else (self.base / p).resolve())

    def config(self, label: str, value: Any) -> str:
        """A QUANT_CONFIG: a path (from the recipe's folder), or, when no such file is there, a bundled one's bare name
        (`maxabs_quant`), so a copied recipe needs no path into hqtflow's package."""
        from hqtflow import bundled

        p = Path(self.path(label, value))
        named = bundled.CONFIGS / f"{Path(value).name.removesuffix('.json')}.json"
        return str(named if not p.is_file() and len(Path(value).parts) == 1 and named.is_file() else p)

    def paths(self, label: str, value: Any) -> tuple[str, ...]:
        return tuple(self.path(label, v) for v in self._list(label, value))

    def names(self, label: str, value: Any) -> tuple[str, ...]:
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else self._list(label, value)
        if not all(isinstance(v, str) for v in items):
            self.fail(label, "a list of names", value)
        return tuple(self.path(label, v) if is_task_file(v) else v for v in items)  # a task YAML's path: a path

    def _list(self, label: str, value: Any) -> list:
        if isinstance(value, str):
            return [value]
        return value if isinstance(value, list) else self.fail(label, "a list", value)
