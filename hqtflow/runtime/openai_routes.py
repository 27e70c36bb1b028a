"""OpenAI's /v1/completions (string, token-id and batched prompts; echo; logprobs with prompt scoring, which
lm-eval's local-completions needs), /v1/chat/completions (logprobs/top_logprobs, response_format, tool calling with
runtime/tools.py), n/best_of, and stream_options.include_usage.

Here: a request's sampling parameters and jobs, the non-streaming answers, the grammars, /v1/models, and the router
that registers them. The prompts are built in openai_prompts.py, tokens and logprobs written as OpenAI's answers
say them in openai_text.py, the SSE streams in openai_stream.py."""

from __future__ import annotations

import time
from typing import Callable

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from hqtflow.runtime import tools
from hqtflow.runtime.api import JSON, Ctx
from hqtflow.runtime.engine import SamplingParams
from hqtflow.runtime.grammar import TOOLS_SCALE, GrammarError, compile_grammar, strict_problem
from hqtflow.runtime.openai_prompts import chat_prompt, echoed_prompts, prompts_of
from hqtflow.runtime.openai_stream import stream
from hqtflow.runtime.openai_text import (FINISH, before_stop, chat_logprobs, completion_logprobs, final_text, head,
                                         token_texts, usage)
from hqtflow.runtime.schemas import ApiError, ChatRequest, CompletionRequest, OpenAICommon, invalid, stop_list


def params(ctx: Ctx, data: OpenAICommon, n_input: int, max_new: int | None, *, top_n=0, prompt_logprobs=None,
           grammar=None, default_max_new=16, names=("prompt", "max_tokens")) -> SamplingParams:
    """A request's sampling parameters (OpenAI's defaults), its lengths checked against the server's (`names`: the
    request's fields that give them)."""
    temperature = 1.0 if data.temperature is None else data.temperature  # OpenAI's default; 0 means greedy
    bias = {int(k): v for k, v in (data.logit_bias or {}).items()}
    if any(k >= ctx.vocab for k in bias):
        raise invalid(f"`logit_bias` token ids must be < {ctx.vocab}")
    if max_new == 0:  # scoring the prompt only
        ctx.max_new(n_input, 1, 1, names)
    else:
        max_new = ctx.max_new(n_input, max_new, default_max_new, names)
    return SamplingParams(max_new_tokens=max_new, do_sample=temperature > 0, temperature=temperature or 1.0,
                          top_p=1.0 if data.top_p is None else data.top_p, presence_penalty=data.presence_penalty or 0.0,
                          frequency_penalty=data.frequency_penalty or 0.0, logit_bias=bias or None,
                          stop=stop_list(data.stop, ctx.s.max_stop_sequences), seed=data.seed, top_n=top_n, prompt_logprobs=prompt_logprobs,
                          grammar=grammar)


def within_max_client_batch_size(ctx: Ctx, req: CompletionRequest) -> CompletionRequest:
    """A batch of prompts of at most --max-client-batch-size (TGI's words), and as many sequences (prompts x
    best_of, or n): checked before any tokenizing."""
    p, most = req.prompt, ctx.s.max_client_batch_size
    count = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
    if count > most:
        raise ApiError(422, f"Number of prompts exceeds the maximum allowed batch size of {most}")
    if count * (per := req.best_of or req.n) > most:
        raise invalid(f"`prompt` x `best_of` (or `n`) must be <= {most} sequences (--max-client-batch-size). "
                      f"Given: {count} x {per}")
    return req


def best_of(group: list, n: int) -> list:
    """OpenAI's best_of: the n candidates with the highest log probability per token (the mean over the tokens whose
    logprobs the answer lists: those before a stop sequence; for an answer the stop sequence begins, which lists
    none, the stop's own tokens), best first (ties: in order)."""
    def per_token(q) -> float:
        tokens = before_stop(q.tokens, q.last.stop_at) or q.tokens
        return sum(t.logprob for t in tokens) / max(1, len(tokens))
    return sorted(group, key=per_token, reverse=True)[:n]


def jobs_for(req, prompts, make, count: int):
    """count sequences per prompt; with a seed, sequence j of a prompt samples with seed + j (modulo 2**64, the
    seed range, so every accepted seed works)."""
    out = []
    for ids in prompts:
        for j in range(count):
            p = make(len(ids))
            if req.seed is not None:
                p.seed = (req.seed + j) % 2**64
            out.append((ids, p))
    return out


