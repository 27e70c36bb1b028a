"""The serving engine: continuous batching over a paged KV cache (see runtime/paged.py).

One background thread owns the model and a `KVPool` of fixed-size KV blocks (bf16, or FP8 with the checkpoint's
k_scale/v_scale). Each step runs one flattened forward over every running sequence's next tokens: one token per
decoding sequence and a prefill chunk (at most `max_prefill_tokens`, cut at fixed multiples of it, so a prompt's
chunks are the same whatever else runs) for sequences still reading their prompt, up to `max_prefill_tokens`
prompt tokens per step; several waiting requests can join in one step (a chunk that does not fit what is left of
the budget waits, the earliest prefilling sequence always getting its whole chunk, and shorter ones behind it take the
rest). Attention runs per sequence on its own blocks, so a request's output does not depend on its neighbours. Waiting requests are admitted (FIFO) while free
blocks hold their prompt; when a decoding sequence needs a block and none is free, the most recently admitted
sequence is preempted (its blocks freed; when it is admitted again, its prompt is recomputed in the same chunks and
what it had generated one token a step, as each was computed first, so its output does not depend on the preemption).
Cancelled and finished requests leave at the next step. Each generated token is reported to the request's `emit`
callback (called on the engine thread). `step()` runs one step from the caller's thread when the engine thread is
not started (benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from hqtflow.runtime.memory import trim
from hqtflow.runtime.threads import release_openmp_pool

STOPPED = "the engine has stopped"  # the error of a request stop() leaves unfinished


@dataclass
class SamplingParams:
    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    typical_p: float = 1.0
    presence_penalty: float = 0.0  # OpenAI: minus this once per token already generated
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count among the generated tokens
    tgi_frequency_penalty: float = 0.0  # TGI: minus this times the token's frequency in prompt + generated tokens
    logit_bias: dict[int, float] | None = None
    watermark: bool = False  # TGI's Kirchenbauer et al. watermark (gamma 0.5, delta 2.0)
    top_n: int = 0  # top-n logprobs of each generated token
    top_n_ties: bool = False  # TGI's "fuzzy" top-n: also every token tied with the n-th; else exactly n (OpenAI's)
    processed_logprobs: bool = False  # logprobs of the distribution sampled from (TGI's); else the model's (OpenAI's)
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the top k
    prompt_logprobs_from: int = 1  # the first prompt token scored; those before get (None, []) (scoring a continuation)
    grammar: object | None = None  # an xgrammar CompiledGrammar (see runtime/grammar.py)
    ignore_eos: bool = False  # keep generating after EOS (benchmarks: every request runs max_new_tokens)


@dataclass
class Token:
    id: int
    text: str
    logprob: float
    special: bool
    top: list[tuple[int, float]] | None = None  # the top-n tokens of the distribution (id, logprob)


@dataclass
class Event:
    """One generated token; the last event of a request also has finish_reason and generated_text."""
    index: int
    token: Token | None
    finish_reason: str | None = None  # "length" | "eos_token" | "stop_sequence"
    generated_text: str | None = None  # every generated token's text (a matched stop sequence included, as TGI)
    stop_at: int | None = None  # "stop_sequence": where the stop sequence starts in generated_text (OpenAI cuts there)
    error: str | None = None
    prompt: list[tuple[float | None, list[tuple[int, float]]]] | None = None  # first and last event, if prompt_logprobs


@dataclass(eq=False)  # a request is itself: identity, never field-by-field (two equal prompts are two requests)
class Request:
    input_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    generated: list[int] = field(default_factory=list)
    text: str = ""
    visible: list[int] = field(default_factory=list)  # the tokens decoded: `lead`'s, then the generated ones with text
    window: tuple[int, int] = (0, 0)  # incremental detokenization: (prefix start, read end) in `visible`
    lead: str = ""  # the text of the prompt token that opens `visible` (open_text), not part of the answer
    cancelled: bool = False
    finished: bool = False
    generator: torch.Generator | None = None
    seed: int | None = None
    matcher: object | None = None  # xgrammar GrammarMatcher
    bitmask: torch.Tensor | None = None  # the matcher's allowed tokens (grammar.bitmask), made at its first step
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # params.logit_bias as (ids, values), made at its first step
    prompt: list | None = None
    t_submit: float = 0.0
    t_waiting: float | None = None  # when its current wait in the queue began (None while it runs)
    waited: float = 0.0  # seconds of its finished waits in the queue: the first, and each after a preemption
    t_first: float | None = None
    blocks: list[int] = field(default_factory=list)  # block table in the engine's KVPool
    slot_table: torch.Tensor | None = None  # every slot of `blocks` in position order (Engine._slots)
    computed: int = 0  # tokens (prompt then generated) whose keys/values are in the blocks
    preempted: int = 0  # times its blocks were taken back (it is then recomputed)

    @property
    def tokens(self) -> list[int]:
        return self.input_ids + self.generated

    def cancel(self) -> None:
        self.cancelled = True

    def queue_time(self, now: float) -> float:
        """Seconds it waited in the queue up to `now`: every wait, the first and each after a preemption (TGI's
        x-queue-time and tgi_request_queue_duration; the rest since submission is inference time)."""
        return self.waited + (now - self.t_waiting if self.t_waiting is not None else 0.0)

    def open_text(self, decode: Callable[[list[int]], str]) -> None:
        """Open the detokenization window at the prompt's last token, as TGI's prefix offset does: decoded after it,
        the answer keeps the first space a SentencePiece decoder strips from the start of a text (Llama 2, Mistral:
        " Paris", not "Paris"). Not when that token holds part of a character (or no text)."""
        lead = decode(self.input_ids[-1:]) if self.input_ids else ""
        if lead and "\ufffd" not in lead:
            self.visible, self.window, self.lead = self.input_ids[-1:], (0, 1), lead


@dataclass
class Stats:
    steps: int = 0
    preemptions: int = 0
    max_running: int = 0


def eos_ids(model, tokenizer) -> set[int]:
    """The ids that end a sequence: generation_config's EOS ids and the tokenizer's (a chat fine-tune's end-of-turn,
    as vLLM stops on both; a base model's generation_config often names only its own)."""
    eos = model.generation_config.eos_token_id
    return {i for i in [*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id] if i is not None}


class Engine:
    """Continuous batching over a paged KV cache; one flattened forward per step (decode tokens + prefill chunks)."""

    def __init__(self, model, tokenizer, *, max_batch_size: int = 0, on_step: Callable[[str, int, float, tuple], None] | None = None,
                 batch_bucket: int = 1, pad_to_multiple: int = 1, prefill_bucket: int = 1, max_prefill_tokens: int = 4096,
                 max_batch_total_tokens: int | None = None, kv_cache: str = "bf16", block_size: int = 16,
                 trim_interval: float = 2.0, cuda_graphs: tuple[int, ...] | None = None, capture: bool = True,
                 compile: bool = False):
        """max_batch_size: running sequences at most (0: as many as the KV blocks hold). max_batch_total_tokens: KV
        tokens the pool holds (None: half the free memory, a quarter on CPU). kv_cache: "bf16" (the model's dtype)
        or "fp8" (the checkpoint's k_scale/v_scale; ValueError without them). Static shapes (Gaudi-style): a
        decode-only step is padded to a multiple of `batch_bucket` tokens, a step with prefill to a multiple of
        `pad_to_multiple * prefill_bucket` tokens (dummy tokens whose KV is not stored). cuda_graphs: batch sizes
        whose decode-only steps are CUDA graphs (runtime/cuda_graphs.py; None: TGI's 1..32 on CUDA, none on a CPU;
        () for none); `capture=False` runs those steps batched but eagerly (tests). compile: those steps through
        torch.compile (runtime/cuda_graphs.py)."""
        from hqtflow.runtime import paged, rope

        if kv_cache not in ("bf16", "fp8"):
            raise ValueError(f"kv_cache must be bf16 or fp8, not {kv_cache!r}.")
        self.model, self.tok = model.eval(), tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.on_step = on_step  # (kind "prefill"|"decode", sequences, seconds, (sequences, tokens) run)
        self.batch_bucket, self.pad_to_multiple = max(1, batch_bucket), max(1, pad_to_multiple)
        self.prefill_bucket, self.max_prefill_tokens = max(1, prefill_bucket), max(1, max_prefill_tokens)
        self.trim_interval, self._last_trim = trim_interval, time.monotonic()  # see runtime/memory.py
        self.eos = eos_ids(model, tokenizer)
        self.guard = getattr(model, "fp16_guard", None)  # fp16 overflow, checked per request (_overflowed)
        self.special = set(tokenizer.all_special_ids)
        self._decode = fast_decode(tokenizer)
        scales = None
        if kv_cache == "fp8":
            from hqtflow.runtime.kv_cache import kv_scales

            scales = kv_scales(model)
        paged.install(model)
        per_request_rope = rope.install(model)  # dynamic/longrope: each request's own frequencies, in eager steps
        if self.device.type == "cpu":
            paged.cpu_ops()  # build (once per machine) or load the decode attention op now, not in the first step
        layers, kv_heads, head_dim = paged.geometry(model)
        from hqtflow import models

        dtype = models.compute_dtype(model)
        self.compute_dtype = dtype  # what the model computes in (an FP8 model's too): /info's model_dtype
        fraction = 0.25 if self.device.type == "cpu" else 0.5
        blocks = paged.num_blocks(model, block_size=block_size, dtype=dtype, fp8=scales is not None, device=self.device,
                                  max_batch_total_tokens=max_batch_total_tokens, memory_fraction=fraction)
        self.pool = paged.KVPool(layers=layers, kv_heads=kv_heads, head_dim=head_dim, num_blocks=blocks, block_size=block_size,
                                 dtype=dtype, device=self.device, scales=scales)
        self.kv_cache = kv_cache
        self.graphs = None
        if cuda_graphs is None:
            from hqtflow.runtime.cuda_graphs import DEFAULT_BATCH_SIZES

            cuda_graphs = DEFAULT_BATCH_SIZES if self.device.type == "cuda" and not per_request_rope else ()
        if cuda_graphs and capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs (--cuda-graphs) need a CUDA GPU; this model runs on {self.device.type} "
                             "(give --cuda-graphs 0).")
        if cuda_graphs and per_request_rope:
            raise ValueError("This model's RoPE frequencies depend on each request's length (dynamic or longrope), "
                             "which a CUDA-graph decode step cannot take (give --cuda-graphs 0).")
        if compile and not cuda_graphs:
            raise ValueError("--compile compiles the CUDA-graph decode steps: it needs a CUDA GPU and --cuda-graphs "
                             "other than 0.")
        if cuda_graphs:
            from hqtflow.runtime.cuda_graphs import DecodeGraphs

            scratch = self.pool.allocate(1)[0] * block_size  # the slot dummy rows write and read; no sequence owns it
            self.pool.zero(scratch)
            self.graphs = DecodeGraphs(model, self.pool, tuple(cuda_graphs), scratch, capture=capture, compile=compile)
        self.stats = Stats()
        self.pending: deque[Request] = deque()
        self.active: list[Request] = []  # running sequences in admission order, each holding its blocks
        self._cv = threading.Condition()
        self._stop = False
        self._abort: str | None = None  # set by abort(): every request ends with it as its error
        self._thread: threading.Thread | None = None

    # -- public API (any thread) -------------------------------------------------------------------------
    def start(self) -> "Engine":
        """Run the engine on its own thread. The caller's OpenMP workers are freed first (see runtime/threads.py):
        call it from the thread that loaded the model."""
        release_openmp_pool()
        self._thread = threading.Thread(target=self._loop, name="hqtflow-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """The engine's thread is alive (not stopped, nor died of an error outside a step)."""
        return self._thread is not None and self._thread.is_alive()

    def abort(self, reason: str) -> None:
        """End every running and waiting request with `reason` as its error (at the engine's next step): a server
        shutting down ends its streams with an error event instead of cutting their connections."""
        with self._cv:
            self._abort = reason
            self._cv.notify()

    def stop(self, wait: float = 30.0) -> None:
        """Stop the engine thread, waiting at most `wait` seconds for its step to end: requests still running or
        waiting, and any submitted later, end with an error (so a blocking generate() returns)."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            if self._thread is None:  # stepped from the caller's thread (bench): no loop is left to end them
                self._end_all(STOPPED)
        if self._thread:
            self._thread.join(timeout=wait)

    @property
    def capacity_tokens(self) -> int:
        """KV tokens the pool holds."""
        return self.pool.num_blocks * self.pool.block_size

    @property
    def kv_tokens(self) -> int:
        """KV tokens held by the running sequences (their blocks)."""
        return sum(len(r.blocks) for r in self.active) * self.pool.block_size

    def submit(self, input_ids: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Request:
        now = time.monotonic()
        req = Request(list(input_ids), params, emit, t_submit=now, t_waiting=now)
        req.open_text(self._decode)
        if params.grammar is not None:
            from hqtflow.runtime.grammar import matcher

            req.matcher = matcher(params.grammar)
        if params.do_sample:
            req.seed = params.seed if params.seed is not None else random.randrange(2**63)
            req.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        with self._cv:
            if self._stop:  # nothing would ever run it
                req.finished = True
                req.emit(Event(0, None, error=STOPPED))
            else:
                self.pending.append(req)
                self._cv.notify()
        return req

    def generate(self, input_ids: list[int], params: SamplingParams) -> list[Event]:
        """Blocking helper: every event of one request."""
        events, done = [], threading.Event()

        def emit(ev):
            events.append(ev)
            if ev.finish_reason or ev.error:
                done.set()

        self.submit(input_ids, params, emit)
        done.wait()
        return events

    def step(self) -> bool:
        """Admit what fits and run one step (from the caller's thread, when the engine thread is not started);
        False when there was nothing to do."""
        with self._cv:
            self._admit()
        if not self.active:
            return False
        self._run_step()
        return True

    # -- engine thread -------------------------------------------------------------------------------------
    def _trim(self, idle: bool) -> None:
        if self.trim_interval and (idle or time.monotonic() - self._last_trim > self.trim_interval):
            trim()
            self._last_trim = time.monotonic()

    def _loop(self) -> None:
        try:
            self._serve_requests()
        except Exception as e:  # outside a step (a step's errors end its requests and serving goes on)
            with self._cv:  # nothing will run what waits, nor what comes later: they end with the reason now
                self._stop = True
                self._end_all(f"{STOPPED} ({type(e).__name__}: {e})")
            raise

    def _serve_requests(self) -> None:
        while True:
            with self._cv:
                if not self._stop and not self.pending and not self.active:
                    self._trim(idle=True)
                while not self._stop and not self.pending and not self.active:
                    self._cv.wait()
                if self._stop:
                    self._end_all(STOPPED)
                    return
                if self._abort is not None:
                    self._end_all(self._abort)
                    continue
                self._admit()
            if self.active:
                self._run_step()
            elif self.pending:  # nothing fits and nothing runs: the first waiting request can never fit
                with self._cv:
                    req = self.pending.popleft()
                req.emit(Event(0, None, error=f"ValueError: the prompt ({len(req.tokens)} tokens) does not fit in the "
                                              f"KV cache ({self.capacity_tokens} tokens)"))
            self._trim(idle=False)

    def _run_step(self) -> None:
        plan = []
        try:
            with torch.inference_mode():
                plan = self._schedule()
                if plan:
                    self._forward(plan)
        except Exception as e:  # noqa: BLE001 - report to every request, keep serving
            for r in self.active:
                r.emit(Event(len(r.generated), None, error=f"{type(e).__name__}: {e}"))
                r.finished = True
        self._drop_finished()

    def _admit(self) -> None:
        """Waiting requests join (called under the lock): FIFO, while the batch has room and free blocks hold
        the request's tokens (its prompt, plus what it generated before a preemption) and its next one. Requests
        whose clients left while waiting leave the queue (and tgi_queue_size) at once, wherever they stand in it."""
        if any(r.cancelled for r in self.pending):
            self.pending = deque(r for r in self.pending if not r.cancelled)
        while self.pending and (not self.max_batch_size or len(self.active) < self.max_batch_size):
            req = self.pending[0]
            need = self.pool.blocks_for(len(req.tokens) + 1)
            if need > self.pool.num_free:
                break
            self.pending.popleft()
            req.blocks, req.computed, req.slot_table = self.pool.allocate(need), 0, None
            req.waited, req.t_waiting = req.queue_time(time.monotonic()), None
            self.active.append(req)
        self.stats.max_running = max(self.stats.max_running, len(self.active))

    def _preempt(self, req: Request) -> None:
        """Give `req`'s blocks back; it waits at the head of the queue and is recomputed when admitted again."""
        self.pool.free(req.blocks)
        req.blocks, req.computed, req.slot_table = [], 0, None
        req.preempted += 1
        req.t_waiting = time.monotonic()
        self.stats.preemptions += 1
        self.active.remove(req)
        with self._cv:
            self.pending.appendleft(req)

    def _schedule(self) -> list[tuple[Request, int]]:
        """(request, new tokens) for this step: every decoding sequence's next token (growing its block table,
        preempting the newest sequences when blocks run out), then prefill chunks within max_prefill_tokens, in
        admission order (a chunk that does not fit what is left is passed over: the first prefilling sequence always
        gets its whole chunk, so none waits on those behind it)."""
        self._drop_finished()
        plan: list[tuple[Request, int]] = []
        for req in list(self.active):
            if req not in self.active or not _decoding(req):
                continue
            while self.pool.blocks_for(req.computed + 1) > len(req.blocks):
                if self.pool.num_free:
                    req.blocks += self.pool.allocate(1)
                    continue
                victim = self.active[-1]
                self._preempt(victim)
                plan = [(r, n) for r, n in plan if r is not victim]
                if victim is req:
                    break
            if req in self.active:
                plan.append((req, 1))
        budget, chunk = self.max_prefill_tokens, self.max_prefill_tokens
        for req in self.active:
            if _decoding(req):
                continue
            if req.computed < len(req.input_ids):  # chunks end at multiples of `chunk`: the same under any load
                n = min(len(req.input_ids) - req.computed, chunk - req.computed % chunk)
            else:  # what it generated before a preemption: a token a step, as it was computed first (decode attention)
                n = 1
            if n > budget:  # its fixed chunk waits for a later step; those behind it may take the rest
                continue
            budget -= n
            plan.append((req, n))
        return plan

    def _forward(self, plan: list[tuple[Request, int]]) -> None:
        t = time.perf_counter()
        logits = None
        with self.guard.deferred() if self.guard is not None else contextlib.nullcontext():
            if self.graphs is not None and all(n == 1 and _decoding(req) for req, n in plan):
                logits = self.graphs.run([(req.generated[-1], req.computed, req.blocks) for req, _ in plan])
            if logits is not None:
                rows, kind, shape = [(req, 1, i, []) for i, (req, _) in enumerate(plan)], "decode", (len(plan), self.graphs.rows)
                logits = logits.float()
            else:
                logits, rows, kind, shape = self._eager_forward(plan)
        if self.guard is not None:
            rows = self._overflowed(logits, rows)
        if self.on_step:
            self.on_step(kind, len(plan), time.perf_counter() - t, shape)
        self.stats.steps += 1
        live, live_rows = [], []
        for req, n, first, scored in rows:
            req.computed += n
            if req.params.prompt_logprobs is not None and req.prompt is None:
                req.prompt = [(None, [])] * _unscored(req)  # the first prompt token has no logprob (all a one-token prompt has)
            if scored:
                req.prompt += self._prompt_logprobs(req, logits[first:first + len(scored)], scored)
            if req.computed < len(req.tokens):
                continue
            if req.params.max_new_tokens <= 0:  # prompt scoring only (OpenAI max_tokens=0 with echo)
                req.finished = True
                req.emit(Event(0, None, "length", "", prompt=req.prompt))
                continue
            live.append(req)
            live_rows.append(first + len(scored))
        if live:
            consecutive = live_rows == list(range(live_rows[0], live_rows[0] + len(live_rows)))  # no copy needed
            picked = logits[live_rows[0]:live_rows[0] + len(live)] if consecutive else logits[live_rows]
            for req, tok in zip(live, self._sample(live, picked)):
                if not req.finished:  # (one whose sampling failed has had its error)
                    self._emit(req, tok)

    def _overflowed(self, logits: torch.Tensor, rows: list) -> list:
        """(fp16: the model's api.Fp16Overflow guard) `rows` less the requests any of whose logits rows hold NaN or
        infinity: each ends alone with the guard's sentence, its neighbours go on. One host sync."""
        finite = torch.isfinite(logits).all(-1).tolist()
        ends = [first for _, _, first, _ in rows[1:]] + [len(finite)]  # a request's rows: its first to the next's
        keep = []
        for (req, n, first, scored), end in zip(rows, ends):
            if all(finite[first:end]):
                keep.append((req, n, first, scored))
            else:
                e = self.guard.trip()
                req.emit(Event(len(req.generated), None, error=f"{type(e).__name__}: {e}"))
                req.finished = True
        return keep

    def _eager_forward(self, plan: list[tuple[Request, int]]) -> tuple[torch.Tensor, list, str, tuple[int, int]]:
        """One flattened forward of the step -> (kept logits, rows (request, new tokens, first kept row, scored
        prompt positions), "prefill" | "decode", (sequences, tokens run))."""
        from hqtflow.runtime.paged import Seq, StepPlan, stepping

        ids, pos, seqs, keep, rows = [], [], [], [], []  # rows: (request, n, first kept row, scored prompt positions)
        for req, n in plan:
            past, toks = req.computed, req.tokens
            start = len(ids)
            ids += toks[past:past + n]
            pos += range(past, past + n)
            table = self._slots(req)
            seqs.append(Seq(start, n, past, table[past:past + n], table[:past + n], len(req.input_ids)))
            scored = []
            if req.params.prompt_logprobs is not None:  # logits at prompt position i score prompt token i + 1
                done = len(req.prompt) if req.prompt else _unscored(req)  # prompt tokens scored (the first needs none)
                scored = [i for i in range(past, past + n) if done - 1 <= i < len(req.input_ids) - 1]
            first = len(keep)
            keep += [start + i - past for i in scored]
            if past + n == len(toks):
                keep.append(start + n - 1)
            rows.append((req, n, first, scored))
        prefill = any(n > 1 or req.computed == 0 for req, n in plan)
        multiple = self.pad_to_multiple * self.prefill_bucket if prefill else self.batch_bucket
        real = len(ids)
        ids += [0] * (-real % multiple)
        pos += [0] * (len(ids) - real)
        step = StepPlan(self.pool, seqs, len(ids))
        with stepping(step):
            out = self.model(input_ids=torch.tensor([ids], device=self.device), position_ids=torch.tensor([pos], device=self.device),
                             use_cache=False, logits_to_keep=torch.tensor(keep, dtype=torch.long, device=self.device), paged=step)
        return out.logits[0].float(), rows, "prefill" if prefill else "decode", (len(plan), len(ids))

    def _slots(self, req: Request) -> torch.Tensor:
        """Every slot of req's blocks in position order: built when its block table is new or has grown (every
        `block_size` tokens), not twice per step."""
        if req.slot_table is None or len(req.slot_table) != len(req.blocks) * self.pool.block_size:
            req.slot_table = self.pool.slots(req.blocks, 0, len(req.blocks) * self.pool.block_size)
        return req.slot_table

    def _prompt_logprobs(self, req: Request, logits: torch.Tensor, positions: list[int]) -> list:
        """[(logprob of prompt token i + 1 given the ones before, top-k [(id, logprob)])] for the positions i."""
        k, ids = req.params.prompt_logprobs, torch.tensor([req.input_ids[i + 1] for i in positions], device=logits.device)
        out: list = []
        for start in range(0, len(ids), 512):  # bounded float32 [chunk, vocab] at a time
            lp = torch.log_softmax(logits[start: start + 512].float(), dim=-1)
            chosen = lp.gather(1, ids[start: start + 512, None])[:, 0].tolist()
            top = lp.topk(k, dim=-1) if k else None
            for j, c in enumerate(chosen):
                out.append((c, list(zip(top.indices[j].tolist(), top.values[j].tolist())) if k else []))
        return out

    def _end_all(self, reason: str) -> None:
        """(Under the lock.) Every request ends with `reason` as its error; new ones too, from now on."""
        for req in [*self.active, *self.pending]:
            self.pool.free(req.blocks)
            req.blocks, req.slot_table, req.finished = [], None, True
            if not req.cancelled:
                req.emit(Event(len(req.generated), None, error=reason))
        self.active, self.pending = [], deque()

    def _drop_finished(self) -> None:
        keep = []
        for req in self.active:
            if req.cancelled or req.finished:
                self.pool.free(req.blocks)
                req.blocks, req.slot_table = [], None
            else:
                keep.append(req)
        self.active = keep

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[tuple[int, float, list | None]]:
        """Each row's token, its logprob and the top-n (id, logprob): of the model's distribution (raw log_softmax),
        or, for a request with `processed_logprobs` whose logits a processor or warper changes, of the distribution
        it samples from (TGI's), computed once per such row instead of the raw one."""
        own = [r.params.processed_logprobs and (r.params.do_sample or _processed(r)) for r in reqs]
        raw = [row for row, o in enumerate(own) if not o]  # the rows whose logprobs are the model's
        greedy = logits.max(-1).indices  # each row's pick if no processor changes it: the first max (argmax's, faster on CPU)
        if len(raw) == len(reqs):  # greedy picks and their logprobs in one transfer; float64 holds any token id
            logprobs = torch.log_softmax(logits, dim=-1)
            picked = torch.stack([greedy.double(), logprobs.gather(1, greedy[:, None])[:, 0].double()]).tolist()
            toks, chosen = [int(t) for t in picked[0]], picked[1]
        else:
            logprobs = torch.log_softmax(logits[raw], dim=-1) if raw else None
            toks, chosen = [int(t) for t in greedy.tolist()], [0.0] * len(reqs)
        at = {row: i for i, row in enumerate(raw)}  # a raw row's row in `logprobs`
        processed: dict[int, torch.Tensor] = {}  # an `own` row's logprobs of its processed distribution
        changed = []  # processors change a row in place: the step's logits are not read after this
        for row, req in enumerate(reqs):
            p = req.params
            try:  # a request whose processors or sampling fail ends alone: its neighbours in the batch go on
                if p.do_sample:
                    x = _warp(self._process(req, logits[row]), p)
                    # from softmax in both cases, so a seed picks the same token whichever logprobs are asked for
                    toks[row] = int(torch.multinomial(x.softmax(-1), 1, generator=req.generator))
                    if own[row]:
                        processed[row] = torch.log_softmax(x, -1)
                    changed.append(row)
                elif _processed(req):
                    x = self._process(req, logits[row])
                    toks[row] = int(x.argmax())
                    if own[row]:
                        processed[row] = torch.log_softmax(x, -1)
                    changed.append(row)
                if req.matcher is not None:
                    req.matcher.accept_token(toks[row])
            except Exception as e:  # noqa: BLE001 - reported to this request only
                req.emit(Event(len(req.generated), None, error=f"{type(e).__name__}: {e}"))
                req.finished = True
        rows = changed if len(raw) == len(reqs) else raw  # the raw rows whose logprob is not yet in `chosen`
        if rows:
            idx = torch.tensor([at[r] for r in rows], device=logits.device)
            for row, v in zip(rows, logprobs[idx, torch.tensor([toks[r] for r in rows], device=logits.device)].tolist()):
                chosen[row] = v
        if processed:  # in one transfer
            for row, v in zip(processed, torch.stack([lp[toks[row]] for row, lp in processed.items()]).tolist()):
                chosen[row] = v
        listed = [row for row, req in enumerate(reqs) if req.params.top_n and not req.finished]
        tops = dict(zip(listed, _top_tokens([processed[row] if row in processed else logprobs[at[row]] for row in listed],
                                            [reqs[row].params.top_n for row in listed],
                                            [reqs[row].params.top_n_ties for row in listed]) if listed else []))
        return [(toks[row], chosen[row], tops.get(row)) for row in range(len(reqs))]

    def _process(self, req: Request, x: torch.Tensor) -> torch.Tensor:
        """Logits processors in TGI's order: watermark, penalties, logit bias, grammar (on `x` in place)."""
        p = req.params
        if p.watermark and req.input_ids + req.generated:
            rng = torch.Generator().manual_seed(15485863 * (req.input_ids + req.generated)[-1])
            x[torch.randperm(x.numel(), generator=rng)[: int(x.numel() * 0.5)].to(x.device)] += 2.0
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.input_ids + req.generated, device=x.device).unique()
            s = x[seen]
            # a huge penalty overflows to -inf (with a grammar, no token was left), a tiny one to inf (NaN logprobs)
            f = torch.finfo(x.dtype)
            x[seen] = torch.where(s < 0, s * p.repetition_penalty, s / p.repetition_penalty).clamp_(f.min, f.max)
        if p.tgi_frequency_penalty:
            every = torch.tensor(req.input_ids + req.generated, device=x.device)
            x -= torch.bincount(every, minlength=x.numel())[: x.numel()].float() / every.numel() * p.tgi_frequency_penalty
        if (p.presence_penalty or p.frequency_penalty) and req.generated:
            counts = torch.bincount(torch.tensor(req.generated, device=x.device), minlength=x.numel())[: x.numel()].float()
            x -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
        if p.logit_bias:  # one indexed add (its ids are distinct): a bias on every token costs one op, not 49k
            if req.bias is None or req.bias[0].device != x.device:
                req.bias = (torch.tensor(list(p.logit_bias), device=x.device),
                            torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device))
            x[req.bias[0]] += req.bias[1]
        if req.matcher is not None:
            from hqtflow.runtime.grammar import bitmask, mask_logits

            req.bitmask = bitmask(x.numel()) if req.bitmask is None else req.bitmask
            mask_logits(req.matcher, x, req.bitmask)
        return x

    def _emit(self, req: Request, chosen: tuple[int, float, list | None]) -> None:
        tok, logprob, top = chosen
        req.t_first = req.t_first or time.monotonic()
        req.generated.append(tok)
        special = tok in self.special
        finish, stop_at = None, None
        if (tok in self.eos and not req.params.ignore_eos) or (req.matcher is not None and req.matcher.is_terminated()):
            finish, text = "eos_token", self._decode([tok])
        else:
            if len(req.generated) >= req.params.max_new_tokens:
                finish = "length"
            if not special:
                req.visible.append(tok)
            text = self._new_text(req, final=finish is not None)
            req.text += text  # a match not found before ends in the new text: search from where it could start
            cut = min((j for s in req.params.stop if (j := req.text.find(s, max(0, len(req.text) - len(text) - len(s) + 1))) >= 0),
                      default=-1)
            if cut >= 0:
                finish, stop_at = "stop_sequence", cut
        req.finished = finish is not None
        req.emit(Event(len(req.generated) - 1, Token(tok, text, logprob, special, top), finish,
                       req.text if finish else None, stop_at, prompt=req.prompt if finish or len(req.generated) == 1 else None))


    def _new_text(self, req: Request, final: bool) -> str:
        """The text `req.visible`'s last tokens add, decoded as TGI and vLLM do: a window from the token before the
        last emitted text (`prefix`) to the end, minus the prefix's own text, so a token costs the same however long
        the text is (decoding everything each token is quadratic in the length). Empty while the window ends inside
        a multi-byte character, unless `final`. A window with broken UTF-8 in it (a sampled byte soup) is settled by
        the whole text instead, so the streamed text is always exactly the whole decode."""
        prefix, read = req.window
        before = self._decode(req.visible[prefix:read]) if read > prefix else ""
        after = self._decode(req.visible[prefix:])
        if after.endswith("\ufffd") and not final:  # half a character: wait for the rest
            return ""
        if "\ufffd" in before or "\ufffd" in after:
            new = self._decode(req.visible)[len(req.lead) + len(req.text):]
        elif len(after) > len(before):
            new = after[len(before):]
        else:
            return ""
        req.window = (read, len(req.visible))
        return new


