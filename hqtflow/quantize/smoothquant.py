"""SmoothQuant with the Habana Quantization Toolkit 1.17 semantics, folded into the model so standard loaders run it.

HQT 1.17 (`_core/scale_methods/smooth_quant.py`, fed by the `maxabs_per_channel` observer: a per-input-channel
input maxabs a_j; w_j = max over output channels |W[:, j]|; F = 448, input backoff 0.25, weight backoff 0.5,
alpha 0.5, pow2(v) = 2^ceil(log2 v)) gives each Linear a per-input-channel input scale S_j, multiplies the weight's
input channels by S_j (W' = W / (1 / S)) and quantizes W' per output channel:

- `smoothquant_weights_output_channel_maxabs_pow2`: s_j = pow2(a_j^alpha / w_j^(1-alpha)),
  post = pow2(max_j(a_j / s_j) / (F * 0.25)), S_j = s_j * post; W' weight scale pow2(max|W'_i| / (F * 0.5)).
- `weaksmoothquant_weights_output_channel_maxabs_pow2`: HQT reduces the input range to one number first
  (`.max()`), so only the weight shapes s: mid = w_max / sqrt(w_max / w_min), s_j = pow2((mid / w_j)^(1-alpha))
  (w clamped at 1e-5), post = pow2(max_j(a / s_j) / (F * 0.25)), S_j = s_j * post, weight as above.
- `smoothquant_opt`: s_j = pow2((a_j / (F * 0.25))^alpha / (w_j / (F * 0.5))^(1-alpha)), S_j = s_j (no post);
  weight scale per output channel: the best of {2^-3 .. 2^4} x pow2(max|W'_i| / (F * 0.5)) (least squared error).

Folding (what hqtflow writes): quantizing x / S_j equals quantizing x' = x / s_j with one per-tensor scale post
(pow2 scales divide exactly), and W' = W * s_j * post quantized per channel equals W * s_j with its scale divided
by post. So the smoothing vector 1 / s goes into the preceding RMSNorm weight (norm.weight / s; q/k/v after
input_layernorm, gate/up after post_attention_layernorm) or, for down_proj, into up_proj's output rows
(act(gate) * up / s); the consumers' input channels are multiplied by s. Every s is a power of two, so the folded
bf16 model computes the same function as before (barring overflow). The checkpoint is then an ordinary static
per-tensor-input / per-channel-weight compressed-tensors FP8 checkpoint that transformers and vLLM run.
Linears that share one input (q/k/v, gate/up) need one s: w_j is taken over all of them (as the original
SmoothQuant does for QKV; HQT computes s per Linear, which cannot be folded). o_proj (its input comes from the
attention, not a norm) gets HQT's non-smoothed neighbour `act_maxabs_pow2_weights_pcs_maxabs_pow2`.
"""

from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

from hqtflow.errors import ArtifactError, ConfigError
from hqtflow.scales import (ACTIVATION_BACKOFF, HP_DTYPES, SMOOTHQUANT_METHODS, WEIGHT_BACKOFF, LinearScales,
                            _best_per_channel, floored, full_scale, linear_scales, round_pow2, scale_method, stored)

ALPHA = 0.5
FALLBACK = "act_maxabs_pow2_weights_pcs_maxabs_pow2"
OPT_MULTIPLIERS = tuple(2.0**e for e in range(-3, 5))

