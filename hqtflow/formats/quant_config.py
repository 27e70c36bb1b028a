"""QUANT_CONFIG: the HQT / Neural Compressor FP8 JSON config, parsed into a frozen, validated dataclass.

Every key INC documents is understood; enum values match case-insensitively; the legacy spellings
`whitelist`/`blacklist`, `"method": "HOOKS"` and `quantize_weight` are accepted. Keys INC knows but
hqtflow does not use are kept verbatim (so a config round-trips to INC). A key nobody knows is an error:
a typo must not silently fall back to a default.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hqtflow.choices import HP_DTYPES as HP_DTYPE_MEMBERS
from hqtflow.errors import ConfigError, brief, not_a_file, parse_problem, regex_problem

MODES = ("MEASURE", "QUANTIZE", "LOAD", "NONE", "AUTO", "SHAPE")
OBSERVERS = ("maxabs", "maxabs_per_channel", "shape", "save")
MEASURE_OBSERVERS = ("maxabs", "maxabs_per_channel")  # those `hqtflow measure` runs (and records in its manifest)
SCALE_METHODS = (
    "unit_scale",
    "hw_aligned_single_scale",
    "maxabs_hw",
    "maxabs_pow2",
    "maxabs_arbitrary",
    "maxabs_hw_opt_weight",
    "maxabs_pow2_opt_weight",
    "act_maxabs_hw_weights_pcs_maxabs_pow2",
    "act_maxabs_pow2_weights_pcs_maxabs_pow2",
    "act_maxabs_hw_weights_pcs_opt_pow2",
    "act_maxabs_pow2_weights_pcs_opt_pow2",
    # Neural Compressor 3.10's dynamic methods (only with dynamic_quantization: true, as INC requires)
    "act_maxabs_pcs_pow2_weight_maxabs_pts_pow2_hw",
    "maxabs_pcs_pow2",
    # hqtflow's own (compressed-tensors FP8_DYNAMIC; not INC names: `not_in_inc`, handoff refuses them)
    "fp8_dynamic",
    "fp8_dynamic_mse",
    # the Habana Quantization Toolkit 1.17's SmoothQuant methods (not in INC 3.10; hqtflow folds the smoothing)
    "smoothquant_weights_output_channel_maxabs_pow2",
    "weaksmoothquant_weights_output_channel_maxabs_pow2",
    "smoothquant_opt",
)
INC_DYNAMIC_METHODS = ("act_maxabs_pcs_pow2_weight_maxabs_pts_pow2_hw", "maxabs_pcs_pow2")
FP8_FORMATS = ("E4M3", "E5M2")
HP_DTYPES = tuple(d.value for d in HP_DTYPE_MEMBERS)  # QUANT_CONFIG's hp_dtype, a measurement's model_dtype
MEASURE_EXCLUDES = ("NONE", "INPUT", "OUTPUT", "PARAMS", "ALL")
SCALE_FORMATS = ("scalar", "const")
DEVICES_FOR_SCALES = ("GAUDI2", "GAUDI3", "CPU", "CUDA")

# Inner keys of the dict form of `scale_method`.
GRANULARITIES = ("PTS", "PCS")
SCALE_VALUE_TYPES = ("MAXABS", "FIXED_VALUE", "OPT", "DUMMY_SCALES")
ROUNDING_METHODS = ("IDENTITY", "POW2", "HW_ALIGNED", "HW_ALIGNED_FIXED", "SCALE_UNIT")

# Keys INC's Fp8cfg knows that hqtflow passes through untouched.
INC_PASSTHROUGH_KEYS = frozenset(
    {
        "scale_params",
        "mod_dict",
        "local_rank",
        "global_rank",
        "world_size",
        "seperate_measure_files",
        "device_type",
        "measure_on_hpu",
        "row_parallel_linear_allreduce_quantization",
        "dynamic_quantization",
        "dump_stats_xlsx_path",
    }
)
LEGACY_KEYS = frozenset({"method", "quantize_weight", "whitelist", "blacklist"})


def _is_flag(value: Any) -> bool:
    """true/false as INC takes them: a JSON boolean or its text in any case."""
    return isinstance(value, bool) or isinstance(value, str) and value.lower() in ("true", "false")


# Their types (INC's Fp8cfg defaults): kept verbatim, still checked, so INC does not fail on them on the Gaudi host.
_RANK = (lambda x: x is None or isinstance(x, int) and not isinstance(x, bool) and x >= 0, "a whole number >= 0 or null")
_FLAG = (_is_flag, "true or false")
PASSTHROUGH_TYPES = {
    "scale_params": (lambda x: isinstance(x, dict), "an object"),
    "mod_dict": (lambda x: isinstance(x, dict), "an object"),
    "local_rank": _RANK, "global_rank": _RANK, "world_size": _RANK,
    "seperate_measure_files": _FLAG, "measure_on_hpu": _FLAG, "row_parallel_linear_allreduce_quantization": _FLAG,
    "dynamic_quantization": _FLAG,
    "device_type": (lambda x: isinstance(x, str), "a string"),
    "dump_stats_xlsx_path": (lambda x: isinstance(x, str) and bool(x), "a path"),
}
INC_DEVICES_FOR_SCALES = ("GAUDI2", "GAUDI3")  # the rest of DEVICES_FOR_SCALES are hqtflow's targets, not INC values


def for_inc(config: dict) -> tuple[dict, tuple[str, ...]]:
    """A QUANT_CONFIG dict as Neural Compressor 3.10 reads it, and notes on what was changed for it.

    INC takes what hqtflow accepts less kindly: optimum-habana tests `mode == "MEASURE"` as written, INC looks the
    observer up as written (files `<base>_hooks_<observer>...`) and tests passed-through flags for truth (the text
    "false" is true there). So the dict is rewritten in canonical spellings with JSON booleans; `device_type` (INC
    detects it and fails on a string) and hqtflow's own `device_for_scales` targets (CPU, CUDA) are dropped, so INC
    computes scales for the Gaudi it runs on. Legacy keys become their current spellings."""
    d = QuantConfig.from_dict(config, source="QUANT_CONFIG").to_dict()
    notes = []
    for key, value in d.items():
        if PASSTHROUGH_TYPES.get(key) is _FLAG and isinstance(value, str):
            d[key] = value.lower() == "true"
    if "device_type" in d:
        del d["device_type"]
        notes.append("device_type is detected by INC on the Gaudi it runs on (it fails on one given as text): "
                     "dropped from the QUANT_CONFIG written for INC")
    device = d.get("device_for_scales")
    if device is not None and device not in INC_DEVICES_FOR_SCALES:
        del d["device_for_scales"]
        notes.append(f"device_for_scales {device} is hqtflow's own target, which INC refuses: dropped from the "
                     "QUANT_CONFIG written for INC, which computes scales for the Gaudi it runs on")
    return d, tuple(notes)


def fitted_to_measurement(config: dict, observer: str, attention_measured: bool) -> tuple[dict, list[str]]:
    """A QUANTIZE config fitted to the measurement INC will read, and notes on what changed: the measurement's
    `observer` (INC opens `<base>_hooks_<observer>...` files), and `ignore_modules_wo_measures` where the measurement
    holds Linear layers only (made here, on Hugging Face modeling code): optimum-habana's attention modules (matmul_qk,
    k_cache, fused SDPA ...) then have no statistics, and INC on Gaudi would replace each by a module that fails when
    called. A Gaudi measurement of those modules (`attention_measured`) keeps the config's value."""
    notes = []
    given = config.get("observer", "maxabs")
    if str(given).lower() != observer:
        config = {**config, "observer": observer}
        notes.append(f"observer set to {observer}, the measurement's ({given} in the config): INC opens the files "
                     "named after it")
    if not attention_measured and str(config.get("ignore_modules_wo_measures", False)).lower() != "true":
        config = {**config, "ignore_modules_wo_measures": True}
        notes.append("ignore_modules_wo_measures set true: the measurement has Linear layers only, so INC keeps "
                     "optimum-habana's attention modules (matmul_qk, matmul_av, k_cache, v_cache, fused SDPA) in bf16 "
                     "instead of failing on them; measure on Gaudi (--mode measure) to quantize those too")
    return config, notes