# -- completions ----------------------------------------------------------------------------------------------------
async def complete(ctx: Ctx, token_text: Callable[[int], str], request: Request):
    """/v1/completions: a stream, or the answer once every sequence has finished."""
    start = time.monotonic()
    req = within_max_client_batch_size(ctx, await ctx.read(CompletionRequest, request))
    with ctx.admit() as slot:  # a 429 before any tokenizing (TGI's order); handed on, or given back on an error
        prompts = await run_in_threadpool(prompts_of, ctx, req)  # off the event loop: /health and streams go on
        k = req.logprobs
        make = lambda n: params(ctx, req, n, req.max_tokens, top_n=k or 0, prompt_logprobs=k if req.echo and k is not None else None)  # noqa: E731
        per = req.best_of or req.n
        jobs = jobs_for(req, prompts, make, per)
        texts = echoed_prompts(ctx.tok, req, prompts) if req.echo else [""] * len(prompts)
    if req.stream:
        return stream(ctx, token_text, jobs, prompts, req, chat=False, echo=texts if req.echo else None, slot=slot, arrival=start)
    seqs = await ctx.collect(jobs, request, slot)
    choices, returned = completion_choices(ctx.tok, token_text, req, prompts, texts, seqs)
    response = JSON({**head(ctx.s.served_name, False, False), "choices": choices, "usage": usage(prompts, seqs)})
    ctx.answered(start, returned)  # once the answer is rendered (a failure rendering it is not also a success)
    return response


def completion_choices(tok, token_text: Callable[[int], str], req: CompletionRequest, prompts: list[list[int]],
                       texts: list[str], seqs) -> tuple[list[dict], list]:
    """The choices of a non-streaming answer (`seqs`: best_of or n per prompt, `texts`: the prompts echoed or ""),
    and the sequences they return."""
    k, per = req.logprobs, req.best_of or req.n
    choices, returned = [], []
    for pi, ids in enumerate(prompts):
        group = seqs[pi * per:(pi + 1) * per]
        if per > req.n:  # best_of: the n with the highest logprob per token
            group = best_of(group, req.n)
        returned += group
        for j, q in enumerate(group):
            lp = None
            if k is not None:
                lp = completion_logprobs(tok, token_text, ids, q.last.prompt if req.echo else None,
                                         before_stop(q.tokens, q.last.stop_at), len(texts[pi]))
            choices.append({"index": pi * req.n + j, "text": texts[pi] + final_text(q.last), "logprobs": lp,
                            "finish_reason": FINISH[q.last.finish_reason]})
    return choices, returned


# -- chat -----------------------------------------------------------------------------------------------------------
def tools_grammar(tok, width: int, plan: tools.ToolPlan):
    """The grammar of a call of one of the plan's tools, on one line; a schema that does not compile is named."""
    try:
        return compile_grammar(tok, "json", plan.schema, scale=TOOLS_SCALE, vocab_size=width)
    except GrammarError as e:
        for tool, i in zip(plan.offered, plan.given):
            try:
                compile_grammar(tok, "json", tools.one_call_schema(tool), vocab_size=width)
            except GrammarError as alone:
                raise invalid(f"`tools[{i}].function.parameters`: {alone}") from None
        raise invalid(f"`tools`: {e}") from None


def chat_grammar(tok, width: int, req: ChatRequest, plan: tools.ToolPlan | None):
    """The grammar a chat reply is held to: a tool call's, the response_format's, or None (`width`: the model's
    logits, which may be wider than the tokenizer)."""
    if plan is not None:
        return tools_grammar(tok, width, plan)
    fmt = req.response_format
    try:
        if fmt is None or fmt.type == "text":
            return None
        if fmt.value is not None:  # TGI's grammar types: json (alias json_object) or regex, in `value`
            return compile_grammar(tok, "regex" if fmt.type == "regex" else "json", fmt.value, vocab_size=width)
        if fmt.type == "json_object":
            return compile_grammar(tok, "json_object", vocab_size=width)
        if fmt.json_schema.strict and (problem := strict_problem(fmt.json_schema.schema_)):
            raise GrammarError(problem)
        return compile_grammar(tok, "json", fmt.json_schema.schema_, vocab_size=width)
    except GrammarError as e:
        raise invalid(f"`response_format`: {e}") from None


