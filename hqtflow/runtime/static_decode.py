"""Greedy decoding with a static KV cache and an optionally compiled decode step, the way gpt-fast does it.

The KV cache is transformers' `StaticCache` (preallocated [batch, heads, max_length, head_dim] per layer, written
in place), so every decode step has the same shapes and no per-token allocation; the step (model forward + argmax)
can then be compiled once with `torch.compile(dynamic=False)`, which removes the per-token Python and dispatch
overhead. FP8 layers run whatever backend they are set to (`set_backend`): the CPU kernel and `_scaled_mm` are
both traceable ops. Compiled artifacts persist in `$HQTFLOW_CACHE/inductor`, so only the first run compiles.

On CUDA the decode step is also a CUDA graph (`cuda_graph`, the default there): captured once per batch size on its
first step, then replayed with the token and position copied into its static inputs. The cache writes each step at its
own counter (`cumulative_length`, advanced in place), so the eager warm-up runs before capture would move every later
token's keys and values two slots on: the cache layers' counters are saved before the capture and put back after it
(not the keys and values: the warm-ups wrote them only past the step's position, hidden by the causal mask until the
real steps overwrite them), and the replays then write where the eager steps do. With `compile` the
graph holds the compiled step (gpt-fast's "reduce-overhead": inductor fuses the norms, rotary, residuals and FP8
input quantization into few kernels, the graph removes their launches). A capture that fails leaves the decoder eager
(the reason in `graph_failed`).

Compiled, attention is `sdpa_gqa` (registered with transformers as "hqtflow_sdpa"): transformers' SDPA attention, except
that a decode step's query heads are packed onto their key/value heads (transformers' `pack_gqa`) under
`torch.compile` too, as transformers does eager; transformers repeats the keys and values there instead, which made a
compiled SmolLM2 step's attention 4x slower at batch 8 on a 2-core CPU (570 vs 150 us per layer).

Sliding-window layers (Mistral, Gemma's local layers, ...) get full-length static layers too, the window applied by
transformers' sliding mask: its `StaticSlidingWindowLayer` counts in a Python int once the window is full (which
branch a step takes, which mask it builds), which a graph replay neither reads nor advances, so graphed steps past
the window wrote out of bounds or attended the wrong keys; a full-length layer's state is its tensor counter only.

Compiled, Dynamo checks only the step's own guards on each call: those on its inputs (the token tensor's shape, dtype
and device; it sets none on the position) and on global state (grad mode, default device, ...). The others guard the
model's weights and the KV cache's tensors, which the decoder owns and never swaps; checking them cost 2.4 ms of a
13-14 ms SmolLM2 FP8 step (about 1000 tensor guards, 4000 guard nodes; 1.9 ms for bf16) on a 2-core Zen 4. The step
is compiled through a copy of its code per decoder (`_own_code`), since Dynamo keeps graphs per code object and no
longer tells two decoders' models apart.

`kv_cache="fp8"` stores keys and values as FP8 with the model's static k/v scales (`kv_cache.py`).

Prompts in a batch have the same length (no padding); this engine is for latency and throughput measurement and
`hqtflow generate`, the server's continuous batching lives in `engine.py`.
"""

from __future__ import annotations

import itertools
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

ATTENTION = "hqtflow_sdpa"
_codes = itertools.count()


@dataclass
class DecodeResult:
    tokens: torch.Tensor                    # [batch, new tokens]
    prefill_s: float                        # the prompt's forward (and first token)
    step_s: list[float] = field(default_factory=list)  # each later decode step

    @property
    def decode_tokens_per_s(self) -> float:
        return self.tokens.shape[0] * len(self.step_s) / sum(self.step_s) if self.step_s else float("nan")


