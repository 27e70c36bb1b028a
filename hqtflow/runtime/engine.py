"""A small continuous-batching engine over a transformers causal LM.

One background thread owns the model and one batched DynamicCache with LEFT padding. Between decode steps waiting
requests join: as many as fit in the batch and in `max_prefill_tokens` (padded prompt tokens) are prefilled
together in one forward (left-padded to a common length; the prefill batch padded with dummy rows to a multiple of
`prefill_bucket`), then their KV and the batch's KV are left-padded to the same length and concatenated along the
batch. Finished or cancelled requests leave (their rows are dropped). Each generated token is reported to the
request's `emit` callback (called on the engine thread).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from hqtflow.runtime.memory import trim


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
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and the top k
    grammar: object | None = None  # an xgrammar CompiledGrammar (see runtime/grammar.py)


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
    generated_text: str | None = None
    error: str | None = None
    prompt: list[tuple[float | None, list[tuple[int, float]]]] | None = None  # last event, if prompt_logprobs


@dataclass
class Request:
    input_ids: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    generated: list[int] = field(default_factory=list)
    text: str = ""
    cancelled: bool = False
    finished: bool = False
    generator: torch.Generator | None = None
    seed: int | None = None
    matcher: object | None = None  # xgrammar GrammarMatcher
    prompt: list | None = None
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """Continuous batching: one (batched) prefill of waiting requests per step, then one decode step for the batch."""

    def __init__(self, model, tokenizer, *, max_batch_size: int = 8, on_step: Callable[[str, int, float, tuple], None] | None = None,
                 batch_bucket: int = 1, pad_to_multiple: int = 1, prefill_bucket: int = 1, max_prefill_tokens: int = 4096,
                 trim_interval: float = 2.0):
        self.model, self.tok = model.eval(), tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.on_step = on_step  # (kind "prefill"|"decode", batch size, seconds, shape run)
        self.batch_bucket, self.pad_to_multiple = max(1, batch_bucket), max(1, pad_to_multiple)
        self.prefill_bucket, self.max_prefill_tokens = max(1, prefill_bucket), max_prefill_tokens
        self.trim_interval, self._last_trim = trim_interval, time.monotonic()  # see runtime/memory.py
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        self.special = set(tokenizer.all_special_ids)
        self.pending: deque[Request] = deque()
        self.active: list[Request] = []
        self.cache = None  # DynamicCache, rows = self.active
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real token
        self.last: torch.Tensor | None = None  # [B] token to feed next
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- public API (any thread) -------------------------------------------------------------------------
    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="hqtflow-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            self._thread.join(timeout=30)

    def submit(self, input_ids: list[int], params: SamplingParams, emit: Callable[[Event], None]) -> Request:
        req = Request(list(input_ids), params, emit, t_submit=time.monotonic())
        if params.grammar is not None:
            from hqtflow.runtime.grammar import matcher

            req.matcher = matcher(params.grammar)
        if params.do_sample:
            req.seed = params.seed if params.seed is not None else random.randrange(2**63)
            req.generator = torch.Generator(device=self.device).manual_seed(req.seed)
        with self._cv:
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

    # -- engine thread -------------------------------------------------------------------------------------
    def _trim(self, idle: bool) -> None:
        if self.trim_interval and (idle or time.monotonic() - self._last_trim > self.trim_interval):
            trim()
            self._last_trim = time.monotonic()

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._stop and not self.pending and not self.active:
                    self._trim(idle=True)
                while not self._stop and not self.pending and not self.active:
                    self._cv.wait()
                if self._stop:
                    return
                new = self._admit()
            try:
                with torch.inference_mode():
                    if new:
                        self._prefill(new)
                    self._drop_finished()
                    if self.active:
                        self._decode()
                        self._drop_finished()
            except Exception as e:  # noqa: BLE001 - report to every request, keep serving
                for r in self.active + [r for r in new if r not in self.active]:
                    r.emit(Event(len(r.generated), None, error=f"{type(e).__name__}: {e}"))
                self.active, self.cache, self.mask, self.last = [], None, None, None
            self._trim(idle=False)

    def _forward(self, kind, ids, mask, pos, cache, keep: int = 1):
        t = time.perf_counter()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                         logits_to_keep=keep)  # 1: only the last position's logits, no [batch, prompt, vocab] tensor
        if self.on_step:
            self.on_step(kind, ids.shape[0], time.perf_counter() - t, tuple(ids.shape))
        return (out.logits[:, -1].float() if keep == 1 else out.logits), out.past_key_values  # keep 0: every position

    def _padded_len(self, n: int) -> int:
        return n + (-n % self.pad_to_multiple)

    def _admit(self) -> list[Request]:
        """Waiting requests for this step's prefill (called under the lock): FIFO, while the batch has room and the
        padded prefill batch stays within max_prefill_tokens (a longer prompt still goes, alone)."""
        out: list[Request] = []
        while self.pending and len(self.active) + len(out) < self.max_batch_size:
            req = self.pending[0]
            if req.cancelled:
                self.pending.popleft()
                continue
            rows = len(out) + 1
            length = self._padded_len(max(len(r.input_ids) for r in out + [req]))
            if out and (rows + (-rows % self.prefill_bucket)) * length > self.max_prefill_tokens:
                break
            out.append(self.pending.popleft())
            out[-1].t_admit = time.monotonic()
        return out

    def _prefill(self, reqs: list[Request]) -> None:
        from transformers import DynamicCache

        length = self._padded_len(max(len(r.input_ids) for r in reqs))  # left padding to the bucketed length
        rows = [[self.tok.pad_token_id or 0] * (length - len(r.input_ids)) + r.input_ids for r in reqs]
        masks = [[0] * (length - len(r.input_ids)) + [1] * len(r.input_ids) for r in reqs]
        dummies = -len(reqs) % self.prefill_bucket  # dummy rows (copies of the first) up to the prefill bucket
        ids = torch.tensor(rows + rows[:1] * dummies, device=self.device)
        mask = torch.tensor(masks + masks[:1] * dummies, device=self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        scored = [r.params.prompt_logprobs is not None for r in reqs]
        logits, cache = self._forward("prefill", ids, mask, pos, DynamicCache(), keep=0 if any(scored) else 1)
        for row, req in enumerate(reqs):
            if scored[row]:
                req.prompt = self._prompt_logprobs(req, logits[row, length - len(req.input_ids):])
        logits = logits if logits.dim() == 2 else logits[:, -1].float()
        if dummies:
            keep = torch.arange(len(reqs), device=self.device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, keep), layer.values.index_select(0, keep)
        self._join(reqs, cache, mask[: len(reqs)])
        rows = [i for i, r in enumerate(reqs) if r.params.max_new_tokens > 0]
        for req in reqs:
            if req.params.max_new_tokens <= 0:  # prompt scoring only (OpenAI max_tokens=0 with echo)
                req.finished = True
                req.emit(Event(0, None, "length", "", prompt=req.prompt))
        live = [reqs[i] for i in rows]
        for req, tok in zip(live, self._sample(live, logits[rows])):
            self._emit(req, tok)

    def _prompt_logprobs(self, req: Request, logits: torch.Tensor) -> list:
        """[(logprob of prompt token i given the ones before, top-k [(id, logprob)])]; the first token has None."""
        k, ids = req.params.prompt_logprobs, torch.tensor(req.input_ids[1:], device=logits.device)
        out: list = [(None, [])]
        for start in range(0, len(ids), 512):  # bounded float32 [chunk, vocab] at a time
            lp = torch.log_softmax(logits[start: start + 512][: len(ids) - start].float(), dim=-1)
            chosen = lp.gather(1, ids[start: start + 512, None])[:, 0].tolist()
            top = lp.topk(k, dim=-1) if k else None
            for j, c in enumerate(chosen):
                out.append((c, list(zip(top.indices[j].tolist(), top.values[j].tolist())) if k else []))
        return out

    def _join(self, reqs: list[Request], cache, mask) -> None:
        if self.cache is None:
            self.cache, self.mask = cache, mask
        else:
            lb, ln = self.mask.shape[1], mask.shape[1]
            for lb_layer, ln_layer in zip(self.cache.layers, cache.layers):
                for name in ("keys", "values"):
                    a, b = getattr(lb_layer, name), getattr(ln_layer, name)
                    a, b = F.pad(a, (0, 0, max(0, ln - lb), 0)), F.pad(b, (0, 0, max(0, lb - ln), 0))
                    setattr(lb_layer, name, torch.cat([a, b]))
            self.mask = torch.cat([F.pad(self.mask, (max(0, ln - lb), 0)), F.pad(mask, (max(0, lb - ln), 0))])
        self.active.extend(reqs)
        zeros = torch.zeros(len(reqs), dtype=torch.long, device=self.device)
        self.last = torch.cat([self.last, zeros]) if self.last is not None else zeros

    def _decode(self) -> None:
        b = len(self.active)
        extra = -b % self.batch_bucket  # dummy rows up to the decode batch bucket (Gaudi-style static shapes)
        ids, mask = self.last[:, None], torch.cat([self.mask, self.mask.new_ones(b, 1)], dim=1)
        pos = mask.cumsum(-1)[:, -1:] - 1
        if extra:
            ids, pos = F.pad(ids, (0, 0, 0, extra)), F.pad(pos, (0, 0, 0, extra))
            mask = torch.cat([mask, F.pad(mask.new_zeros(extra, mask.shape[1] - 1), (0, 1), value=1)])
            self._resize(list(range(b)) + [0] * extra)
        logits, self.cache = self._forward("decode", ids, mask, pos, self.cache)
        if extra:
            self._resize(list(range(b)))
        self.mask = mask[:b]
        for req, tok in zip(self.active, self._sample(self.active, logits[:b])):
            self._emit(req, tok)

    def _resize(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, device=self.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)

    def _drop_finished(self) -> None:
        keep = [i for i, r in enumerate(self.active) if not (r.cancelled or r.finished)]
        if len(keep) == len(self.active):
            return
        if not keep:
            self.active, self.cache, self.mask, self.last = [], None, None, None
            return
        self._resize(keep)
        idx = torch.tensor(keep, device=self.device)
        self.active = [self.active[i] for i in keep]
        self.mask, self.last = self.mask.index_select(0, idx), self.last.index_select(0, idx)
        first = int(self.mask.any(0).nonzero()[0])  # columns padded in every row can go
        if first:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[tuple[int, float, list | None]]:
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for row, req in enumerate(reqs):
            x = self._process(req, logits[row].clone())
            p = req.params
            if not p.do_sample:
                tok = int(x.argmax())
            else:
                x = _warp(x, p)
                tok = int(torch.multinomial(x.softmax(-1), 1, generator=req.generator))
            if req.matcher is not None:
                req.matcher.accept_token(tok)
            top = None
            if p.top_n:
                t = logprobs[row].topk(p.top_n)
                top = list(zip(t.indices.tolist(), t.values.tolist()))
            out.append((tok, float(logprobs[row, tok]), top))
        return out

    def _process(self, req: Request, x: torch.Tensor) -> torch.Tensor:
        """Logits processors in TGI's order: watermark, penalties, logit bias, grammar."""
        p = req.params
        if p.watermark and req.input_ids + req.generated:
            rng = torch.Generator().manual_seed(15485863 * (req.input_ids + req.generated)[-1])
            x[torch.randperm(x.numel(), generator=rng)[: int(x.numel() * 0.5)].to(x.device)] += 2.0
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(req.input_ids + req.generated, device=x.device).unique()
            s = x[seen]
            x[seen] = torch.where(s < 0, s * p.repetition_penalty, s / p.repetition_penalty)
        if p.tgi_frequency_penalty:
            every = torch.tensor(req.input_ids + req.generated, device=x.device)
            x -= torch.bincount(every, minlength=x.numel())[: x.numel()].float() / every.numel() * p.tgi_frequency_penalty
        if (p.presence_penalty or p.frequency_penalty) and req.generated:
            counts = torch.bincount(torch.tensor(req.generated, device=x.device), minlength=x.numel())[: x.numel()].float()
            x -= counts * p.frequency_penalty + (counts > 0).float() * p.presence_penalty
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                x[tok] += bias
        if req.matcher is not None:
            from hqtflow.runtime.grammar import mask_logits

            mask_logits(req.matcher, x)
        return x

    def _emit(self, req: Request, chosen: tuple[int, float, list | None]) -> None:
        tok, logprob, top = chosen
        req.t_first = req.t_first or time.monotonic()
        i = self.active.index(req)
        self.last[i] = tok
        req.generated.append(tok)
        special = tok in self.special
        finish = None
        if tok in self.eos or (req.matcher is not None and req.matcher.is_terminated()):
            finish, text = "eos_token", self.tok.decode([tok])
        else:
            if len(req.generated) >= req.params.max_new_tokens:
                finish = "length"
            full = self.tok.decode([t for t in req.generated if t not in self.special])
            text = "" if full.endswith("\ufffd") and not finish else full[len(req.text):]  # wait for whole characters
            req.text += text
            cut = min((j for j in (req.text.find(s) for s in req.params.stop) if j >= 0), default=-1)
            if cut >= 0:
                req.text, finish = req.text[:cut], "stop_sequence"
        req.finished = finish is not None
        req.emit(Event(len(req.generated) - 1, Token(tok, text, logprob, special, top), finish,
                       req.text if finish else None, prompt=req.prompt if finish else None))


def _warp(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and typical-p (transformers' warpers, in TGI's order)."""
    x = x / p.temperature
    if p.top_k and p.top_k < x.numel():
        x[x < torch.topk(x, p.top_k).values[-1]] = -math.inf
    if p.top_p < 1.0:
        sx, si = x.sort(descending=True)
        drop = sx.softmax(-1).cumsum(-1) - sx.softmax(-1) > p.top_p  # keep the smallest set whose mass reaches top_p
        x[si[drop]] = -math.inf
    if p.typical_p < 1.0:  # transformers' TypicalLogitsWarper
        logp = torch.log_softmax(x, -1)
        entropy = -(logp * logp.exp()).nansum()
        shifted, order = (-logp - entropy).abs().sort()
        cum = x[order].softmax(-1).cumsum(-1)
        last = int((cum < p.typical_p).sum().clamp(max=x.numel() - 1))
        x[order[shifted > shifted[last]]] = -math.inf
    return x
