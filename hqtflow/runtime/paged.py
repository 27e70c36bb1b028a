"""A paged KV cache (vLLM/TGI design) and the attention function that reads it.

Memory: per decoder layer one pool of `num_blocks * block_size` KV slots ([slots, kv_heads, head_dim], keys and
values), bf16 (the model's dtype) or FP8 with the checkpoint's static per-layer `k_scale`/`v_scale` (stored as
`cast(clamp(x / s))`, read back as `q * s`: hqtflow.scales). A sequence owns a list of blocks (its block table);
token t of the sequence lives in slot `blocks[t // block_size] * block_size + t % block_size`. Blocks are handed
out and taken back by `KVPool.allocate/free`; the engine admits requests by free blocks and preempts (frees a
sequence's blocks, to recompute it later) when they run out.

The model runs one flattened step: every scheduled sequence's new tokens side by side in one row ([1, T]) with their
own positions, and attention is done by `paged_attention`, registered with transformers' `AttentionInterface` as
"hqtflow_paged" (the masks' interface gets sdpa's). It writes the step's new keys/values into their slots (one copy
per layer), runs SDPA per prefilling sequence on the context gathered from its blocks, and a float32 attention per
decoding sequence over exactly its own context (on a CPU, every decoding sequence of the step in one call of
hqtflow's `paged_decode_attention` op, runtime/csrc/, which still computes each one alone, in an order fixed by the
sequence: one call per layer, not ~15 tensor ops per sequence). Every sequence's attention is computed alone, with the shapes it has
alone: a batched matmul would pick its algorithm (and its rounding) by the batch size and pad contexts to the longest,
so a token's logprob would depend on its neighbours (tests compare the logprobs alone and in a busy batch, bit for
bit).
On CUDA (fp16/bf16) a step's sequences, prefill chunks and decoding tokens alike, go through one variable-length
flash-attention call instead (`StepPlan.varlen`: cumulative query and key lengths, each sequence's keys gathered from
its slots once per layer, the causal mask aligned to its last key): one kernel per layer where the per-sequence loop
launched a dozen per sequence, which ruled a prefill step's host time (H200, an 8B model, 32 prompts' prefill: 1024
SDPA calls per step). Flash attention computes each sequence on its own too, but rounds as SDPA's kernels do, not as
the float32 per-token path.
Gemma 2's soft-capped scores and gpt-oss's attention sinks, which SDPA does not compute, are computed as transformers'
eager attention does, in float32 (a prefill chunk's [heads, n, context] scores held at once; the CPU op takes both).
Called without a step plan (a plain `model.generate` on the same model), it is transformers' SDPA attention (the
model's eager attention for soft-capping or sinks).

Sliding-window layers (Mistral, Gemma 3's local layers, Phi-3, Qwen2 with `use_sliding_window`, ...) read the window
transformers passes them (`sliding_window=`) and attend only the keys of the last `window` positions, as
transformers' sliding mask (query i sees key j when i - window < j <= i): a decoding sequence reads only those slots,
a prefill chunk only the slots from its first query's window on. Every layer keeps its whole context in the pool
(the layers share the block tables), so a sliding model's KV memory is that of a full-attention one.

`DecodeBatch` is the fixed-shape form of a decode-only step, for CUDA graphs (runtime/cuda_graphs.py): B sequences
(padded with dummy rows), each reading at most L context slots through a [B, L] slot table, attention batched over
the B rows by SDPA with the slots past each sequence's length masked out. Its results match the per-sequence path to
float32 rounding in a float32 model (in bf16, SDPA's kernels round the softmax weights to bf16 for the second
product, as flash attention does), not bit for bit: on CUDA the batch-invariance above is given up for speed (cuBLAS
picks its GEMM by M anyway).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hqtflow.hardware import byte_size
from hqtflow.scales import FP8_DTYPES, dequantize, quantize

NAME = "hqtflow_paged"


@dataclass
class Seq:
    """One sequence's share of a step: tokens [start, start + n) of the flattened row, at positions past..past+n-1."""
    start: int
    n: int
    past: int
    write: torch.Tensor  # [n] slots of the new tokens
    read: torch.Tensor   # [past + n] slots of the whole context
    prompt: int = 0      # the request's prompt length (for RoPE frequencies that depend on it: runtime/rope.py)