def use_persistent_compile_cache() -> None:
    """Point inductor's on-disk cache (torch's documented TORCHINDUCTOR_CACHE_DIR) into hqtflow's cache."""
    from hqtflow import environment

    environment.use_inductor_cache()


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' SDPA attention; a single query token with grouped key/value heads and a mask shared by the heads
    is packed onto the key/value heads ([b, kv heads, group, d]) while compiling too, as transformers does eager."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    b, heads, q_len, d = query.shape
    plain = (not torch.compiler.is_compiling() or q_len != 1 or groups == 1 or attention_mask is None
             or attention_mask.shape[1] != 1 or any(kwargs.get(k) is not None for k in ("position_bias", "softcap"))
             or kwargs.get("output_attentions"))
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q = query.reshape(b, heads // groups, groups, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, q_len, d).transpose(1, 2).contiguous(), None


def step_guards(entries) -> list[bool]:
    """Dynamo's `guard_filter_fn` for the decode step: keep the guards on global state (unnamed) and on the step's
    `tokens` and `position` inputs (the tokens' shape holds the batch size: a new one compiles anew), drop those on the
    decoder (its model) and on the cache, the same objects for a decoder's life (see the module's docstring)."""
    return [not e.name or e.name.split(".")[0].split("[")[0] in ("tokens", "position") for e in entries]


def _own_code(method):
    """`method` through a copy of its function's code object, bound to the same instance: Dynamo's graphs and guards
    live on the code object, so each decoder's compiled step stays its own."""
    f = method.__func__
    name = f"{f.__name__}_{next(_codes)}"
    code = f.__code__.replace(co_name=name, co_qualname=f"{f.__qualname__}_{name}")
    return types.MethodType(types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__),
                            method.__self__)


def full_length_cache(config, max_length: int):
    """transformers' StaticCache for `config`, its sliding-window layers full-length ones (see the module's docstring):
    the same attention, the window masked, every step's state in tensors a CUDA graph replays."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    cache = StaticCache(config=config, max_cache_len=max_length)
    cache.layers = [StaticLayer(max_length) if type(layer) is StaticSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def _cache_state(cache) -> list[tuple[object, str, object]]:
    """(layer, attribute, copy) for every tensor and number a decode step can change in `cache`'s layers but the keys
    and values themselves (no second KV cache in memory): the warm-ups write those only at positions past the step's,
    which the causal mask hides until the real steps overwrite them."""
    saved = []
    for layer in cache.layers:
        for name, value in vars(layer).items():
            if name in ("keys", "values"):
                continue
            if isinstance(value, torch.Tensor):
                saved.append((layer, name, value.clone()))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                saved.append((layer, name, value))
    return saved


def _restore_cache_state(saved: list[tuple[object, str, object]]) -> None:
    """Put `_cache_state`'s copies back; tensors in place (a captured graph holds their addresses)."""
    for layer, name, value in saved:
        if isinstance(value, torch.Tensor):
            getattr(layer, name).copy_(value)
        else:
            setattr(layer, name, value)