def not_in_inc(scale_method: str | dict) -> str | None:
    """Why INC cannot run `scale_method` (hqtflow's own, or HQT 1.17's SmoothQuant), or None when it can."""
    if scale_method in ("fp8_dynamic", "fp8_dynamic_mse"):
        return f"scale_method {scale_method} is hqtflow's own (compressed-tensors FP8_DYNAMIC), which INC does not have"
    if isinstance(scale_method, str) and "smoothquant" in scale_method:
        return (f"scale_method {scale_method} is the Habana Quantization Toolkit 1.17's, which Neural Compressor 3.10 "
                "does not have")
    return None


def choice(key: str, value: Any, choices: tuple[str, ...], *, source: str) -> str:
    """Match `value` case-insensitively against `choices`; return the canonical spelling."""
    if isinstance(value, str):
        for c in choices:
            if c.lower() == value.lower():
                return c
    raise ConfigError(f"{source}: key '{key}' has value {value!r}; valid values are {', '.join(choices)}.")


class _RepeatedKey(Exception):
    pass


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict:
    """json's object hook: a key given twice is refused (json would keep the last one silently)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _RepeatedKey(k)
        out[k] = v
    return out


def _bool(key: str, value: Any, *, source: str) -> bool:
    if _is_flag(value):
        return value if isinstance(value, bool) else value.lower() == "true"
    raise ConfigError(f"{source}: key '{key}' has value {value!r}; valid values are true, false.")


@dataclass(frozen=True)
class ModuleFilter:
    """An allowlist or blocklist: module class names, and name regexes matched with re.search."""

    types: tuple[str, ...] = ()
    names: tuple[str, ...] = ()

    @classmethod
    def parse(cls, key: str, value: Any, *, source: str) -> ModuleFilter:
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key '{key}' must be an object with 'types' and/or 'names' lists.")
        unknown = set(value) - {"types", "names"}
        if unknown:
            raise ConfigError(f"{source}: key '{key}' has unknown entries {sorted(unknown)}; valid are types, names.")
        out = {}
        for k in ("types", "names"):
            items = value.get(k) or []
            if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
                raise ConfigError(f"{source}: '{key}.{k}' must be a list of strings, not {items!r}.")
            out[k] = tuple(items)
        for pattern in out["names"]:
            if (problem := regex_problem(pattern)) is not None:
                raise ConfigError(f"{source}: '{key}.names' has an invalid regex {pattern!r} ({problem}).")
        return cls(**out)

    def matches_name(self, name: str) -> bool:
        return any(re.search(p, name) for p in self.names)

    def is_empty(self) -> bool:
        return not self.types and not self.names


def _parse_scale_method(value: Any, *, source: str) -> str | dict:
    """A scale method name, or INC's dict form validated key by key."""
    if isinstance(value, str):
        return choice("scale_method", value, SCALE_METHODS, source=source)
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: key 'scale_method' must be a method name or an object, not {value!r}.")
    sections = {"default", "nodes", "layers", "layer_types"}
    unknown = set(value) - sections
    if unknown:
        raise ConfigError(f"{source}: 'scale_method' has unknown sections {sorted(unknown)}; valid are {sorted(sections)}.")

    def parse_pair(where: str, pair: Any) -> dict:
        if not isinstance(pair, dict) or not set(pair) <= {"weight", "activation"}:
            raise ConfigError(f"{source}: '{where}' must be an object with 'weight' and/or 'activation'.")
        return {kind: parse_leaf(f"{where}.{kind}", spec) for kind, spec in pair.items()}

    def parse_leaf(where: str, spec: Any) -> dict:
        if not isinstance(spec, dict):
            raise ConfigError(f"{source}: '{where}' must be an object.")
        enums = {"granularity": GRANULARITIES, "scale_value_type": SCALE_VALUE_TYPES, "rounding_method": ROUNDING_METHODS}
        out: dict[str, Any] = {}
        for k, v in spec.items():
            if k in enums:
                out[k] = choice(f"{where}.{k}", v, enums[k], source=source)
            elif k == "backoff":
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
                    raise ConfigError(f"{source}: '{where}.backoff' must be a number in (0, 1], not {v!r}.")
                out[k] = float(v)
            elif k == "params":
                if not isinstance(v, dict):
                    raise ConfigError(f"{source}: '{where}.params' must be an object.")
                out[k] = v
            else:
                valid = sorted([*enums, "backoff", "params"])
                raise ConfigError(f"{source}: '{where}' has unknown key {k!r}; valid keys are {', '.join(valid)}.")
        return out

    parsed: dict[str, Any] = {}
    if "default" in value:
        parsed["default"] = parse_pair("scale_method.default", value["default"])
    for section in ("nodes", "layers", "layer_types"):
        if section in value:
            if not isinstance(value[section], dict):
                raise ConfigError(f"{source}: 'scale_method.{section}' must be an object.")
            parsed[section] = {
                k: parse_pair(f"scale_method.{section}.{k}", v) for k, v in value[section].items()
            }
    return parsed


