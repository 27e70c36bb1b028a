"""The compressed-tensors FP8 layout (what llm-compressor writes and vLLM prefers), written and read by hqtflow;
beside it, the `quantization_config` of the other layouts `hqtflow export` writes: AutoFP8 / vLLM `fp8` (also read)
and Neural Compressor's `save(format="huggingface")` (INC reads it; hqtflow refuses to run it).

Per quantized Linear: `weight` float8_e4m3fn [out, in], `weight_scale` ([1] per tensor or [out, 1] per channel,
W ~ weight * weight_scale), and, for static activations, `input_scale` [1]. config.json carries
`quantization_config` (quant_method compressed-tensors, format float-quantized) with an `ignore` list.
"""

from __future__ import annotations

import re

from hqtflow.errors import ArtifactError, regex_problem


KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                   "strategy": "tensor"}


# Top-level key of quantization_config (compressed-tensors ignores unknown top-level keys; transformers and vLLM
# then quantize activations per token with amax / 448): the rule of Neural Compressor's dynamic methods, which
# hqtflow's loader applies instead (backoff 0.5, power-of-two scales).
INC_DYNAMIC_KEY = "hqtflow_dynamic_activations"


def quantization_config(*, per_channel: bool, static_input: bool, ignore: list[str], kv_cache: bool = False,
                        dynamic: str | None = None, inc_rule: dict | None = None) -> dict:
    """`dynamic`: "token" or "tensor" for activations quantized at run time (`dynamic: true`); `inc_rule`: the
    INC dynamic rule ({"scale_method", "backoff", "rounding"}) written under INC_DYNAMIC_KEY."""
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
           "strategy": "channel" if per_channel else "tensor"}
    activations = {**fp8, "strategy": "tensor"} if static_input else None
    if dynamic is not None:
        activations = {**fp8, "dynamic": True, "strategy": dynamic}
    extra = {INC_DYNAMIC_KEY: dict(inc_rule)} if inc_rule else {}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp8, "input_activations": activations,
                                      "output_activations": None, "format": "float-quantized"}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": dict(KV_CACHE_SCHEME) if kv_cache else None,
        **extra,
    }


UNSUPPORTED = ("int8/int4 weights or activations, asymmetric (zero-point) quantization, group-wise weights, "
               "several config groups, packed/NVFP4/MXFP formats, output-activation and KV-cache quantization")


def parse_quantization_config(qc: dict) -> dict:
    """What hqtflow's runtime needs from an FP8 config (compressed-tensors, or AutoFP8/vLLM `quant_method: fp8`).

    Returns `per_channel`, `static_input`, `ignore` (as before) and: `strategy` ("tensor" | "channel" | "block"),
    `block_size` ((b0, b1) or None), `activation` ("static" | "dynamic_token" | "dynamic_tensor" |
    "dynamic_group" | None), `group_size`, `method` ("compressed-tensors" | "fp8"), `kv_cache` (True when the
    config names static per-tensor FP8 KV-cache scales: `k_scale`/`v_scale` on the attention modules, used by
    the static decoder's FP8 KV cache). Anything else is named and refused.
    """
    if not isinstance(qc, dict):
        raise ArtifactError(f"config.json's quantization_config is not an object ({type(qc).__name__}).")
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
        raise ArtifactError(f"config.json's quantization_config.ignore must be a list of module names, not {ignore!r:.80}.")
    if qc.get("quant_method") == "compressed-tensors":
        for entry in ignore:
            _pattern(entry, "ignore")
    try:
        return _parse(qc)
    except (AttributeError, TypeError, ValueError):  # a field of the wrong JSON type where an object or number belongs
        raise ArtifactError("config.json's quantization_config is malformed: a field has the wrong type (an object, "
                            "list or number where another belongs).") from None


def _target(t) -> bool:
    """A target hqtflow can honour: the Linear class, a module name (`model.layers.0.mlp.down_proj`, `lm_head`) or a
    `re:` pattern; not another layer class (`Conv2d`, `Embedding`: a capitalized name without dots)."""
    if not isinstance(t, str) or not t:
        return False
    if t.startswith("re:"):
        return bool(_pattern(t, "targets"))
    return t == "Linear" or not (t[0].isupper() and "." not in t)