class StaticDecoder:
    def __init__(self, model, *, max_length: int = 512, compile: bool = False, kv_cache: str = "bf16",
                 cuda_graph: bool | None = None):
        if kv_cache not in ("bf16", "fp8"):
            raise ValueError(f"kv_cache must be bf16 or fp8, not {kv_cache!r}")
        self.model, self.max_length, self.compiled, self.kv_cache = model, max_length, compile, kv_cache
        if kv_cache == "fp8":
            from hqtflow.runtime.kv_cache import fp8_kv_refusal, kv_scales

            # refused now, not by FP8StaticCache at the first generate
            if why := fp8_kv_refusal(model, static=("The static decoder's", "the serving engine's (--engine serve) holds both")):
                raise ValueError(why)
            self._kv_scales = kv_scales(model)
        self.device = next(model.parameters()).device
        from hqtflow.models import cache_kwarg

        self._cache_kwarg = cache_kwarg(model)
        self._caches: dict[int, object] = {}
        self._step = self._decode_step
        self.cuda_graph = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self._graphs: dict[int, tuple] = {}  # batch -> (graph, static token, static position, output)
        self.graph_failed: str | None = None
        if compile:
            use_persistent_compile_cache()
            if model.config._attn_implementation == "sdpa":  # the same attention eager, GQA packed when compiled
                from hqtflow.runtime.paged import register_attention

                register_attention(ATTENTION, sdpa_gqa)
                model.set_attn_implementation(ATTENTION)
            self._step = torch.compile(_own_code(self._decode_step), dynamic=False,
                                       options={"guard_filter_fn": step_guards})

    def _cache(self, batch: int):
        cache = self._caches.get(batch)
        if cache is None and self.kv_cache == "fp8":
            from hqtflow.runtime.kv_cache import FP8StaticCache

            cache = self._caches[batch] = FP8StaticCache(self.model.config, self.max_length, self._kv_scales)
        elif cache is None:
            cache = self._caches[batch] = full_length_cache(self.model.config, self.max_length)
        else:
            cache.reset()
        return cache

    def _decode_step(self, tokens: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
        logits = self.model(input_ids=tokens, **{self._cache_kwarg: cache}, cache_position=position, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    def _graph_step(self, tok: torch.Tensor, position: int, cache) -> torch.Tensor:
        """The decode step as a CUDA graph (captured on this batch size's first step), or eager after a failure."""
        if self.graph_failed:
            return self._step(tok, torch.tensor([position], device=self.device), cache)
        entry = self._graphs.get(tok.shape[0])
        if entry is None:
            static_tok, static_pos = tok.clone(), torch.tensor([position], device=self.device)
            saved = []
            try:
                from hqtflow.runtime.cuda_graphs import capture

                saved = _cache_state(cache)

                graph, out = capture(lambda: self._step(static_tok, static_pos, cache))
            except Exception as e:  # noqa: BLE001 - graphs are an optimization
                self.graph_failed = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize()
                _restore_cache_state(saved)
                return self._step(tok, torch.tensor([position], device=self.device), cache)
            _restore_cache_state(saved)  # the warm-ups advanced the write counters
            entry = self._graphs[tok.shape[0]] = (graph, static_tok, static_pos, out)
        graph, static_tok, static_pos, out = entry
        static_tok.copy_(tok)
        static_pos.fill_(position)
        graph.replay()
        return out.clone()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *,
                 eos_token_id: int | Iterable[int] | None = None) -> DecodeResult:
        """Greedy: `max_new_tokens` tokens for each row of `input_ids` [batch, prompt]; with `eos_token_id` (one id or
        several), stops once every row has produced one (later tokens of a finished row repeat the EOS it gave)."""
        b, n = input_ids.shape
        if n + max_new_tokens > self.max_length:
            raise ValueError(f"prompt ({n}) + new tokens ({max_new_tokens}) exceed the cache ({self.max_length})")
        cache = self._cache(b)
        ids = input_ids.to(self.device)
        t = time.perf_counter()
        tok = self._decode_step(ids, torch.arange(n, device=self.device), cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        out = [tok]
        prefill = time.perf_counter() - t
        steps = []
        eos = None if eos_token_id is None else torch.tensor(
            [eos_token_id] if isinstance(eos_token_id, int) else sorted(eos_token_id), device=self.device)
        done = torch.isin(tok[:, 0], eos) if eos is not None else None
        last = tok.clone()
        for i in range(max_new_tokens - 1):
            if done is not None and bool(done.all()):
                break
            t = time.perf_counter()
            if self.cuda_graph:
                tok = self._graph_step(tok, n + i, cache)
            else:
                tok = self._step(tok, torch.tensor([n + i], device=self.device), cache).clone()
            if self.device.type == "cuda":
                torch.cuda.synchronize()  # the step's time, not its launch's
            steps.append(time.perf_counter() - t)
            if done is not None:
                tok[done] = last[done]
                done |= torch.isin(tok[:, 0], eos)
                last = tok.clone()
            out.append(tok)
        return DecodeResult(torch.cat(out, dim=1), prefill, steps)