# (source module, how it feeds the consumers, consumer suffixes) inside one decoder layer "…layers.<i>."
GROUPS = (("input_layernorm", "norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
          ("post_attention_layernorm", "norm", ("mlp.gate_proj", "mlp.up_proj")),
          ("mlp.up_proj", "rows", ("mlp.down_proj",)))


def _groups(model: nn.Module, names: list[str]) -> list[tuple[str, str, list[str]]]:
    """(source, kind, consumers) for every decoder layer whose consumers are all quantized."""
    wanted = set(names)
    layers = sorted({m.group(1) for n in names if (m := re.match(r"^(.*layers\.\d+)\.", n))})
    out = []
    for prefix in layers:
        for src, kind, consumers in GROUPS:
            full = [f"{prefix}.{c}" for c in consumers]
            try:
                model.get_submodule(f"{prefix}.{src}")
            except AttributeError:
                continue
            if all(c in wanted for c in full):
                out.append((f"{prefix}.{src}", kind, full))
    return out


def _smoothing(method: str, a: torch.Tensor, w: torch.Tensor, F: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s per input channel, the per-tensor input scale post) in float32, HQT 1.17's formulas (module doc)."""
    if method == "smoothquant_opt":
        s = round_pow2((a / (F * ACTIVATION_BACKOFF)) ** ALPHA / (w / (F * WEIGHT_BACKOFF)) ** (1 - ALPHA))
        return s, torch.tensor(1.0)
    if method == "smoothquant_weights_output_channel_maxabs_pow2":
        s = round_pow2(a ** ALPHA / w ** (1 - ALPHA))
        return s, round_pow2((a / s).max() / (F * ACTIVATION_BACKOFF))
    w = w.clamp(min=1e-5)
    mid = w.max() / torch.sqrt(w.max() / w.min()).clamp(min=1e-5)
    s = round_pow2((1.0 / (w / mid).clamp(min=1e-5) ** (1 - ALPHA)).clamp(min=1e-5))
    a_all = a.max().clamp(min=1e-5)
    return s, round_pow2((a_all / s).max() / (F * ACTIVATION_BACKOFF))


def smooth(model: nn.Module, names: list[str], meas, method_name: str, F: float) -> dict[str, torch.Tensor]:
    """Fold the smoothing into `model`'s bf16 weights (exact: powers of two); {smoothed Linear: input scale post}."""
    if method_name not in SMOOTHQUANT_METHODS:
        raise ConfigError(f"{method_name} is not a SmoothQuant method; valid: {', '.join(SMOOTHQUANT_METHODS)}.")
    posts: dict[str, torch.Tensor] = {}  # smoothed Linear -> its per-tensor input scale
    for src, kind, consumers in _groups(model, names):
        stats = [np.asarray(meas.nodes[c].inputs[0], dtype=np.float32).reshape(-1) for c in consumers]
        width = model.get_submodule(consumers[0]).in_features
        if any(st.size != width for st in stats):
            raise ArtifactError(f"{method_name} needs per-channel input statistics (observer maxabs_per_channel); "
                                f"the measurement of {consumers[0]} has {stats[0].size} value(s) for {width} channels.")
        a = torch.from_numpy(np.maximum.reduce(stats)).clamp(min=1e-5)
        ws = [model.get_submodule(c).weight.detach() for c in consumers]
        w = torch.stack([x.float().abs().amax(0) for x in ws]).amax(0).clamp(min=1e-5)
        s, post = _smoothing(method_name, a, w, F)
        source = model.get_submodule(src)
        if kind == "norm" and ("Gemma" in type(source).__name__ or getattr(source, "bias", None) is not None):
            raise ConfigError(f"{method_name} folds the smoothing into {type(source).__name__}, which is not a plain "
                              "scale-only RMSNorm (weight * x); this model is not supported.")
        if kind == "norm":
            source.weight.data = (source.weight.float() / s).to(source.weight.dtype)
        else:  # rows of the producing Linear (down_proj's input is act(gate) * up)
            source.weight.data = (source.weight.float() / s[:, None]).to(source.weight.dtype)
            if source.bias is not None:
                source.bias.data = (source.bias.float() / s).to(source.bias.dtype)
        for c, wt in zip(consumers, ws):
            lin = model.get_submodule(c)
            lin.weight.data = (wt.float() * s[None, :]).to(wt.dtype)
            posts[c] = post
    return posts


def convert_smoothquant(model: nn.Module, names: list[str], meas, method_name: str, *, target: str, fp8: str,
                        hp_dtype: str) -> dict[str, dict]:
    """Smooth (folded, see the module doc) and replace each named Linear by an FP8Linear; return the scales used."""
    from hqtflow.quantize.convert import _set_module, _untie_if_needed
    from hqtflow.quantize.fp8_linear import FP8Linear

    F = full_scale(fp8, target)
    _untie_if_needed(model, names)
    posts = smooth(model, names, meas, method_name, F)
    hp = HP_DTYPES[hp_dtype]
    fallback = scale_method(FALLBACK, target)
    used = {}
    for name in names:  # after all folding (an up_proj is both a consumer and a source)
        lin = model.get_submodule(name)
        if name in posts:  # weight scales from the final (folded) weights
            sc = stored(LinearScales(floored(posts[name].to(hp)),
                                     floored(_weight_scale(lin.weight.detach(), method_name, F, fp8).to(hp))),
                        lin.weight.dtype, name)
        else:
            sc = linear_scales(fallback, meas.nodes[name].inputs[0], lin.weight, target=target, fp8=fp8, hp_dtype=hp_dtype,
                               name=name)
        s_in, s_w = sc.input, sc.weight
        _set_module(model, name, FP8Linear.from_linear(lin, s_w, s_in, fp8, inc_codes=True))  # HQT's arithmetic
        used[name] = {"input": float(s_in), "weight": s_w.float().flatten().tolist(), "smoothed": name in posts}
    return used


def _weight_scale(w: torch.Tensor, method_name: str, F: float, fp8: str) -> torch.Tensor:
    """Per output channel: pow2(max|W_i| / (F * 0.5)); smoothquant_opt: the best multiple of it (HQT's mmse)."""
    ref = floored(round_pow2(w.float().abs().amax(1) / (F * WEIGHT_BACKOFF)))
    if method_name != "smoothquant_opt":
        return ref
    return floored(round_pow2(_best_per_channel(w.float(), ref, OPT_MULTIPLIERS, fp8, F)))