class StepPlan:
    """What `paged_attention` needs for one step; the index tensors are built once here, not once per layer."""

    def __init__(self, pool: "KVPool", seqs: list[Seq], tokens: int):
        self.pool, self.seqs, self.tokens = pool, seqs, tokens  # tokens: T, dummy padding tokens included
        real = sum(s.n for s in seqs)
        self.real = real  # the real tokens come first, in `seqs` order
        self.write = torch.cat([s.write for s in seqs]) if seqs else torch.zeros(0, dtype=torch.long, device=pool.device)
        self.prefill = [s for s in seqs if s.n > 1 or not s.past]
        self.decode = [s for s in seqs if s.n == 1 and s.past]
        self.decode_op = bool(self.decode) and torch.device(pool.device).type == "cpu" and cpu_ops()
        if self.decode_op:  # the CPU op's inputs, once per step: each decoding row and its context's slots (CSR)
            self.decode_rows = torch.tensor([s.start for s in self.decode])
            self.decode_slots = torch.cat([s.read for s in self.decode])
            self.decode_offsets = torch.tensor([0, *itertools.accumulate(len(s.read) for s in self.decode)])
        # a step of decoding rows only, one per sequence in order, no padding: the op's output is the whole output
        self.decode_only = (self.decode_op and not self.prefill and len(self.decode) == tokens
                            and all(s.start == i for i, s in enumerate(self.decode)))
        self._windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._varlen: dict[int | None, tuple] = {}

    def varlen(self, window: int | None) -> tuple:
        """The step's sequences (prefill chunks and decoding tokens) packed for flash attention's variable-length
        call, built once per step and window: (their query rows (side by side, as the engine lays a step out),
        int32 cumulative query and key lengths, the longest of each, the context slots of each one's keys, or None
        when every one is a fresh prompt in a bf16 cache, whose keys are the step's own). A sequence's keys start at
        its first query's window (`first_key`); the call aligns its causal mask (and window) to the last key, as a
        chunk after its past needs."""
        if window not in self._varlen:
            seqs, dev = self.seqs, self.pool.device
            rows = slice(0, self.real)  # the real tokens first, in `seqs` order (as `write`)
            reads = [s.read[first_key(s.past, window):] for s in seqs]
            fresh = self.pool.scales is None and not any(s.past for s in seqs)
            cu_q = torch.tensor([0, *itertools.accumulate(s.n for s in seqs)], dtype=torch.int32)
            cu_k = torch.tensor([0, *itertools.accumulate(len(r) for r in reads)], dtype=torch.int32)
            self._varlen[window] = (rows, cu_q.to(dev), cu_k.to(dev), max(s.n for s in seqs),
                                    max(map(len, reads)), None if fresh else torch.cat(reads))
        return self._varlen[window]

    def token_lengths(self) -> list[int]:
        """Each token's sequence length as transformers' generate sees it when it computes that token: the whole
        prompt's for a prompt token (one prefill forward), p + 1 for a later token at position p; 1 for padding."""
        lengths = [max(s.prompt, s.past + i + 1) for s in self.seqs for i in range(s.n)]
        return lengths + [1] * (self.tokens - self.real)

    def decode_contexts(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, offsets) of the decoding rows' contexts for the CPU op: whole, or the last `window` positions of
        each under a sliding window (built once per step and window, not once per layer)."""
        if not window or all(s.past < window for s in self.decode):
            return self.decode_slots, self.decode_offsets
        if window not in self._windowed:
            reads = [s.read[first_key(s.past, window):] for s in self.decode]
            self._windowed[window] = torch.cat(reads), torch.tensor([0, *itertools.accumulate(len(r) for r in reads)])
        return self._windowed[window]


def varlen_runs(query: torch.Tensor) -> bool:
    """Whether a step's sequences go through one flash-attention call (`StepPlan.varlen`) instead of one SDPA per
    prefill chunk and a float32 attention per decoding sequence: CUDA (8.0+), fp16/bf16, a head size flash attention
    takes."""
    d = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and _has_flash(query.device.index or 0))


@functools.cache
def _has_flash(device: int) -> bool:
    """torch's flash attention (compute capability 8.0 or newer) with sliding windows in its operator."""
    return torch.cuda.get_device_capability(device) >= (8, 0) and \
        "window_size_left" in str(torch.ops.aten._flash_attention_forward.default._schema)


