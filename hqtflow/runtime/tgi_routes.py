"""TGI's routes: POST / (what text_generation.Client and huggingface_hub.InferenceClient call), /generate,
/generate_stream, /tokenize, /info, /health."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from hqtflow.runtime.api import JSON, Ctx, Sequence, event_stream, json_text
from hqtflow.runtime.engine import SamplingParams
from hqtflow.runtime.grammar import GrammarError, compile_grammar, strict_problem
from hqtflow.runtime.schemas import (ApiError, JsonSchema, TgiParameters, TgiRequest,
                                     TokenizeRequest, invalid, parse_part, stop_list)


def sse(data) -> str:
    return f"data:{json_text(data)}\n\n"


def tgi_grammar(ctx: Ctx, p: TgiParameters):
    """The request's grammar, compiled (None without one); slow for a large one, so the routes run it on the
    grammar's threads (Ctx.compile)."""
    if p.grammar is None:
        return None
    kind, value = p.grammar.type, p.grammar.value
    if kind == "json_schema":  # value: {"name", "schema", ...} as OpenAI's json_schema (other keys: a 422 naming them)
        spec = parse_part(JsonSchema, value, "parameters.grammar.value") if isinstance(value, dict) else None
        kind, value = "json", spec and spec.schema_
        if spec and spec.strict and value and (problem := strict_problem(value)):
            raise invalid(f"`grammar`: {problem}")
    if not value:
        raise invalid(f"`value` cannot be empty for `{p.grammar.type}` grammar")
    try:
        return compile_grammar(ctx.tok, kind, value, vocab_size=ctx.width)
    except GrammarError as e:
        raise invalid(f"`grammar`: {e}") from None


def sampling(ctx: Ctx, p: TgiParameters, n_input: int, default_max_new: int = 100) -> SamplingParams:
    """The engine's parameters for a TGI request (its grammar, compiled apart: `tgi_grammar`)."""
    return SamplingParams(
        max_new_tokens=ctx.max_new(n_input, p.max_new_tokens, default_max_new), do_sample=p.sampling,
        temperature=p.temperature or 1.0, top_k=p.top_k or 0, top_p=p.top_p or 1.0, typical_p=p.typical_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0, tgi_frequency_penalty=p.frequency_penalty or 0.0,
        stop=stop_list(p.stop, ctx.s.max_stop_sequences), seed=p.seed, watermark=p.watermark, top_n=p.top_n_tokens or 0,
        top_n_ties=True,  # TGI's top-n: with every token tied with the n-th
        processed_logprobs=True,  # TGI's logprobs: of the distribution each token is sampled from
        prompt_logprobs=0 if p.decoder_input_details else None)