def _parse(qc: dict) -> dict:
    method = qc.get("quant_method")
    if method == "fp8":
        return _parse_autofp8(qc)
    if method != "compressed-tensors":
        raise ArtifactError(f"Unsupported quantization method {method!r}; hqtflow reads compressed-tensors FP8 and AutoFP8 (quant_method fp8).")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ArtifactError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (one group).")
    g = groups[0]
    for fmt in (g.get("format"), qc.get("format")):
        if fmt not in (None, "float-quantized", "naive-quantized"):
            raise ArtifactError(f"Unsupported compressed-tensors format {fmt!r}; hqtflow reads float-quantized FP8 (unsupported: {UNSUPPORTED}).")
    targets = g.get("targets")
    if not (isinstance(targets, list) and targets and all(_target(t) for t in targets)):
        raise ArtifactError(f"Unsupported compressed-tensors targets {targets!r:.80}; hqtflow quantizes Linear layers "
                            "(targets: \"Linear\", module names, or \"re:\" module-name patterns).")
    w, a = g.get("weights") or {}, g.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ArtifactError(f"Unsupported weight scheme {w.get('type')}{w.get('num_bits')}; hqtflow reads FP8 (float, 8 bits).")
    if w.get("symmetric") is False or (a and a.get("symmetric") is False):
        raise ArtifactError("Asymmetric (zero-point) FP8 quantization is not supported; hqtflow reads symmetric FP8.")
    if w.get("dynamic"):
        raise ArtifactError("Dynamic weight quantization is not supported; hqtflow reads FP8 weights stored with their scales.")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ArtifactError(f"Unsupported weight strategy {strategy!r}; supported: tensor, channel, block.")
    block = None
    if strategy == "block":
        block = w.get("block_structure")
        if isinstance(block, str):  # older compressed-tensors: "128x128"
            block = [int(v) for v in block.lower().split("x")]
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
            raise ArtifactError(f"Block-wise weights need a block_structure [rows, cols], not {block!r}.")
        block = tuple(block)
    if g.get("output_activations"):
        raise ArtifactError("Output-activation quantization is not supported; hqtflow quantizes Linear inputs and weights.")
    activation, group_size = None, None
    if a is not None:
        if a.get("type") != "float" or a.get("num_bits") != 8:
            raise ArtifactError(f"Unsupported activation scheme {a.get('type')}{a.get('num_bits')}; hqtflow reads FP8 activations.")
        ast = a.get("strategy")
        if not a.get("dynamic"):
            if ast != "tensor":
                raise ArtifactError(f"Static {ast!r} input activations are not supported; static activations must be per tensor.")
            activation = "static"
        elif ast == "token":
            activation = "dynamic_token"
        elif ast == "tensor":
            activation = "dynamic_tensor"
        elif ast == "group" and isinstance(a.get("group_size"), int) and a["group_size"] > 0:
            activation, group_size = "dynamic_group", a["group_size"]
        else:
            raise ArtifactError(f"Dynamic {ast!r} input activations are not supported; supported: token, tensor, group.")
    return {"per_channel": strategy == "channel", "static_input": activation == "static",
            "ignore": list(qc.get("ignore") or []), "strategy": strategy, "block_size": block,
            "activation": activation, "group_size": group_size, "method": "compressed-tensors",
            "kv_cache": _kv_cache(qc.get("kv_cache_scheme")), "inc_rule": _inc_rule(qc.get(INC_DYNAMIC_KEY), activation)}


def _pattern(entry, key: str) -> bool:
    """True for a valid "re:" module-name pattern, False for a plain name; an invalid regex is refused."""
    if not (isinstance(entry, str) and entry.startswith("re:")):
        return False
    if (problem := regex_problem(entry[3:])) is not None:
        raise ArtifactError(f"config.json's quantization_config.{key} entry {entry!r:.80} is not a valid regex ({problem}).")
    return True


def _kv_cache(scheme) -> bool:
    """True for static per-tensor FP8 KV-cache scales (the only KV-cache scheme hqtflow runs), False for none."""
    if scheme is None:
        return False
    if not (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
            and not scheme.get("dynamic") and scheme.get("symmetric") is not False
            and scheme.get("strategy") in (None, "tensor")):
        raise ArtifactError(f"Unsupported quantization_config.kv_cache_scheme {scheme!r:.120}; hqtflow reads static "
                            "per-tensor FP8 KV-cache scales (type float, num_bits 8, strategy tensor).")
    return True


