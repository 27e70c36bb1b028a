"""A static FP8 KV cache: keys and values stored as FP8 with per-layer static scales (`k_scale`, `v_scale`).

Each layer is a transformers `StaticLayer` whose backing tensors are float8 instead of bf16: `update` quantizes the
incoming keys/values with the reference arithmetic (`cast(clamp(x / s, -F, F))`, float32, saturating), writes them
in place, and returns the whole cache dequantized to the model's dtype for attention. Half the KV memory of bf16;
on CPU the per-step dequantization costs about what the saved bytes give back, so this is a capacity feature.
The scales come from the measurement (`hqtflow quantize --kv-cache fp8`) or a foreign checkpoint's k/v scales.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import Cache, StaticLayer

from hqtflow.scales import FP8_DTYPES, dequantize, quantize


class FP8StaticLayer(StaticLayer):
    def __init__(self, max_cache_len: int, k_scale: torch.Tensor, v_scale: torch.Tensor, fp8: str = "E4M3"):
        super().__init__(max_cache_len=max_cache_len)
        self.k_scale, self.v_scale, self.fp8 = k_scale.float(), v_scale.float(), fp8

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        fp8 = FP8_DTYPES[self.fp8]
        self.keys = torch.zeros(self.batch_size, self.num_heads, self.max_cache_len, self.k_head_dim, dtype=fp8, device=self.device)
        self.values = torch.zeros(self.batch_size, self.num_heads, self.max_cache_len, self.v_head_dim, dtype=fp8, device=self.device)
        self.k_scale, self.v_scale = self.k_scale.to(self.device), self.v_scale.to(self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.cumulative_length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        pos = torch.arange(n, device=self.device) + self.cumulative_length
        self.cumulative_length.add_(n)
        # float8 has no index_copy_ kernel on every device: copy the bytes
        self.keys.view(torch.uint8).index_copy_(2, pos, quantize(key_states, self.k_scale, self.fp8).view(torch.uint8))
        self.values.view(torch.uint8).index_copy_(2, pos, quantize(value_states, self.v_scale, self.fp8).view(torch.uint8))
        return dequantize(self.keys, self.k_scale, self.dtype), dequantize(self.values, self.v_scale, self.dtype)


FIX = "quantize it with `--kv-cache fp8`"  # what gives a model k/v scales, in the CLI's words


def fp8_kv_refusal(model, *, fix: str = FIX, static: tuple[str, str] | None = None) -> str | None:
    """Why `model` cannot take hqtflow's FP8 KV cache, in one sentence, or None. Refused: an architecture whose cache
    holds no keys and values (models.kv_cache_refusal); decoder layers without k/v scales, the sentence ending with
    `fix` (what gives them, in the caller's words); with `static` (whose cache it is, and what holds such layers
    instead), sliding-window layers, which FP8StaticCache does not hold. `model` may be its config alone (the
    scales in hand): the sliding-window check only."""
    from transformers import PretrainedConfig

    from hqtflow.models import kv_cache_refusal

    config = model if isinstance(model, PretrainedConfig) else model.config
    if config is not model:
        if why := kv_cache_refusal(model):  # never scaled by quantize: "quantize it with ..." would send the user in a circle
            return f"The FP8 KV cache cannot be used with {config.model_type}: {why}; give --kv-cache bf16."
        found, n = _scaled_attention(model)
        if missing := [i for i in range(n) if i not in found]:
            return ("This model has no KV-cache scales (k_scale/v_scale) for layers "
                    f"{missing[:4]}{'...' if len(missing) > 4 else ''}: {fix}.")
    if static and has_sliding_layers(config):
        whose, instead = static
        return (f"{whose} FP8 KV cache holds full-attention layers only, and this {config.model_type} has "
                f"sliding-window layers; {instead}.")
    return None


def _scaled_attention(model) -> tuple[dict, int]:
    """({decoder layer: its attention module holding k_scale and v_scale}, the number of decoder layers)."""
    from hqtflow.models import attention_modules

    found = {i: model.get_submodule(name) for i, name in attention_modules(model).items()}
    scaled = {i: m for i, m in found.items() if hasattr(m, "k_scale") and hasattr(m, "v_scale")}
    return scaled, model.config.get_text_config(decoder=True).num_hidden_layers


def kv_scales(model, fix: str = FIX) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer (k_scale, v_scale) from the attention modules' buffers; ValueError (fp8_kv_refusal's
    sentence, `fix` its end) for a model without them."""
    if why := fp8_kv_refusal(model, fix=fix):
        raise ValueError(why)
    found, n = _scaled_attention(model)
    return [(found[i].k_scale, found[i].v_scale) for i in range(n)]


def has_sliding_layers(config) -> bool:
    """Whether a model's config gives it layers other than full attention (`layer_types`: Gemma 2 and 3's local
    layers), which FP8StaticCache does not hold."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return any(t != "full_attention" for t in types)


class FP8StaticCache(StaticCache):
    """transformers' StaticCache with FP8StaticLayer layers (full-attention models)."""

    def __init__(self, config, max_cache_len: int, scales: list[tuple[torch.Tensor, torch.Tensor]]):
        if why := fp8_kv_refusal(config, static=("This static", "the serving engine's (hqtflow.runtime.engine) holds both")):
            raise ValueError(why)
        Cache.__init__(self, layers=[FP8StaticLayer(max_cache_len, k, v) for k, v in scales])
