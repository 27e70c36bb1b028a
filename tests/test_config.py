"""QUANT_CONFIG parsing: every documented key, case-insensitive enums, legacy keys, allow/block semantics."""

import json
from pathlib import Path

import pytest

from hqtflow.errors import ConfigError
from hqtflow.formats.quant_config import SCALE_METHODS, ModuleFilter, QuantConfig

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_follow_inc():
    c = QuantConfig.from_dict({})
    assert (c.mode, c.observer, c.scale_method, c.measure_exclude) == ("QUANTIZE", "maxabs", "maxabs_hw", "OUTPUT")
    assert (c.fp8_config, c.hp_dtype, c.dump_stats_path) == ("E4M3", "bf16", "./hqt_output/measure")
    assert c.measures_inputs and c.measures_params and not c.measures_outputs


def test_every_key_parses_case_insensitively():
    raw = {
        "mode": "measure", "observer": "MAXABS_PER_CHANNEL", "scale_method": "Maxabs_Pow2",
        "allowlist": {"types": ["Linear"], "names": ["mlp"]}, "blocklist": {"types": [], "names": ["lm_head"]},
        "dump_stats_path": "./out/measure", "fp8_config": "e5m2", "hp_dtype": "FP32", "measure_exclude": "none",
        "scale_format": "CONST", "use_qdq": "true", "fake_quant": False, "recalc_scales": "False",
        "ignore_modules_wo_measures": True, "device_for_scales": "gaudi2", "calibration_sample_interval": 3,
        "method": "hooks", "quantize_weight": False, "seperate_measure_files": True, "measure_on_hpu": False,
    }
    c = QuantConfig.from_dict(raw)
    assert c.mode == "MEASURE" and c.observer == "maxabs_per_channel" and c.scale_method == "maxabs_pow2"
    assert c.fp8_config == "E5M2" and c.hp_dtype == "fp32" and c.measure_exclude == "NONE"
    assert c.scale_format == "const" and c.use_qdq is True and c.recalc_scales is False
    assert c.ignore_modules_wo_measures is True and c.device_for_scales == "GAUDI2"
    assert c.calibration_sample_interval == 3 and c.measures_outputs and c.per_channel
    assert c.allowlist == ModuleFilter(("Linear",), ("mlp",))
    # INC keys hqtflow does not use survive a round trip, legacy ones are dropped
    d = c.to_dict()
    assert d["seperate_measure_files"] is True and d["measure_on_hpu"] is False
    assert "method" not in d and "quantize_weight" not in d
    assert QuantConfig.from_dict(d) == c


@pytest.mark.parametrize("name", SCALE_METHODS)
def test_every_scale_method_name(name):
    from hqtflow.formats.quant_config import INC_DYNAMIC_METHODS

    extra = {"dynamic_quantization": True} if name in INC_DYNAMIC_METHODS else {}
    assert QuantConfig.from_dict({"scale_method": name.upper(), **extra}).scale_method == name


def test_legacy_whitelist_blacklist():
    c = QuantConfig.from_dict({"whitelist": {"types": ["Linear"]}, "blacklist": {"names": ["lm_head"]}})
    assert c.allowlist.types == ("Linear",) and c.blocklist.names == ("lm_head",)
    with pytest.raises(ConfigError, match="legacy spelling"):
        QuantConfig.from_dict({"allowlist": {}, "whitelist": {}})


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"mode": "CALIBRATE"}, ["'mode'", "'CALIBRATE'", "MEASURE, QUANTIZE"]),
        ({"scale_method": "maxabs_fast"}, ["'scale_method'", "'maxabs_fast'", "maxabs_pow2"]),
        ({"observer": 3}, ["'observer'", "3", "maxabs_per_channel"]),
        ({"fp8_config": "E3M4"}, ["'fp8_config'", "'E3M4'", "E4M3, E5M2"]),
        ({"measure_exclude": "WEIGHTS"}, ["'measure_exclude'", "PARAMS"]),
        ({"use_qdq": "yes"}, ["'use_qdq'", "true, false"]),
        ({"device_for_scales": "gaudi9"}, ["'device_for_scales'", "GAUDI3"]),
        ({"calibration_sample_interval": -1}, ["calibration_sample_interval"]),
        ({"method": "TRACE"}, ["'method'", "HOOKS"]),
        ({"scale_methd": "maxabs_hw"}, ["unknown key", "scale_methd", "scale_method"]),
        ({"blocklist": {"names": ["("]}}, ["invalid regex"]),
        ({"blocklist": ["lm_head"]}, ["'blocklist'"]),
        ({"dump_stats_path": "out/"}, ["'dump_stats_path'"]),
    ],
)
def test_wrong_values_name_key_value_and_choices(raw, words):
    with pytest.raises(ConfigError) as e:
        QuantConfig.from_dict(raw, source="cfg.json")
    msg = str(e.value)
    assert msg.startswith("cfg.json: ") and "\n" not in msg
    for w in words:
        assert w in msg