def tgi_router(ctx: Ctx) -> APIRouter:
    r, tok, s = APIRouter(), ctx.tok, ctx.s

    def token_json(t):
        return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}

    def top_json(t):
        return [{"id": i, "text": tok.decode([i]), "logprob": lp, "special": i in ctx.engine.special} for i, lp in t.top]

    def truncated(items: list, truncate: int | None) -> list:
        """TGI's `truncate`: the last N prompt tokens."""
        if truncate is None:
            return items
        if not 0 < truncate <= s.max_input_tokens:
            raise invalid(f"`truncate` must be strictly positive and less than {s.max_input_tokens}. Given: {truncate}")
        return items[-truncate:]

    async def prepare(req: TgiRequest, request: Request, stream: bool):
        """The request's ids, parameters and engine parameters, and its place among the in-flight requests: taken
        first (TGI's 429 before any tokenizing or compiling), handed to the caller, given back on an error."""
        p = req.parameters  # (best_of and top_n_tokens within this server's limits: checked by parse)
        if stream and (p.best_of or 1) > 1:
            raise invalid("`best_of` != 1 is not supported when streaming tokens")
        if stream and p.decoder_input_details:
            raise invalid("`decoder_input_details` == true is not supported when streaming tokens")
        with ctx.admit() as slot:  # tokenized and compiled off the event loop: other requests and /health go on
            ids = truncated(await run_in_threadpool(ctx.encode, req.inputs), p.truncate)
            params = sampling(ctx, p, len(ids))  # the checks first, then the grammar
            if p.grammar is not None:  # (the grammar's threads are for compiles: no request waits there for nothing)
                params.grammar = await ctx.compile(request, tgi_grammar, ctx, p)
        return ids, p, params, slot

    def details(seq: Sequence, ids: list[int], p: TgiParameters) -> dict:
        prefill = []
        if p.decoder_input_details:
            prefill = [{"id": i, "text": tok.decode([i]), "logprob": lp} for i, (lp, _) in zip(ids, seq.last.prompt)]
        out = {"finish_reason": seq.last.finish_reason, "generated_tokens": len(seq.tokens), "seed": seq.handle.seed,
               "prefill": prefill, "tokens": [token_json(t) for t in seq.tokens]}
        if p.top_n_tokens:
            out["top_tokens"] = [top_json(t) for t in seq.tokens]
        return out

    async def generate_json(req: TgiRequest, request: Request, listed: bool = False) -> JSON:
        """TGI's answer (`listed`: in a list of one, as POST / answers), with TGI's timing headers (x-total-time,
        x-queue-time, ...)."""
        start = time.monotonic()
        ids, p, params, slot = await prepare(req, request, stream=False)
        seqs = await ctx.collect([(ids, params)] * (p.best_of or 1), request, slot=slot)
        best = max(seqs, key=lambda q: q.logprob / max(1, len(q.tokens)))  # TGI's: the highest logprob per token
        headers = timing_headers(start, best, req.inputs, len(ids))
        head = req.inputs if p.return_full_text else ""
        out = {"generated_text": head + best.last.generated_text}
        if p.details:  # as TGI: the other sequences are in details.best_of_sequences, when details are asked for
            out["details"] = details(best, ids, p)
            if len(seqs) > 1:
                out["details"]["best_of_sequences"] = [{"generated_text": head + q.last.generated_text, **details(q, ids, p)}
                                                       for q in seqs if q is not best]
        response = JSON([out] if listed else out, headers=headers)
        ctx.answered(start, [best])  # once the answer is rendered (a failure rendering it is not also a success)
        return response

    def timing_headers(start: float, seq: Sequence, inputs: str, n_input: int) -> dict[str, str]:
        """TGI's headers of a /generate answer: its times in ms (x-compute-time in s), from the request's arrival,
        its submission to the engine (validation done), and now; queue time is every wait in the queue (after a
        preemption too), inference time the rest."""
        h, now = seq.handle, time.monotonic()
        queued = h.queue_time(now)
        inference = now - h.t_submit - queued
        n = max(len(seq.tokens), 1)
        ms = lambda seconds: str(int(max(seconds, 0.0) * 1000))  # noqa: E731
        return {"x-compute-type": ctx.engine.device.type, "x-compute-time": f"{now - start:.6f}",
                "x-compute-characters": str(len(inputs)), "x-total-time": ms(now - start),
                "x-validation-time": ms(h.t_submit - start), "x-queue-time": ms(queued),
                "x-inference-time": ms(inference), "x-time-per-token": ms(inference / n),
                "x-prompt-tokens": str(n_input), "x-generated-tokens": str(len(seq.tokens))}

    async def generate_stream_response(req: TgiRequest, request: Request) -> StreamingResponse:
        start = time.monotonic()
        ids, p, params, slot = await prepare(req, request, stream=True)  # a 429 comes before the 200 of the stream

        async def events():
            try:
                async for _, ev, handle in ctx.stream([(ids, params)], slot=slot, start=start):
                    out = {"index": ev.index, "token": token_json(ev.token),
                           "top_tokens": top_json(ev.token) if p.top_n_tokens else None, "generated_text": None, "details": None}
                    if ev.finish_reason:
                        out["generated_text"] = (req.inputs if p.return_full_text else "") + ev.generated_text
                        if p.details:  # as TGI: the last event's details only when asked for
                            out["details"] = {"finish_reason": ev.finish_reason, "generated_tokens": ev.index + 1,
                                              "seed": handle.seed, "input_length": len(ids)}
                    yield sse(out)
            except ApiError as e:
                ctx.metrics.failed(e.error_type)
                yield sse({"error": e.message, "error_type": e.error_type})

        return event_stream(slot.tie_to(events()), {"x-compute-type": ctx.engine.device.type,
                                                     "x-compute-characters": str(len(req.inputs))})

    @r.post("/")
    async def compat(request: Request):
        """TGI's route for its clients: {"inputs", "parameters", "stream"}; a list of one result, or SSE."""
        req = await ctx.read(TgiRequest, request)
        if req.stream:
            return await generate_stream_response(req, request)
        return await generate_json(req, request, listed=True)

    def no_stream_field(req: TgiRequest, route: str) -> TgiRequest:
        if "stream" in req.model_fields_set:  # only POST / switches on it; here it would be ignored
            raise invalid(f"`stream` is not a parameter of {route} (use POST / or /generate_stream)")
        return req

    @r.post("/generate")
    async def generate(request: Request):
        return await generate_json(no_stream_field(await ctx.read(TgiRequest, request), "/generate"), request)

    @r.post("/generate_stream")
    async def generate_stream(request: Request):
        return await generate_stream_response(no_stream_field(await ctx.read(TgiRequest, request), "/generate_stream"), request)

    @r.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' health checks
    async def health():
        """200 once warmed up (with --warmup) while the engine's thread runs; else TGI's 503."""
        if not ctx.state["ready"] or not ctx.engine.running:
            return JSON({"error": "unhealthy", "error_type": "healthcheck"}, 503)
        return Response(status_code=200)

    @r.api_route("/info", methods=["GET", "HEAD"])
    async def info():
        from hqtflow import __version__

        return {"model_id": s.served_name, "model_sha": None, "model_dtype": str(ctx.engine.compute_dtype),
                "model_device_type": ctx.engine.device.type, "quantize": s.quantize,
                "max_concurrent_requests": s.max_concurrent_requests, "max_best_of": s.max_best_of, "max_stop_sequences": s.max_stop_sequences,
                "max_input_tokens": s.max_input_tokens, "max_total_tokens": s.max_total_tokens, "validation_workers": 1,
                "max_client_batch_size": s.max_client_batch_size, "max_top_n_tokens": s.max_top_n_tokens, "router": "hqtflow", "version": __version__}

    @r.post("/tokenize")
    async def tokenize(request: Request):
        req = await ctx.read(TokenizeRequest, request)
        inputs, truncate = req.inputs, req.parameters.truncate if req.parameters else None
        stop_list(req.parameters.stop if req.parameters else None, s.max_stop_sequences)  # checked as for generation
        if not inputs:
            raise invalid("`inputs` cannot be empty")

        def pieces() -> bytes:  # in a thread, as JSON at once: a megabyte of text is ~500k tokens
            enc = tok(inputs, return_offsets_mapping=True)
            out = [{"id": i, "text": inputs[a:b], "start": a, "stop": b} for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]
            return json.dumps(truncated(out, truncate)).encode()  # as the generation routes: the last `truncate` tokens

        return Response(await run_in_threadpool(pieces), media_type="application/json")

    return r
