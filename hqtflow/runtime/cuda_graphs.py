"""CUDA graphs for decode steps (the TGI/vLLM way): each step shape is captured once and replayed with its inputs
copied into static buffers, so a decode step costs one graph launch instead of hundreds of kernel launches from Python.

Shapes are bucketed: the batch to the next of `batch_sizes` (TGI's `--cuda-graphs`, default 1, 2, 4, 8, 16, 32), each
sequence's context to the next power of two from 256 slots. A step the buckets do not cover (larger batch, longer
context) runs eagerly. Capture happens the first time a shape is met, on that step's own inputs (the warm-up runs
before capture write the same keys and values to the same slots, so they change nothing). All graphs share one
memory pool. A capture that fails turns graphs off for the engine (the reason is in `failed`) and the step runs eagerly.
With `capture=False` the same bucketed, batched step runs eagerly (what tests check on a CPU).
"""

from __future__ import annotations

import logging

import torch

from hqtflow.runtime.paged import DecodeBatch, KVPool, stepping

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
MIN_CONTEXT = 256


def capture(fn, pool=None, warmup: int = 2):
    """(graph, fn's output) with fn() captured once as a CUDA graph; `warmup` eager runs on a side stream first (cuBLAS
    workspaces, compiled kernels and lazy buffers are made outside the graph). `graph.replay()` reruns it."""
    from hqtflow.quantize.fp8_linear import capturing

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with capturing():
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """TGI's --cuda-graphs: "1,2,4,8" -> (1, 2, 4, 8); "0" or "" -> () (graphs off)."""
    try:
        sizes = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
    except ValueError:
        sizes = [-1]
    if any(s < 0 for s in sizes):
        raise ValueError(f"--cuda-graphs takes non-negative batch sizes, not {text!r}.")
    return tuple(s for s in sizes if s > 0)


class DecodeGraphs:
    """The engine's decode-only steps as CUDA graphs, one per (batch bucket, context bucket), captured on first use."""

    def __init__(self, model, pool: KVPool, batch_sizes: tuple[int, ...], scratch: int, *, capture: bool = True,
                 compile: bool = False):
        self.model, self.pool, self.scratch, self.capture = model, pool, scratch, capture
        # compile: the step through torch.compile (gpt-fast's "reduce-overhead": inductor fuses the norms, rotary,
        # residuals, attention's elementwise ops and the FP8 input quantization); shapes dynamic, so the buckets share
        # one compile. Dynamo specializes a size of 1, so one sequence runs in the bucket of 2 (a dummy row, nearly
        # free in a weight-bound step) rather than paying a second compile (a minute or two for an 8B model).
        self.batch_sizes = tuple(sorted({max(2, b) if compile else b for b in batch_sizes}))
        self._step = self._forward
        if compile:
            from hqtflow.runtime.static_decode import use_persistent_compile_cache

            use_persistent_compile_cache()
            self._step = torch.compile(self._forward, dynamic=True)
        self.max_context = pool.num_blocks * pool.block_size
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeBatch, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.no_mask = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=pool.device)  # 4-D: transformers makes no mask
        self.failed: str | None = None
        self.rows = 0  # rows (sequences + dummies) of the last step run

    def shape(self, batch: int, context: int) -> tuple[int, int] | None:
        """(batch bucket, context bucket) for `batch` sequences of at most `context` tokens, or None (run eagerly)."""
        b = next((s for s in self.batch_sizes if s >= batch), None)
        length = MIN_CONTEXT
        while length < context:
            length *= 2
        if b is None or self.failed or context > self.max_context:
            return None
        return b, -(-length // self.pool.block_size) * self.pool.block_size

    def _forward(self, plan: DecodeBatch) -> torch.Tensor:
        return self.model(input_ids=plan.input_ids, position_ids=plan.position_ids, attention_mask=self.no_mask,
                          use_cache=False, paged=plan).logits[0]

    def run(self, seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor | None:
        """seqs: (token id, position, block table) of each decoding sequence -> logits [len(seqs), vocab], or None
        when the step runs eagerly."""
        key = self.shape(len(seqs), max(p for _, p, _ in seqs) + 1)
        if key is None:
            return None
        self.rows = key[0]
        if not self.capture:
            plan = DecodeBatch(self.pool, *key, self.scratch)
            plan.fill(seqs)
            with stepping(plan):
                return self._step(plan)[: len(seqs)]
        entry = self.graphs.get(key)
        if entry is None:
            plan = DecodeBatch(self.pool, *key, self.scratch)
            plan.fill(seqs)
            if not self._try_capture(key, plan):
                return None
            entry = self.graphs[key]
        graph, plan, logits = entry
        plan.fill(seqs)
        graph.replay()
        return logits[: len(seqs)]

    def buckets(self, max_context: int) -> list[tuple[int, int]]:
        """Every (batch bucket, context bucket) that steps of sequences of at most `max_context` tokens use."""
        keys, context = set(), MIN_CONTEXT
        limit = min(max_context, self.max_context)
        while True:
            keys.update(k for k in (self.shape(b, min(context, limit)) for b in self.batch_sizes) if k is not None)
            if context >= limit:
                return sorted(keys)
            context *= 2

    @torch.inference_mode()  # as the engine's steps run: no autograd record kept alive by a graph's output
    def capture_all(self, max_context: int) -> int:
        """Capture now every (batch bucket, context bucket) a sequence of at most `max_context` tokens can meet (TGI
        does this at warm-up: no capture, and no compile of a new shape, then happens while requests wait); returns
        the number of graphs. Each is captured on dummy rows only (they write and read the scratch slot)."""
        if not self.capture:
            return 0
        for key in self.buckets(max_context):
            if key not in self.graphs:
                plan = DecodeBatch(self.pool, *key, self.scratch)
                plan.fill([])
                if not self._try_capture(key, plan):
                    break
        return len(self.graphs)

    def _try_capture(self, key: tuple[int, int], plan: DecodeBatch) -> bool:
        """Capture `plan`'s step as graph `key`; a failure turns graphs off for good (the reason in `failed`, logged)."""
        try:
            with stepping(plan):
                graph, logits = capture(lambda: self._step(plan), pool=self.mempool)
        except Exception as e:  # noqa: BLE001 - graphs are an optimization: run eagerly from now on
            self.failed = f"{type(e).__name__}: {e}"
            logging.getLogger("hqtflow").warning("CUDA graph capture failed, decode steps run eagerly from now on: %s",
                                                 self.failed)
            torch.cuda.synchronize()
            return False
        self.graphs[key] = (graph, plan, logits)
        return True