def test_scale_method_dict_form():
    raw = {"scale_method": {
        "default": {"weight": {"granularity": "pcs", "rounding_method": "pow2", "backoff": 0.5},
                    "activation": {"granularity": "PTS", "scale_value_type": "maxabs", "rounding_method": "HW_ALIGNED"}},
        "layers": {"lm_head": {"weight": {"scale_value_type": "dummy_scales"}}},
    }}
    c = QuantConfig.from_dict(raw)
    assert c.scale_method["default"]["weight"] == {"granularity": "PCS", "rounding_method": "POW2", "backoff": 0.5}
    assert c.scale_method["layers"]["lm_head"]["weight"]["scale_value_type"] == "DUMMY_SCALES"
    with pytest.raises(ConfigError, match="rounding_method"):
        QuantConfig.from_dict({"scale_method": {"default": {"weight": {"rounding_method": "ROUND"}}}})
    with pytest.raises(ConfigError, match="backoff"):
        QuantConfig.from_dict({"scale_method": {"default": {"weight": {"backoff": 2}}}})


def test_allow_block_semantics():
    everything = QuantConfig.from_dict({})
    assert everything.selects("model.layers.0.mlp.up_proj", "Linear")
    by_type = QuantConfig.from_dict({"allowlist": {"types": ["Conv2d"]}})
    assert not by_type.selects("model.layers.0.mlp.up_proj", "Linear")
    # names are regexes matched with re.search (anywhere in the name)
    by_name = QuantConfig.from_dict({"allowlist": {"names": [r"mlp\.(up|down)"]}})
    assert by_name.selects("model.layers.3.mlp.up_proj", "Linear")
    assert not by_name.selects("model.layers.3.mlp.gate_proj", "Linear")
    blocked = QuantConfig.from_dict({"blocklist": {"names": ["self_attn", "lm_head"], "types": ["Embedding"]}})
    assert not blocked.selects("model.layers.0.self_attn.q_proj", "Linear")
    assert not blocked.selects("lm_head", "Linear")
    assert not blocked.selects("model.embed_tokens", "Embedding")
    assert blocked.selects("model.layers.0.mlp.down_proj", "Linear")
    # blocklist wins over allowlist
    both = QuantConfig.from_dict({"allowlist": {"names": ["mlp"]}, "blocklist": {"names": ["down"]}})
    assert both.selects("m.mlp.up_proj", "Linear") and not both.selects("m.mlp.down_proj", "Linear")


@pytest.mark.parametrize("path", sorted((ROOT / "quantization_config").glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    c = QuantConfig.from_file(path)
    raw = json.loads(path.read_text())
    assert c.mode == raw["mode"].upper()


def test_shipped_set_covers_hqt():
    names = {p.stem for p in (ROOT / "quantization_config").glob("*.json")}
    assert {"maxabs_measure", "maxabs_measure_include_outputs", "maxabs_quant", "maxabs_quant_mixtral",
            "maxabs_quant_phi", "unit_scale_quant", "pow2_quant"} <= names


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        QuantConfig.from_file(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{mode: MEASURE")
    with pytest.raises(ConfigError, match="not valid JSON"):
        QuantConfig.from_file(bad)
    arr = tmp_path / "arr.json"
    arr.write_text("[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        QuantConfig.from_file(arr)