def first_key(position: int, window: int | None) -> int:
    """The first context position a query at `position` attends: 0, or position - window + 1 in a sliding window."""
    return max(0, position - window + 1) if window else 0


class DecodeBatch:
    """Static buffers of a decode-only step of `batch` rows, each reading at most `length` slots; `fill` copies a
    step's sequences in (rows past them are dummies that write and read `scratch`, a slot no sequence owns)."""

    def __init__(self, pool: "KVPool", batch: int, length: int, scratch: int):
        dev, long = pool.device, torch.long
        self.pool, self.batch, self.length, self.scratch = pool, batch, length, scratch
        self.tokens = self.real = batch  # every row writes its KV: the dummies into `scratch`
        self.input_ids = torch.zeros(1, batch, dtype=long, device=dev)
        self.position_ids = torch.zeros(1, batch, dtype=long, device=dev)
        self.write = torch.full((batch,), scratch, dtype=long, device=dev)
        self.read = torch.full((batch, length), scratch, dtype=long, device=dev)
        self.read_positions = torch.arange(length, device=dev)  # read[:, j] holds position j (for sliding windows)
        # SDPA's additive mask, made once per step, not converted from a boolean one in every layer
        self.bias = torch.zeros(batch, 1, 1, length, dtype=pool.dtype, device=dev)

    def fill(self, seqs: list[tuple[int, int, list[int]]]) -> None:
        """seqs: (token id, position, block table) of each decoding sequence; position + 1 <= length."""
        n, bs, width = len(seqs), self.pool.block_size, self.length // self.pool.block_size
        dummy = [(0, 0, [])] * (self.batch - n)
        ids = torch.tensor([tok for tok, _, _ in seqs + dummy], dtype=torch.long)
        pos = torch.tensor([p for _, p, _ in seqs + dummy], dtype=torch.long)
        pad = self.scratch // bs  # table entries past a sequence's blocks: the scratch block (masked out)
        table = torch.tensor([blocks[:width] + [pad] * (width - len(blocks[:width])) for _, _, blocks in seqs + dummy],
                             dtype=torch.long)
        read = (table * bs).repeat_interleave(bs, dim=1) + torch.arange(bs).repeat(width)  # [batch, length] slots
        # slots past a row's position read the scratch slot (zeroed, then written by dummies: finite), not the
        # unwritten tail of its last block: masked scores are exact zeros, but 0 * NaN garbage in V is NaN
        past_end = torch.arange(self.length)[None] > pos[:, None]
        read[past_end] = self.scratch
        read[n:] = self.scratch
        write = read[torch.arange(self.batch), pos]
        bias = torch.zeros(past_end.shape, dtype=self.bias.dtype).masked_fill_(past_end, float("-inf"))
        for dst, src in ((self.input_ids[0], ids), (self.position_ids[0], pos), (self.read, read),
                         (self.write, write), (self.bias[:, 0, 0], bias)):
            dst.copy_(src, non_blocking=True)