def ignored_fp8_layer(qc: dict, layers: list[str]) -> str | None:
    """The first FP8-quantized layer that the config's ignore list names (as compressed-tensors matches: an exact
    name, a "re:" pattern matched from the start, or the class name Linear), or None."""
    ct = qc["method"] == "compressed-tensors"
    for name in layers:
        for entry in qc["ignore"]:
            if entry == name or ct and (entry == "Linear" or entry.startswith("re:") and re.match(entry[3:], name)):
                return name
    return None


def _inc_rule(raw, activation: str | None) -> dict | None:
    """The INC dynamic rule a checkpoint names (checked), or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or activation not in ("dynamic_token", "dynamic_tensor") or \
            raw.get("rounding") not in ("IDENTITY", "POW2") or not isinstance(raw.get("backoff"), (int, float)) or \
            not 0 < raw["backoff"] <= 1:
        raise ArtifactError(f"{INC_DYNAMIC_KEY} must be {{scale_method, backoff in (0, 1], rounding IDENTITY|POW2}} "
                            f"on dynamic token/tensor activations, not {raw!r}.")
    return {"scale_method": str(raw.get("scale_method")), "backoff": float(raw["backoff"]), "rounding": raw["rounding"]}


def autofp8_quantization_config(*, static: bool, ignore: list[str], kv_cache: bool = False) -> dict:
    """AutoFP8 / vLLM `quant_method: fp8` (read back by `_parse_autofp8`)."""
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "ignored_layers": sorted(ignore)}
    if kv_cache:
        qc["kv_cache_scheme"] = "static"
    return qc


def _parse_autofp8(qc: dict) -> dict:
    """AutoFP8 / vLLM `fp8`: scalar float32 scales; `weight_block_size` [b0, b1] for block-wise (DeepSeek style,
    scales possibly named `weight_scale_inv`, activations then dynamic per token and per b1 columns)."""
    if qc.get("fmt", "e4m3") not in ("e4m3", None):
        raise ArtifactError(f"Unsupported AutoFP8 fmt {qc.get('fmt')!r}; hqtflow reads e4m3 checkpoints.")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise ArtifactError(f"Unsupported activation_scheme {scheme!r}; supported: static, dynamic.")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
            raise ArtifactError(f"weight_block_size must be [rows, cols], not {block!r}.")
        if scheme == "static":
            raise ArtifactError("Block-wise FP8 weights with static activations are not supported (vLLM requires dynamic).")
        block = tuple(block)
    if block:
        activation, group_size = "dynamic_group", block[1]
    else:
        activation, group_size = ("static" if scheme == "static" else "dynamic_tensor"), None
    key = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
    ignore = qc.get(key) or []
    if not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
        raise ArtifactError(f"config.json's quantization_config.{key} must be a list of module names, not {ignore!r:.80}.")
    return {"per_channel": False, "static_input": activation == "static", "ignore": ignore,
            "strategy": "block" if block else "tensor", "block_size": block, "activation": activation,
            "group_size": group_size, "method": "fp8", "kv_cache": qc.get("kv_cache_scheme") is not None}


def inc_quantization_config(*, scale_method: str, hp_dtype: str, blocklist: list[str], base: dict | None = None) -> dict:
    """INC's FP8Config.to_dict() as `save(format="huggingface")` records it (mode LOAD, single device, QDQ)."""
    base = base or {}
    return {
        "non_tunable_params": ["white_list"],
        "dump_stats_path": base.get("dump_stats_path", "./hqt_output/measure"),
        "fp8_config": "E4M3",
        "hp_dtype": hp_dtype,
        "blocklist": {"types": list(base.get("blocklist", {}).get("types", [])), "names": sorted(blocklist)},
        "allowlist": {"types": list(base.get("allowlist", {}).get("types", [])),
                      "names": list(base.get("allowlist", {}).get("names", []))},
        "mode": "LOAD",
        "scale_method": scale_method,
        "scale_params": {},
        "observer": base.get("observer", "maxabs"),
        "mod_dict": {},
        "_json_file": None,  # INC records the temp file of its own run; its loader writes a fresh one
        "measure_exclude": base.get("measure_exclude", "OUTPUT"),
        "fake_quant": "False",
        "use_qdq": "True",
        "scale_format": "scalar",
        "measure_on_hpu": True,
        "recalc_scales": bool(base.get("recalc_scales", True)),
        "ignore_modules_wo_measures": bool(base.get("ignore_modules_wo_measures", False)),
        "calibration_sample_interval": int(base.get("calibration_sample_interval", 0)),
        "world_size": -1,
    }