def _unscored(req: Request) -> int:
    """Prompt tokens not scored: the first (nothing comes before it) and any before `prompt_logprobs_from` (their
    logits are never computed: the lm_head runs only on the rows scored)."""
    return min(max(1, req.params.prompt_logprobs_from), len(req.input_ids))


def fast_decode(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode`, or straight the Rust tokenizer's decode where that is all it does (transformers' fast
    tokenizer without `clean_up_tokenization_spaces`): the wrapper costs ~15 us a call, and the engine decodes twice
    per generated token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    fast = [c for c in (_class("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
                        _class("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast")) if c is not None]
    plain = any(isinstance(tokenizer, c) and type(tokenizer)._decode is c._decode for c in fast)
    if backend is None or not plain or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return functools.partial(backend.decode, skip_special_tokens=False)


def _class(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _processed(req: Request) -> bool:
    """Whether any logits processor of `Engine._process` applies to this request's next token."""
    p = req.params
    return bool(p.watermark or p.repetition_penalty != 1.0 or p.tgi_frequency_penalty or
                ((p.presence_penalty or p.frequency_penalty) and req.generated) or p.logit_bias or req.matcher is not None)


TIES_SEEN = 32  # tokens past the largest n that the first transfer of _top_tokens holds (ties with an n-th)


def _top_tokens(rows: list[torch.Tensor], ns: list[int], ties: list[bool]) -> list[list[tuple[int, float]]]:
    """Each row's n likeliest (id, logprob), best first, equal logprobs by id; with `ties`, also every token tied with
    the n-th (TGI's batch_top_tokens). As TGI, tokens a processor ruled out (-inf: a grammar's, top_k's) are never
    listed. Every row at once, in one host transfer (a second only for rows with more than TIES_SEEN ties)."""
    x = torch.stack(rows)
    vocab = x.shape[-1]
    ns = [min(n, vocab) for n in ns]
    width = min(vocab, max(ns) + TIES_SEEN)
    top = x.topk(width)
    nth = top.values.gather(1, torch.tensor(ns, device=x.device)[:, None] - 1)  # a -inf n-th: every finite token
    nth = nth.masked_fill(nth == -math.inf, torch.finfo(x.dtype).min)
    tied = (x >= nth).sum(-1).clamp(min=1)  # the tokens at least as likely as the n-th
    host = torch.cat([tied[:, None].double(), top.values.double(), top.indices.double()], 1).tolist()
    counts = [int(h[0]) for h in host]
    pairs = [list(zip(h[1 + width:], h[1:1 + width])) for h in host]
    for r in (r for r, c in enumerate(counts) if c > width):  # a flat distribution: more ties than transferred
        vs, ids = x[r].sort(descending=True, stable=True)  # equal logprobs by id: the order wanted, on the device
        k = counts[r] if ties[r] else ns[r]  # without ties, the first n only (not the whole vocabulary to the host)
        pairs[r] = list(zip(ids[:k].tolist(), vs[:k].tolist()))
    out = []
    for r, (c, n) in enumerate(zip(counts, ns)):
        best = sorted(pairs[r][:c], key=lambda p: (-p[1], p[0]))[: c if ties[r] else n]
        out.append([(int(i), v) for i, v in best if v != -math.inf])
    return out


def _decoding(req: Request) -> bool:
    """Its only token without KV is the one it generated last (else it still reads its prompt, or recomputes)."""
    return bool(req.generated) and len(req.input_ids) + len(req.generated) - req.computed == 1


def _warp(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and typical-p (transformers' warpers, in TGI's order). The logits are shifted to a
    maximum of 0 first (every warper is shift-invariant; +inf from a tiny repetition penalty capped first), so a tiny
    temperature gives -inf, the greedy limit, never +inf and NaN probabilities."""
    x = x.clamp(max=torch.finfo(x.dtype).max)
    x = (x - x.max()) / max(p.temperature, torch.finfo(x.dtype).tiny)  # 1e-320 would be 0 in float32: 0 / 0
    if p.top_k and p.top_k < x.numel():
        x[x < torch.topk(x, p.top_k).values[-1]] = -math.inf
    if p.top_p < 1.0:
        sx, si = x.sort()  # transformers' TopPLogitsWarper (and TGI's): ascending, drop the tokens whose mass with
        drop = sx.softmax(-1).cumsum(-1) <= 1 - p.top_p  # all below them is <= 1 - top_p, so the smallest set whose
        drop[-1] = False  # mass reaches top_p is kept (one token at least)
        x[si[drop]] = -math.inf
    if p.typical_p < 1.0:  # transformers' TypicalLogitsWarper
        logp = torch.log_softmax(x, -1)
        entropy = -(logp * logp.exp()).nansum()
        shifted, order = (-logp - entropy).abs().sort()
        cum = x[order].softmax(-1).cumsum(-1)
        last = int((cum < p.typical_p).sum().clamp(max=x.numel() - 1))
        x[order[shifted > shifted[last]]] = -math.inf
    return x