class KVPool:
    """Fixed-size blocks of KV slots for every layer, with a free list."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device, scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None, fp8: str = "E4M3"):
        if num_blocks < 1:
            raise ValueError("The paged KV cache needs at least one block.")
        self.block_size, self.num_blocks, self.dtype, self.device = block_size, num_blocks, dtype, device
        self.fp8 = fp8 if scales is not None else None
        store = FP8_DTYPES[fp8] if scales is not None else dtype
        shape = (num_blocks * block_size, kv_heads, head_dim)
        # empty, not zeros: a slot is read only after it is written, and untouched pages cost no resident memory
        try:
            self.keys = [torch.empty(shape, dtype=store, device=device) for _ in range(layers)]
            self.values = [torch.empty(shape, dtype=store, device=device) for _ in range(layers)]
        except RuntimeError as e:  # torch.OutOfMemoryError, or the CPU allocator's "can't allocate memory"
            from hqtflow.errors import ResourceError

            size = 2 * layers * shape[0] * kv_heads * head_dim * store.itemsize
            raise ResourceError(f"Cannot allocate a KV cache of {num_blocks * block_size} tokens ({byte_size(size)}) on "
                                f"{torch.device(device).type}: {str(e).splitlines()[0][:200]}") from None
        self.scales = None if scales is None else [(_per_head(k, kv_heads, device), _per_head(v, kv_heads, device)) for k, v in scales]
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, fp8: bool) -> int:
        return 2 * layers * kv_heads * head_dim * (1 if fp8 else torch.empty((), dtype=dtype).element_size())

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise MemoryError(f"{n} KV blocks asked, {len(self.free_blocks)} free")
        return [self.free_blocks.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self.free_blocks.extend(reversed(blocks))

    def slots(self, blocks: list[int], start: int, stop: int) -> torch.Tensor:
        """Slot ids of token positions [start, stop) of a sequence with this block table."""
        t = torch.arange(start, stop)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[t // self.block_size] * self.block_size + t % self.block_size).to(self.device)

    def zero(self, first: int) -> None:
        """Zero the block starting at slot `first` in every layer (a scratch block: finite keys and values)."""
        for t in self.keys + self.values:
            t[first:first + self.block_size].view(torch.uint8).zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, head_dim]."""
        if self.scales is None:
            self.keys[layer].index_copy_(0, slots, k.to(self.dtype))
            self.values[layer].index_copy_(0, slots, v.to(self.dtype))
            return
        ks, vs = self.scales[layer]
        # float8 has no index_copy_ kernel on every device: copy the bytes
        self.keys[layer].view(torch.uint8).index_copy_(0, slots, self._codes(k, ks))
        self.values[layer].view(torch.uint8).index_copy_(0, slots, self._codes(v, vs))

    def _codes(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """`quantize(x, scale)`'s bytes; on a CPU one call of the kernel library's bit-identical `fp8_quantize` (rows of
        head_dim, each with its head's scale) instead of four tensor ops."""
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and cpu_ops():
            n, heads, d = x.shape
            per_row = scale.reshape(-1) if scale.numel() == 1 else scale.reshape(1, heads).expand(n, heads).reshape(-1)
            codes = torch.ops.hqtflow.fp8_quantize(x.reshape(n * heads, d), per_row, self.fp8 == "E4M3")
            return codes.view(torch.uint8).view(n, heads, d)
        return quantize(x, scale, self.fp8).view(torch.uint8)

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[len(slots), kv_heads, head_dim] keys and values in `dtype`."""
        if self.scales is None:
            return self.keys[layer].index_select(0, slots).to(dtype), self.values[layer].index_select(0, slots).to(dtype)
        ks, vs = self.scales[layer]
        k = self.keys[layer].view(torch.uint8).index_select(0, slots).view(self.keys[layer].dtype)
        v = self.values[layer].view(torch.uint8).index_select(0, slots).view(self.values[layer].dtype)
        return dequantize(k, ks, dtype), dequantize(v, vs, dtype)


def _per_head(scale: torch.Tensor, kv_heads: int, device) -> torch.Tensor:
    """A scalar scale, or one per KV head shaped to broadcast over [slots, kv_heads, head_dim]."""
    s = scale.detach().float().to(device)
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() == kv_heads:
        return s.reshape(kv_heads, 1)
    raise ValueError(f"A KV scale with {s.numel()} values fits neither one per layer nor one per KV head ({kv_heads}).")


_STEP: contextvars.ContextVar = contextvars.ContextVar("hqtflow_paged_step", default=None)


@contextlib.contextmanager
def stepping(plan):
    """The engine's step plan for the forward run inside: attention finds it here when a decoder layer does not pass
    its keyword arguments on (StableLM's does not: attention then ran without the sequences' past, silently). A step's
    activations are new tensors, so FP8 Linears reading one tensor share its quantization (`sharing_inputs`)."""
    from hqtflow.quantize.fp8_linear import sharing_inputs

    token = _STEP.set(plan)
    try:
        with sharing_inputs():
            yield
    finally:
        _STEP.reset(token)


def current_step():
    """The step plan `stepping` set for the forward running now; None outside the engine."""
    return _STEP.get()


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] of a flattened step -> ([1, T, heads, d], None)."""
    plan: StepPlan | None = kwargs.pop("paged", None)
    if plan is None:
        plan = current_step()
    if plan is None:  # the model run outside the engine (transformers' generate on the same model)
        if kwargs.get("softcap") or kwargs.get("s_aux") is not None:  # SDPA would leave them out: the model's eager
            eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if eager is None:
                raise ValueError(f"{type(module).__name__} soft-caps its scores or has sinks, and its module has no "
                                 "eager attention to compute them outside the engine")
            return eager(module, query, key, value, additive_mask(attention_mask, query, key), scaling=scaling,
                         dropout=dropout, **kwargs)
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    pool = plan.pool
    width, dk, dv = pool.keys[0].shape[-1], key.shape[-1], value.shape[-1]
    if max(dk, dv) != width:
        raise ValueError(f"{type(module).__name__} hands attention keys {dk} and values {dv} wide, but the KV cache's "
                         f"slots are {width} wide (from the model's config)")
    if key.shape[1] != pool.keys[0].shape[-2]:
        raise ValueError(f"{type(module).__name__} hands attention {key.shape[1]} key/value heads, but the KV cache "
                         f"holds {pool.keys[0].shape[-2]} (from the model's config)")
    if (dk, dv) != (width, width):  # MLA (DeepSeek): keys and values of two widths, in slots of the wider one
        scaling = scaling if scaling is not None else dk ** -0.5
        query, key, value = (F.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))  # zeros: the same dots
        out, _ = _paged_attention(module, plan, query, key, value, scaling, **kwargs)
        return out[..., :dv], None
    return _paged_attention(module, plan, query, key, value, scaling, **kwargs)


