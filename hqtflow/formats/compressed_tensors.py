"""The compressed-tensors FP8 layout (what llm-compressor writes and vLLM prefers), written and read by hqtflow.

Per quantized Linear: `weight` float8_e4m3fn [out, in], `weight_scale` ([1] per tensor or [out, 1] per channel,
W ~ weight * weight_scale), and, for static activations, `input_scale` [1]. config.json carries
`quantization_config` (quant_method compressed-tensors, format float-quantized) with an `ignore` list.
"""

from __future__ import annotations

from hqtflow.errors import ArtifactError


def quantization_config(*, per_channel: bool, static_input: bool, ignore: list[str]) -> dict:
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
           "strategy": "channel" if per_channel else "tensor"}
    activations = {**fp8, "strategy": "tensor"} if static_input else None
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp8, "input_activations": activations,
                                      "output_activations": None, "format": "float-quantized"}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def parse_quantization_config(qc: dict) -> dict:
    """What hqtflow's runtime needs from a compressed-tensors FP8 config: per_channel, static_input, ignore.

    Anything else (dynamic activations, block-wise weights, other formats) is named and refused.
    """
    if qc.get("quant_method") != "compressed-tensors":
        raise ArtifactError(f"Unsupported quantization method {qc.get('quant_method')!r}; hqtflow reads compressed-tensors FP8.")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ArtifactError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported (one group).")
    g = groups[0]
    w, a = g.get("weights") or {}, g.get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ArtifactError(f"Unsupported weight scheme {w.get('type')}{w.get('num_bits')}; hqtflow reads FP8 (float, 8 bits).")
    if w.get("strategy") not in ("tensor", "channel"):
        raise ArtifactError(f"Unsupported weight strategy {w.get('strategy')!r}; supported: tensor, channel.")
    if a is not None and (a.get("dynamic") or a.get("strategy") != "tensor"):
        raise ArtifactError("Dynamic or non-per-tensor input activations are not supported yet; static per-tensor only.")
    return {"per_channel": w["strategy"] == "channel", "static_input": a is not None, "ignore": list(qc.get("ignore") or [])}
