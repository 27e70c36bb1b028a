"""Per-layer rules: INC 3.10's dict `scale_method` (`default`, `nodes`, `layers`, `layer_types`), resolved per module
exactly as INC's own parser and `find_node_scale_method_config` resolve it, and used by quantize and the scale files."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import run_cli
from hqtflow.errors import ConfigError
from hqtflow.quantize.fp8_linear import FP8Linear
from hqtflow.scales import scale_rules

RULES = {
    "default": {"weight": {"rounding_method": "POW2", "backoff": 0.5},
                "activation": {"rounding_method": "POW2", "backoff": 0.25}},
    "nodes": {"model.layers.0.self_attn.q_proj": {"weight": {"rounding_method": "IDENTITY"},
                                                  "activation": {"rounding_method": "IDENTITY"}},
              "lm_head": {"weight": {"granularity": "PCS"}}},
    "layers": {"1": {"weight": {"granularity": "PCS", "scale_value_type": "OPT"}},
               "0": {"weight": {"granularity": "PCS"}, "activation": {"backoff": 0.5}}},
    "layer_types": {"Linear": {"weight": {"rounding_method": "HW_ALIGNED"}, "activation": {"rounding_method": "HW_ALIGNED"}}},
}
NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "model.layers.1.mlp.down_proj",
         "model.layers.2.self_attn.o_proj", "lm_head", "model/layers/1/mlp", "model.layers.12.mlp.up_proj", "head"]


def test_resolution_equals_inc(inc):
    from neural_compressor.torch.algorithms.fp8_quant._core.scale_methods.scale_method_config import (
        CfgStr, find_node_scale_method_config)
    from neural_compressor.torch.algorithms.fp8_quant._core.scale_methods.scale_method_parser import (
        convert_scale_method_strings_to_enum, parse_scale_method, validate_and_populate_scale_method)

    theirs = parse_scale_method(convert_scale_method_strings_to_enum(copy.deepcopy(RULES)))
    validate_and_populate_scale_method(theirs)
    ours = scale_rules(RULES)
    seen = set()
    for name in NAMES:
        for type_name in ("Linear", "Conv1D"):
            t = find_node_scale_method_config(theirs, name, type_name)
            o = ours(name, type_name)
            seen.add(o.name)
            for kind, rule in ((CfgStr.WEIGHT, o.weight), (CfgStr.ACTIVATION, o.activation)):
                c = t[kind]
                assert (rule.granularity, rule.value, rule.rounding, rule.backoff) == (
                    c.granularity.name, c.scale_value_type.name, c.rounding_method.name, c.backoff), (name, type_name, kind)
                if rule.value == "OPT":  # INC's entries share one params dict (aliasing); only OPT reads it
                    assert rule.candidates == tuple(float(v) for v in c.params["weight_scales"]), (name, kind)
    assert len(seen) >= 5  # every section is exercised


def test_refusals():
    with pytest.raises(ConfigError, match="not one of Neural Compressor's scale methods"):
        scale_rules({"default": {"weight": {"scale_value_type": "DUMMY_SCALES"}}})
    with pytest.raises(ConfigError, match="needs a 'default' section"):
        scale_rules({"nodes": {"lm_head": {"weight": {}}}})
    with pytest.raises(ConfigError, match="dynamic_quantization"):
        scale_rules({"default": {}, "nodes": {"a": {"weight": {"granularity": "PCS", "rounding_method": "POW2"},
                                                      "activation": {"granularity": "PCS", "rounding_method": "POW2"}}}})


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("rules") / "meas"
    assert run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "4", "--max-length", "64").exit_code == 0
    return out


CKPT_RULES = {"default": {"weight": {"rounding_method": "POW2", "backoff": 0.5},
                          "activation": {"rounding_method": "POW2", "backoff": 0.25}},
              "layers": {"1": {"weight": {"granularity": "PCS"}}},
              "nodes": {"model.layers.0.mlp.down_proj": {"weight": {"rounding_method": "IDENTITY"},
                                                         "activation": {"rounding_method": "IDENTITY"}}}}


def test_quantize_with_rules(measured, tmp_path):
    import hqtflow
    from hqtflow.formats import measurement as mf
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory
    from hqtflow.scales import linear_scales

    cfg = tmp_path / "q.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": CKPT_RULES, "blocklist": {"names": ["lm_head"]}}))
    out = tmp_path / "fp8"
    r = run_cli("quantize", "-m", measured, "-o", out, "-c", cfg)
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"  # one layer is per channel
    assert json.loads((out / "hqtflow_manifest.json").read_text())["data"]["scale_method"] == CKPT_RULES
    model, tok = hqtflow.load(out, backend="qdq", dtype="bf16")
    live, _ = quantize_in_memory(QuantizeSettings(measurement=str(measured), output="-", config=str(cfg)))
    stats = mf.read_measurement(measured / "measure_hooks_maxabs.json").nodes
    rules = scale_rules(CKPT_RULES)
    for name in ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.up_proj", "model.layers.0.self_attn.k_proj"):
        mod = model.get_submodule(name)
        bf16 = live.get_submodule(name)
        assert isinstance(mod, FP8Linear) and torch.equal(mod.weight_scale, bf16.weight_scale.expand_as(mod.weight_scale))
        assert float(mod.input_scale) == float(bf16.input_scale)
    w1 = model.get_submodule("model.layers.1.mlp.up_proj").weight_scale
    w0 = model.get_submodule("model.layers.0.mlp.up_proj").weight_scale
    assert w1.unique().numel() > 1 and w0.unique().numel() == 1  # per channel in layer 1 only
    s_in = float(model.get_submodule("model.layers.0.mlp.down_proj").input_scale)
    inp = stats["model.layers.0.mlp.down_proj"].inputs[0]
    m = rules("model.layers.0.mlp.down_proj")
    assert m.name == "maxabs_arbitrary" and s_in == float(linear_scales(m, inp, torch.ones(2, 2)).input)
    ids = torch.tensor([tok.encode("The tower is 324 metres tall")])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, live(ids).logits)


def test_scale_files_per_node(measured, tmp_path):
    cfg = tmp_path / "q.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": CKPT_RULES}))
    out = tmp_path / "scales"
    r = run_cli("quantize", "-m", measured, "-o", out, "-c", cfg, "--scales-only")
    assert r.exit_code == 0, r.output
    # INC names the scale file after the default section's method
    nodes = json.loads((out / "measure_hooks_maxabs_MAXABS_POW2.json").read_text())["Nodes"]
    assert isinstance(nodes["model.layers.1.mlp.up_proj"]["params"]["weight"], dict)  # per channel: {"0", "1"}
    assert isinstance(nodes["model.layers.0.mlp.up_proj"]["params"]["weight"], float)
    s = nodes["model.layers.0.mlp.down_proj"]["inputs"][0]
    assert s != 2.0 ** round(torch.log2(torch.tensor(s)).item())  # arbitrary, not a power of two
    assert json.loads((out / "quant_config.json").read_text())["scale_method"] == CKPT_RULES


def test_mixed_activation_schemes_refused(measured, tmp_path):
    cfg = tmp_path / "q.json"
    rules = {"default": CKPT_RULES["default"],
             "layers": {"1": {"weight": {"granularity": "PCS"}, "activation": {"granularity": "PCS"}}}}
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": rules}))
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "x", "-c", cfg)
    assert r.exit_code != 0 and "only with dynamic_quantization: true" in r.output  # maxabs_pcs_pow2 in layer 1
    # dynamic: layer 1 per token, the rest per tensor: one checkpoint cannot say both
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": rules, "dynamic_quantization": True}))
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "x", "-c", cfg)
    assert r.exit_code != 0 and "one activation scheme" in r.output