def _paged_attention(module, plan, query, key, value, scaling, **kwargs):
    window = kwargs.get("sliding_window")  # a sliding-window layer's window, None for full attention
    softcap, sinks = kwargs.get("softcap") or 0.0, kwargs.get("s_aux")  # Gemma 2's score soft-capping, gpt-oss's sinks
    if sinks is None and "sinks" in getattr(module, "_parameters", ()):  # no nn.Module getattr miss per layer and step
        raise ValueError(f"{type(module).__name__} has attention sinks but did not pass them (`s_aux`) to attention")
    if isinstance(plan, DecodeBatch):
        return decode_batch_attention(module.layer_idx, plan, query, key, value, scaling, window, softcap, sinks), None
    layer, pool = module.layer_idx, plan.pool
    k_new, v_new = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, kv_heads, d]
    pool.write(layer, plan.write, k_new[:plan.real], v_new[:plan.real])  # every real token's KV, one copy
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if plan.decode_only:  # no gather of the decoding rows, no zeroed output to scatter them into
        return _decode_op(plan, layer, query[0].transpose(0, 1), scale, window, softcap, sinks)[None], None
    if plan.seqs and not softcap and sinks is None and varlen_runs(query):  # CUDA: the step's sequences in one call
        rows, cu_q, cu_k, max_q, max_k, slots = plan.varlen(window)
        if slots is None:  # fresh prompts in a bf16 cache: their keys are this step's own
            k, v = k_new[rows], v_new[rows]
        else:
            k, v = pool.read(layer, slots, query.dtype)
        o = torch.ops.aten._flash_attention_forward(
            query[0].transpose(0, 1)[rows], k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale,
            window_size_left=window - 1 if window else -1, window_size_right=0 if window else -1)[0]
        if plan.real < plan.tokens:  # padding rows: zeros
            o = torch.cat([o, o.new_zeros(plan.tokens - plan.real, *o.shape[1:])])
        return o[None], None
    out = query.new_zeros(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, d]
    for s in plan.prefill:  # SDPA per sequence
        lo = first_key(s.past, window)  # the chunk's first query sees no key before lo; later ones see fewer
        if s.past or pool.scales is not None:
            k, v = pool.read(layer, s.read[lo:], query.dtype)
        else:  # the whole context is this step's tokens: the same values as reading them back (lo is 0)
            k, v = k_new[s.start:s.start + s.n], v_new[s.start:s.start + s.n]
        q = query[0, :, s.start:s.start + s.n]  # [heads, n, d]
        if softcap or sinks is not None:  # what SDPA does not compute
            out[s.start:s.start + s.n] = attend_chunk(q, k, v, scale, s.past, lo, window, softcap, sinks)
            continue
        mask, causal = None, s.n > 1 and not s.past and not (window and s.n > window)
        if s.n > 1 and not causal:  # query i (position past + i) sees keys from lo, up to past + i, in its window
            keys = torch.arange(lo, s.past + s.n, device=q.device)[None]
            queries = torch.arange(s.past, s.past + s.n, device=q.device)[:, None]
            mask = (keys <= queries) & (keys > queries - window) if window else keys <= queries
        o = F.scaled_dot_product_attention(q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
                                           is_causal=causal, scale=scaling, enable_gqa=q.shape[0] != k.shape[1])
        out[s.start:s.start + s.n] = o[0].transpose(0, 1)
    if plan.decode_op:  # every decoding sequence in one call of hqtflow's CPU op, each over its own context
        out[plan.decode_rows] = _decode_op(plan, layer, query[0, :, plan.decode_rows].transpose(0, 1), scale, window,
                                           softcap, sinks)
        return out[None], None
    for s in plan.decode:  # one query per sequence, over its own context (window) only
        k, v = pool.read(layer, s.read[first_key(s.past, window):], query.dtype)
        out[s.start] = attend_one(query[0, :, s.start], k, v, scaling, softcap, sinks)
    return out[None], None