def chat_choices(tok, token_text: Callable[[int], str], req: ChatRequest, plan: tools.ToolPlan | None,
                 seqs) -> list[dict]:
    """The choices of a non-streaming chat answer, one per finished sequence."""
    choices = []
    for j, q in enumerate(seqs):
        message, finish = chat_message(q, plan)
        lp = chat_logprobs(tok, token_text, before_stop(q.tokens, q.last.stop_at)) if req.logprobs else None
        choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": finish})
    return choices


def chat_message(q, plan) -> tuple[dict, str]:
    """A finished choice's message and finish_reason: its text, or (with tools) its tool call."""
    text, finish = final_text(q.last), FINISH[q.last.finish_reason]
    if plan is None:
        return {"role": "assistant", "content": text}, finish
    reply = tools.read_reply(text, final=True, names=plan.names)
    if reply.name is None:
        return {"role": "assistant", "content": reply.text}, finish
    call = tools.tool_call(tools.new_call_id(), reply.name, reply.text)
    return {"role": "assistant", "content": None, "tool_calls": [call]}, tools.finish_reason(reply, finish)


async def chat_complete(ctx: Ctx, token_text: Callable[[int], str], request: Request):
    """/v1/chat/completions: a stream, or the answer once every sequence has finished."""
    start = time.monotonic()
    req = await ctx.read(ChatRequest, request)
    with ctx.admit() as slot:  # a 429 before templating, tokenizing or compiling (TGI's order); handed on
        return await chat_answer(ctx, token_text, req, request, slot, start)


async def chat_answer(ctx: Ctx, token_text: Callable[[int], str], req: ChatRequest, request: Request, slot,
                      start: float):
    """A chat request admitted (`slot`): its prompt, grammar and jobs, then its stream or its answer."""
    plan = tools.plan(req.tools, req.tool_choice, req.tool_prompt)
    if plan is not None and req.response_format is not None and req.response_format.type != "text":
        raise invalid("`response_format` cannot be combined with `tools`: a tool call's grammar holds the reply")
    if plan is not None and req.stop:  # a stop sequence would cut a call short of its grammar's end
        raise invalid("`stop` cannot be combined with `tools`: a tool reply ends where its grammar ends it")
    # templated and tokenized, then compiled, off the event loop (/health and streams go on)
    ids = await run_in_threadpool(chat_prompt, ctx, req, plan)
    fmt = req.response_format
    grammar = None if plan is None and (fmt is None or fmt.type == "text") else \
        await ctx.compile(request, chat_grammar, ctx.tok, ctx.width, req, plan)  # (a request without one never waits for the compiles)
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    names = ("messages", "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    if req.max_completion_tokens is not None and req.max_tokens is not None:  # both given: each must fit
        ctx.max_new(len(ids), req.max_tokens, 100, names=("messages", "max_tokens"))
    make = lambda n: params(ctx, req, n, max_new, top_n=top_n, grammar=grammar, default_max_new=100, names=names)  # noqa: E731
    jobs = jobs_for(req, [ids], make, req.n)
    if req.stream:
        return stream(ctx, token_text, jobs, [ids], req, chat=True, plan=plan, slot=slot, arrival=start)
    seqs = await ctx.collect(jobs, request, slot)
    choices = chat_choices(ctx.tok, token_text, req, plan, seqs)
    response = JSON({**head(ctx.s.served_name, True, False), "choices": choices, "usage": usage([ids], seqs)})
    ctx.answered(start, seqs)  # once the answer is rendered (a failure rendering it is not also a success)
    return response


# -- models ---------------------------------------------------------------------------------------------------------
def model_card(served_name: str) -> dict:
    return {"id": served_name, "object": "model", "created": 0, "owned_by": "hqtflow"}


def named_model(served_name: str, model: str) -> dict:
    """/v1/models/{model}: the card of the model this server serves."""
    if not model:  # `/v1/models/`: no such route (as every path with a trailing slash)
        raise HTTPException(404, "Not Found")
    if model != served_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served_name}'", "model_not_found")
    return model_card(served_name)


def openai_router(ctx: Ctx) -> APIRouter:
    """The OpenAI routes of `ctx`'s server."""
    r = APIRouter()
    token_text = token_texts(ctx.tok)

    @r.post("/v1/completions")
    async def completions(request: Request):
        return await complete(ctx, token_text, request)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat_complete(ctx, token_text, request)

    @r.api_route("/v1/models", methods=["GET", "HEAD"])  # HEAD: as every GET route (TGI's axum does)
    async def list_models():
        return {"object": "list", "data": [model_card(ctx.s.served_name)]}

    @r.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def get_model(model: str):
        return named_model(ctx.s.served_name, model)

    return r