@dataclass(frozen=True)
class QuantConfig:
    """One QUANT_CONFIG. Field names and defaults follow Neural Compressor's Fp8cfg."""

    mode: str = "QUANTIZE"
    observer: str = "maxabs"
    scale_method: str | dict = "maxabs_hw"
    allowlist: ModuleFilter = field(default_factory=ModuleFilter)
    blocklist: ModuleFilter = field(default_factory=ModuleFilter)
    dump_stats_path: str = "./hqt_output/measure"
    fp8_config: str = "E4M3"
    hp_dtype: str = "bf16"
    measure_exclude: str = "OUTPUT"
    scale_format: str = "scalar"
    use_qdq: bool = False
    fake_quant: bool = False
    recalc_scales: bool = False
    ignore_modules_wo_measures: bool = False
    device_for_scales: str | None = None
    calibration_sample_interval: int = 0
    extra: dict = field(default_factory=dict)  # INC keys kept verbatim (see INC_PASSTHROUGH_KEYS)

    # ---- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any, *, source: str = "QUANT_CONFIG") -> QuantConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: a QUANT_CONFIG must be a JSON object, not {type(raw).__name__}.")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = set(raw) - known - INC_PASSTHROUGH_KEYS - LEGACY_KEYS
        if unknown:
            raise ConfigError(
                f"{source}: unknown key(s) {', '.join(sorted(unknown))}; valid keys are {', '.join(sorted(known))}."
            )
        for new, old in (("allowlist", "whitelist"), ("blocklist", "blacklist")):
            if new in raw and old in raw:
                raise ConfigError(f"{source}: both '{new}' and its legacy spelling '{old}' are set; keep one.")
        if "method" in raw and str(raw["method"]).upper() != "HOOKS":
            raise ConfigError(f"{source}: key 'method' has value {raw['method']!r}; valid values are HOOKS.")
        if "quantize_weight" in raw:
            _bool("quantize_weight", raw["quantize_weight"], source=source)

        v: dict[str, Any] = {}
        if "mode" in raw:
            v["mode"] = choice("mode", raw["mode"], MODES, source=source)
        if "observer" in raw:
            v["observer"] = choice("observer", raw["observer"], OBSERVERS, source=source)
        if "scale_method" in raw:
            v["scale_method"] = _parse_scale_method(raw["scale_method"], source=source)
        v["allowlist"] = ModuleFilter.parse("allowlist", raw.get("allowlist", raw.get("whitelist")), source=source)
        v["blocklist"] = ModuleFilter.parse("blocklist", raw.get("blocklist", raw.get("blacklist")), source=source)
        if "dump_stats_path" in raw:
            path = raw["dump_stats_path"]
            if not isinstance(path, str) or not path or path.endswith(("/", "\\")):
                raise ConfigError(f"{source}: key 'dump_stats_path' must be a path prefix like './hqt_output/measure', not {path!r}.")
            if "\0" in path or len(Path(path).name.encode()) > 200:  # the files add "_hooks_maxabs_0_8.json" to the name
                raise ConfigError(f"{source}: key 'dump_stats_path' must name files this file system can hold (no NUL "
                                  "byte, a last part of at most 200 bytes).")
            v["dump_stats_path"] = path
        for key, choices in (
            ("fp8_config", FP8_FORMATS),
            ("hp_dtype", HP_DTYPES),
            ("measure_exclude", MEASURE_EXCLUDES),
            ("scale_format", SCALE_FORMATS),
        ):
            if key in raw:
                v[key] = choice(key, raw[key], choices, source=source)
        if raw.get("device_for_scales") is not None:
            v["device_for_scales"] = choice("device_for_scales", raw["device_for_scales"], DEVICES_FOR_SCALES, source=source)
        for key in ("use_qdq", "fake_quant", "recalc_scales", "ignore_modules_wo_measures"):
            if key in raw:
                v[key] = _bool(key, raw[key], source=source)
        if "calibration_sample_interval" in raw:
            n = raw["calibration_sample_interval"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ConfigError(f"{source}: key 'calibration_sample_interval' must be an integer >= 0, not {n!r}.")
            v["calibration_sample_interval"] = n
        v["extra"] = {k: raw[k] for k in raw if k in INC_PASSTHROUGH_KEYS}
        for k, value in v["extra"].items():
            ok, what = PASSTHROUGH_TYPES[k]
            if not ok(value):
                raise ConfigError(f"{source}: key '{k}' has value {brief(value)}; it must be {what}.")
        dynamic = _bool("dynamic_quantization", raw["dynamic_quantization"], source=source) \
            if "dynamic_quantization" in raw else False
        if v.get("scale_method") in INC_DYNAMIC_METHODS and not dynamic:
            raise ConfigError(f"{source}: scale_method {v['scale_method']} is supported only with "
                              "dynamic_quantization: true (as in Neural Compressor).")
        return cls(**v)

    @classmethod
    def from_file(cls, path: str | Path) -> QuantConfig:
        from hqtflow import bundled

        path = bundled.resolve(path, bundled.CONFIGS, ".json")
        if not path.is_file():
            raise ConfigError(f"QUANT_CONFIG file {path} {not_a_file(path)}{bundled.hint(path, bundled.CONFIGS, '.json')}.")
        try:
            raw = json.loads(path.read_text(), object_pairs_hook=_no_repeated_keys)
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"QUANT_CONFIG file {path} is not valid JSON ({parse_problem(e)}).") from None
        except _RepeatedKey as e:
            raise ConfigError(f"QUANT_CONFIG file {path} gives key {e.args[0]!r} twice; keep one.") from None
        return cls.from_dict(raw, source=str(path))

    # ---- queries -------------------------------------------------------------------------------
    def selects(self, name: str, type_name: str) -> bool:
        """Whether module `name` of class `type_name` is measured/quantized (INC's allow/block semantics: a non-empty
        allowlist admits a module whose type is in its types *or* whose name matches one of its names)."""
        if not self.allowlist.is_empty() and type_name not in self.allowlist.types and not self.allowlist.matches_name(name):
            return False
        if type_name in self.blocklist.types or self.blocklist.matches_name(name):
            return False
        return True

    def check_rank_files(self, world: int, source: str) -> None:
        """INC reads one unsuffixed file on every rank when `seperate_measure_files` is false; a `world`-rank artifact
        has one file per rank, so the two cannot meet (with one rank the key changes nothing)."""
        if world > 1 and not self.extra.get("seperate_measure_files", True):
            raise ConfigError(f"{source}: seperate_measure_files false makes INC read one unsuffixed file on every rank, "
                              f"but this {world}-rank run writes one file per rank: drop the key (a measurement unified "
                              "to one rank, `hqtflow unify`, may keep it).")

    @property
    def measures_inputs(self) -> bool:
        return self.measure_exclude not in ("INPUT", "ALL")

    @property
    def measures_outputs(self) -> bool:
        return self.measure_exclude not in ("OUTPUT", "ALL")

    @property
    def measures_params(self) -> bool:
        return self.measure_exclude not in ("PARAMS", "ALL")

    @property
    def per_channel(self) -> bool:
        return self.observer == "maxabs_per_channel"

    @property
    def dynamic_quantization(self) -> bool:
        """INC's `dynamic_quantization` (activation scales computed at run time); checked when parsed."""
        v = self.extra.get("dynamic_quantization", False)
        return v if isinstance(v, bool) else str(v).lower() == "true"

    # ---- writing -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON INC reads (canonical spellings, no legacy keys)."""
        d = asdict(self)
        extra = d.pop("extra")
        d["allowlist"] = {"types": list(self.allowlist.types), "names": list(self.allowlist.names)}
        d["blocklist"] = {"types": list(self.blocklist.types), "names": list(self.blocklist.names)}
        if d["device_for_scales"] is None:
            del d["device_for_scales"]
        return {**d, **extra}

    def with_changes(self, **changes: Any) -> QuantConfig:
        return replace(self, **changes)