def _decode_op(plan: StepPlan, layer: int, q: torch.Tensor, scale: float, window: int | None, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The step's decoding rows q [sequences, heads, d] through hqtflow's CPU op, each over its own context."""
    pool = plan.pool
    ks, vs = pool.scales[layer] if pool.scales is not None else (None, None)
    slots, offsets = plan.decode_contexts(window)
    return torch.ops.hqtflow.paged_decode_attention(q, pool.keys[layer], pool.values[layer], slots, offsets, ks, vs,
                                                    scale, softcap, sinks)


@functools.cache
def cpu_ops() -> bool:
    """Whether hqtflow's CPU ops (built on first use; see quantize/cpu_kernel.py) are there for decode attention."""
    from hqtflow.quantize import cpu_kernel

    return cpu_kernel.load()


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, softcap: float = 0.0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One decoding query q [heads, d] over its context k, v [length, kv_heads, d], grouped heads (query head h
    uses KV head h // groups, as repeat_kv), float32 -> [heads, d]. `softcap`, `sinks`: see `softmax_capped`."""
    heads, d = q.shape
    kv_heads = k.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    qg = q.float().view(kv_heads, heads // kv_heads, d)
    scores = torch.matmul(qg, k.float().permute(1, 2, 0)) * scale  # [kv_heads, groups, length]
    if softcap or sinks is not None:
        probs = softmax_capped(scores, softcap, None if sinks is None else sinks.float().view(kv_heads, -1, 1))
    else:
        probs = scores.softmax(-1)
    return torch.matmul(probs, v.float().transpose(0, 1)).reshape(heads, d).to(q.dtype)


def softmax_capped(scores: torch.Tensor, softcap: float, sinks: torch.Tensor | None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last dim of float32 `scores` as transformers' eager attention takes it for Gemma 2 and gpt-oss:
    soft-capped first (`softcap` > 0: softcap * tanh(score / softcap)), then `bias` (0 or -inf) added, and a sink logit
    per query head (`sinks`, broadcast to scores[..., :1]) in the denominator, adding no value."""
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if sinks is None:
        return scores.softmax(-1)
    return torch.cat([scores, sinks.expand(*scores.shape[:-1], 1)], -1).softmax(-1)[..., :-1]


CHUNK_QUERIES = 256  # query rows whose float32 scores `attend_chunk` holds at once


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, past: int, lo: int,
                 window: int | None, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """A prefill chunk's queries q [heads, n, d] (positions past .. past + n - 1) over the keys and values k, v
    [L, kv_heads, d] of positions lo .. past + n - 1, causal (and within `window`), with `softmax_capped`'s soft-capping
    and sinks, float32 -> [n, heads, d] (for what SDPA does not compute), CHUNK_QUERIES query rows at a time."""
    heads, n, d = q.shape
    kv_heads = k.shape[1]
    kf, vf = k.float().permute(1, 2, 0)[:, None], v.float().transpose(0, 1)[:, None]  # [kv_heads, 1, d, L], [.., L, d]
    keys = torch.arange(lo, lo + k.shape[0], device=q.device)[None]
    sink = None if sinks is None else sinks.float().view(kv_heads, -1, 1, 1)
    out = q.new_empty(n, heads, v.shape[-1])
    for r in range(0, n, CHUNK_QUERIES):
        rows = min(CHUNK_QUERIES, n - r)
        queries = torch.arange(past + r, past + r + rows, device=q.device)[:, None]
        seen = (keys <= queries) & (keys > queries - window) if window else keys <= queries
        bias = torch.zeros(seen.shape, device=q.device).masked_fill(~seen, float("-inf"))  # [rows, L]
        qg = q[:, r:r + rows].float().reshape(kv_heads, heads // kv_heads, rows, d)
        probs = softmax_capped(torch.matmul(qg, kf) * scale, softcap, sink, bias)  # [kv_heads, groups, rows, L]
        out[r:r + rows] = torch.matmul(probs, vf).reshape(heads, rows, -1).transpose(0, 1).to(q.dtype)
    return out


def additive_mask(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask the engine's attention interface hands a model (SDPA's: boolean, or None where causal alone will
    do) as an eager attention adds it: 0 where a query sees a key, -inf elsewhere."""
    if mask is None:
        q, k = query.shape[-2], key.shape[-2]
        mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)[None, None]
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))


def decode_batch_attention(layer: int, plan: DecodeBatch, query, key, value, scaling, window: int | None = None,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A `DecodeBatch` step: query [1, heads, B, d] -> [1, B, heads, d]. Each row's context is gathered in the
    model's dtype ([B, kv_heads, L, d], slots past the row's position masked, and in a sliding-window layer those
    before its window) and attended by SDPA, the query heads that share a KV head being that head's query rows;
    SDPA's kernels keep the softmax in float32."""
    pool = plan.pool
    pool.write(layer, plan.write, key[0].transpose(0, 1), value[0].transpose(0, 1))
    b, length = plan.read.shape
    heads, d = query.shape[1], query.shape[3]
    k, v = pool.read(layer, plan.read.reshape(-1), query.dtype)  # [B * L, kv_heads, d]
    kv_heads = k.shape[1]
    k, v = (t.view(b, length, kv_heads, d).transpose(1, 2) for t in (k, v))
    q = query[0].transpose(0, 1).reshape(b, kv_heads, heads // kv_heads, d)
    bias = plan.bias  # -inf past each row's position (a dummy row sees slot 0)
    if window:  # and before its window (tensor ops on the static buffers: a CUDA graph replays them)
        old = plan.read_positions[None] <= plan.position_ids[0][:, None] - window  # [B, L]
        bias = bias.masked_fill(old[:, None, None], float("-inf"))
    if softcap or sinks is not None:  # what SDPA does not compute: float32 scores, as `attend_one`
        scale = scaling if scaling is not None else d ** -0.5
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, kvh, g, L]
        probs = softmax_capped(scores, softcap, None if sinks is None else sinks.float().view(1, kv_heads, -1, 1), bias)
        return torch.matmul(probs, v.float()).to(q.dtype).reshape(b, heads, d)[None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scaling)  # [B, kvh, g, d]
    return out.reshape(b, heads, d)[None]


@functools.cache
def register_attention(name: str, attention) -> None:
    """Register `attention` as `name` with transformers' attention interface, with SDPA's mask (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)


def install(model) -> None:
    """Register "hqtflow_paged" with transformers and switch the model to it."""
    register_attention(NAME, paged_attention)
    text = model.config.get_text_config(decoder=True)
    kind = getattr(text, "model_type", None) or "model"
    other = set(getattr(text, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    missing = [f"{t} layers" for t in sorted(other)]  # e.g. Llama 4's chunked, Qwen3-Next's linear attention
    if missing:
        raise ValueError(f"The serving engine's attention has no {' or '.join(missing)}, which this {kind} uses "
                         "(`hqtflow generate --engine transformers` runs it; `serve` cannot).")
    can_switch = getattr(model, "_can_set_attn_implementation", lambda: True)()
    if model.config._attn_implementation != NAME and can_switch:
        model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:  # transformers would only log that it cannot (Falcon, Bloom, MPT)
        raise ValueError(f"This {kind}'s attention does not go through transformers' attention interface, so the "
                         "serving engine cannot hold its KV cache (`hqtflow generate --engine transformers` runs it; "
                         "`serve` cannot).")


def geometry(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of the model's decoder; head_dim the wider of keys and values where they differ
    (MLA: DeepSeek's `qk_head_dim` and `v_head_dim`; the narrower is stored zero-padded)."""
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    groups = next((m.num_key_value_groups for m in model.modules() if hasattr(m, "num_key_value_groups")), None)
    # transformers groups query heads by the attention module's `num_key_value_groups`; a module without one has a
    # key/value head per query head whatever the config says (GPT-NeoX ignores a stray `num_key_value_heads`)
    kv = heads // groups if isinstance(groups, int) and groups > 0 else heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    widths = [w for k in ("qk_head_dim", "v_head_dim") if isinstance(w := getattr(text, k, None), int)]
    return text.num_hidden_layers, kv, max(widths) if len(widths) == 2 else max([head_dim, *widths])


def free_memory(device) -> tuple[int, str]:
    """Bytes a KV cache may take on `device` now, and what they are: a CUDA GPU's free memory, else the available RAM
    (within a cgroup's memory limit, as a container's is)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "free on the GPU"
    from hqtflow.hardware import available_memory_bytes

    available = available_memory_bytes()
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return available, "of available RAM"


CUDA_RESERVE = 0.10  # the share of a CUDA GPU's memory a KV cache leaves free (see reserved_memory)


def reserved_memory(device) -> int:
    """Bytes a KV cache leaves free on `device` for what the steps allocate beside it: on a CUDA GPU CUDA_RESERVE of
    its memory (a prefill chunk's activations and logits, cuBLAS's workspace, CUDA-graph pools; vLLM's default
    gpu_memory_utilization 0.9 leaves as much, TGI 10% of what its warm-up left free); none in RAM."""
    if torch.device(device).type != "cuda":
        return 0
    return int(CUDA_RESERVE * torch.cuda.get_device_properties(device).total_memory)


def num_blocks(model, *, block_size: int, dtype: torch.dtype, fp8: bool, device, max_batch_total_tokens: int | None,
               memory_fraction: float = 0.5) -> int:
    """Blocks for `max_batch_total_tokens` KV tokens (TGI's knob), or for `memory_fraction` of the free memory; KV
    tokens that need more than the free memory less `reserved_memory` are refused (ResourceError) before anything
    is allocated, and the default is capped by it."""
    from hqtflow.errors import ResourceError

    layers, kv, head_dim = geometry(model)
    per_token = KVPool.bytes_per_token(layers, kv, head_dim, dtype, fp8)
    free, what = free_memory(device)
    reserve = reserved_memory(device)
    usable = max(0, free - reserve)
    if max_batch_total_tokens is None:
        max_batch_total_tokens = int(min(free * memory_fraction, usable)) // per_token // block_size * block_size
        if max_batch_total_tokens == 0:
            kept = f" once {byte_size(reserve)} ({CUDA_RESERVE:.0%} of the GPU) is kept for the steps" if reserve else ""
            raise ResourceError(f"Too little memory is free for a KV cache: {byte_size(usable)} {what}{kept}, less "
                                f"than one block of {block_size} tokens ({block_size * per_token} bytes).")
    blocks = max(1, -(-max_batch_total_tokens // block_size))
    if (need := blocks * block_size * per_token) > usable:
        beside = (f" beside the {byte_size(reserve)} ({CUDA_RESERVE:.0%} of the GPU) kept for the steps' activations and "
                  "workspaces" if reserve else "")
        raise ResourceError(f"A KV cache of {max_batch_total_tokens} tokens needs {byte_size(need)} ({per_token} bytes a token), "
                            f"more than the {byte_size(usable)} {what}{beside}.")
    return blocks
