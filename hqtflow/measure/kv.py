"""KV-cache statistics: the maxabs of the keys and values each attention layer stores in its cache.

transformers hands every layer's keys (after rotary embedding) and values to `past_key_values.update(...)`, so a
cache that observes those calls sees exactly what an FP8 KV cache would hold. `KVObserverCache` is a DynamicCache
that records them (padding excluded: positions where the batch's attention mask is 0) into a `KVStats`, keyed by
the attention module's name. The stats go to the measurement artifact's `kv_cache_maxabs.json`
(`hqtflow.formats.measurement.write_kv_stats`: hqtflow's own file, beside the HQT/INC ones, which have no KV nodes
for Hugging Face models); `hqtflow quantize --kv-cache fp8` turns them into `k_scale` / `v_scale` (the
compressed-tensors / vLLM convention).
"""

from __future__ import annotations

import math

import torch
from transformers import DynamicCache


class KVStats:
    def __init__(self, model):
        from hqtflow.models import attention_modules

        self.names = attention_modules(model)
        self.maxabs: dict[int, list[float]] = {}

    def record(self, layer: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
        if mask is not None and mask.shape[0] == k.shape[0] and mask.shape[1] == k.shape[2]:
            valid = mask.to(k.device)[:, None, :, None].bool()
            k, v = k.masked_fill(~valid, 0), v.masked_fill(~valid, 0)
        ka, va = float(k.abs().amax()), float(v.abs().amax())
        old = self.maxabs.get(layer, [0.0, 0.0])
        # NaN stays NaN (Python's max would drop it), so broken weights cannot pass as statistics of 0
        self.maxabs[layer] = [x if math.isnan(x) or math.isnan(o) else max(o, x) for o, x in ((old[0], ka), (old[1], va))]

    def non_finite(self) -> str | None:
        """The first attention module whose cached keys or values were NaN or inf, or None."""
        bad = next((i for i, kv in sorted(self.maxabs.items()) if not all(map(math.isfinite, kv))), None)
        return None if bad is None else self.names.get(bad, f"layer{bad}")

    def cache(self, mask: torch.Tensor | None = None) -> "KVObserverCache":
        return KVObserverCache(self, mask)

    def layers(self) -> dict[str, dict[str, float]]:
        """{attention module: {"k": maxabs, "v": maxabs}}."""
        return {self.names.get(i, f"layer{i}"): {"k": k, "v": v} for i, (k, v) in sorted(self.maxabs.items())}


class KVObserverCache(DynamicCache):
    def __init__(self, stats: KVStats, mask: torch.Tensor | None):
        super().__init__()
        self._stats, self._mask = stats, mask

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self._stats.record(layer_idx, key_states, value_states, self._mask)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
