"""OpenAI's /v1/completions (string, token-id and batched prompts; echo; logprobs with prompt scoring, which
lm-eval's local-completions needs), /v1/chat/completions (logprobs/top_logprobs, response_format, tool calling with
runtime/tools.py), n/best_of, and stream_options.include_usage."""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from hqtflow.runtime import tools
from hqtflow.runtime.api import Ctx, Sequence, event_stream
from hqtflow.runtime.engine import SamplingParams
from hqtflow.runtime.grammar import TOOLS_SCALE, GrammarError, compile_grammar
from hqtflow.runtime.schemas import (ROLES, ApiError, ChatRequest, CompletionRequest, OpenAICommon, invalid, openai_error,
                                     stop_list)

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def chunk(data) -> str:
    return "data: " + json.dumps(data) + "\n\n"


def final_text(ev) -> str:
    """A finished sequence's text as OpenAI returns it: up to (without) the stop sequence that ended it."""
    return ev.generated_text if ev.stop_at is None else ev.generated_text[:ev.stop_at]


def before_stop(tokens: list, stop_at: int | None) -> list:
    """The tokens that start before the stop sequence that ended the text (`stop_at`: its offset in the text; None:
    all): OpenAI leaves the stop sequence out of the text, and so out of the logprobs (a token that holds both text
    and the stop's start is kept)."""
    if stop_at is None:
        return tokens
    kept, at = [], 0
    for t in tokens:
        if at >= stop_at:
            break
        kept.append(t)
        at += len(t.text)
    return kept


def token_texts(tok) -> Callable[[int], str]:
    """A token's own text, as it reads inside a text: decoded after a plain letter, which is then cut off, so a
    SentencePiece token keeps the space its decoder strips from the start of a text ("▁to" is " to", as in the
    answer: a choice's tokens join to its text); a byte-level token's text is its decode alone either way."""
    anchor = tok.encode("a", add_special_tokens=False)[-1:]
    lead = tok.decode(anchor)

    @functools.lru_cache(maxsize=1 << 16)
    def text(tid: int) -> str:
        both = tok.decode(anchor + [tid])
        return both[len(lead):] if anchor and both.startswith(lead) else tok.decode([tid])

    return text


def token_bytes(tok, tid: int, text: str) -> bytes:
    """A token's own UTF-8 bytes (OpenAI's `bytes`): its text, or, for a token that holds part of a character (its
    text decodes to U+FFFD), the bytes behind its byte-level BPE symbols or its `<0xNN>` byte-fallback piece."""
    if "\ufffd" not in text:
        return text.encode()
    piece = tok.convert_ids_to_tokens(tid)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    symbols = _byte_symbols()
    return bytes(symbols[c] for c in piece) if all(c in symbols for c in piece) else text.encode()


@functools.cache
def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, symbol -> byte: printable bytes stand for themselves, the other 68 bytes
    for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


MESSAGE_REFUSED = {"name": "participant names are not passed to the chat template",
                   "function_call": "the deprecated function calling is not implemented: use `tools`",
                   "refusal": "refusals are not modelled", "audio": "audio is not supported"}
MESSAGE_FIELDS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}  # beside role and content


def chat_messages(messages: list[dict], renders_calls: bool, renders_developer: bool = True) -> list[dict]:
    """The messages for the chat template: roles checked (OpenAI's `developer` given as `system` to a template that
    does not name it, as llama.cpp does: templates drop or refuse a role they do not know), content as a string
    (OpenAI's text parts joined), an assistant's tool calls and a tool result's call id passed on to a template that
    renders `tool_calls` (else the calls are written into the content as the model writes them); any other message
    field is a 422 naming it (given as null, it is not given)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"`messages[{i}]` must be an object with `role` and `content`")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"`messages[{i}].role` must be one of {', '.join(ROLES)}. Given: {role!r}")
        for key, value in m.items():
            if key not in ("role", "content", *MESSAGE_FIELDS.get(role, ())) and value is not None:
                why = MESSAGE_REFUSED.get(key, "it is not a field of a chat message")
                if key in ("tool_calls", "tool_call_id"):
                    why = f"only {'an assistant' if key == 'tool_calls' else 'a tool'} message has it"
                raise invalid(f"`messages[{i}].{key}` is not supported: {why}")
        content = message_text(m.get("content"), i, optional=role == "assistant")
        calls = message_calls(m.get("tool_calls"), i) if role == "assistant" else []
        role = "system" if role == "developer" and not renders_developer else role
        if role == "tool" and m.get("tool_call_id") is not None and not isinstance(m["tool_call_id"], str):
            raise invalid(f"`messages[{i}].tool_call_id` must be a string")
        if not renders_calls:
            content = "\n".join([content] * bool(content) + [tools.call_text(c["function"]["name"], c["function"]["arguments"])
                                                             for c in calls])
            out.append({"role": role, "content": content})
            continue
        extra = {"tool_calls": calls} if calls else {"tool_call_id": m["tool_call_id"]} if m.get("tool_call_id") is not None else {}
        out.append({"role": role, "content": content, **extra})
    return out


def message_text(content, i: int, optional: bool) -> str:
    """A message's content as one string: OpenAI's text parts joined with newlines; null (an assistant's) is empty."""
    if isinstance(content, str):
        return content
    if content is None and optional:
        return ""
    if not isinstance(content, list) or not content:  # OpenAI's spec: at least one part
        raise invalid(f"`messages[{i}].content` must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"`messages[{i}].content[{j}]`: only text parts are supported. Given: {kind!r}")
        extra = next((k for k, v in part.items() if k not in ("type", "text") and v is not None), None)
        if extra is not None:
            raise invalid(f"`messages[{i}].content[{j}].{extra}` is not supported: a text part has type and text")
        parts.append(part["text"])
    return "\n".join(parts)


def message_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool calls as chat templates take them: {"id"?, "type": "function", "function":
    {"name", "arguments": the parsed arguments}} (OpenAI sends the arguments as a JSON string)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"`messages[{i}].tool_calls` must be a list of tool calls")
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": a JSON string}}'
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        c = {k: v for k, v in c.items() if v is not None} if isinstance(c, dict) else c  # null: not given
        f = c.get("function") if isinstance(c, dict) else None
        f = {k: v for k, v in f.items() if v is not None} if isinstance(f, dict) else f
        if not isinstance(f, dict) or c.get("type", "function") != "function" or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments"), str) or not isinstance(c.get("id", ""), str):
            raise invalid(f"`{where}` must be {shape}")
        if extra := next((k for k in c if k not in ("id", "type", "function")), None):
            raise invalid(f"`{where}.{extra}` is not supported: a tool call has id, type and function")
        if extra := next((k for k in f if k not in ("name", "arguments")), None):
            raise invalid(f"`{where}.function.{extra}` is not supported: a tool call's function has name and arguments")
        try:
            arguments = json.loads(f["arguments"])
        except RecursionError:
            raise invalid(f"`{where}.function.arguments` nests too deeply") from None
        except ValueError:
            raise invalid(f"`{where}.function.arguments` is not valid JSON") from None
        out.append({**({"id": c["id"]} if "id" in c else {}), "type": "function",
                    "function": {"name": f["name"], "arguments": arguments}})
    return out


class HeldBack:
    """How many characters at the end of a stream's text may be the start of a stop sequence (they are not streamed
    until they are not): per stop, the longest end of the text that begins it, a Knuth-Morris-Pratt matcher's state
    fed only each token's new text (amortized constant work per character, whatever the stops' lengths)."""

    def __init__(self, stops):
        self.stops = list(stops)
        self.fallback = [_prefix_function(s) for s in self.stops]
        self.state = [0] * len(self.stops)

    def feed(self, text: str) -> int:
        for k, (stop, fallback) in enumerate(zip(self.stops, self.fallback)):
            q = self.state[k]
            for ch in text:
                if q == len(stop):  # a whole stop matched (the engine ends the stream there): go on as KMP does
                    q = fallback[q - 1]
                while q and stop[q] != ch:
                    q = fallback[q - 1]
                q += stop[q] == ch
            self.state[k] = q
        return max(self.state, default=0)


def _prefix_function(s: str) -> list[int]:
    """KMP: for each prefix of `s`, the length of its longest proper prefix that is also its suffix."""
    out = [0] * len(s)
    for i in range(1, len(s)):
        q = out[i - 1]
        while q and s[i] != s[q]:
            q = out[q - 1]
        out[i] = q + (s[i] == s[q])
    return out


def openai_router(ctx: Ctx) -> APIRouter:
    r, tok, s = APIRouter(), ctx.tok, ctx.s
    token_text = token_texts(tok)

    def params(data: OpenAICommon, n_input: int, max_new: int | None, *, top_n=0, prompt_logprobs=None, grammar=None,
               default_max_new=16, names=("prompt", "max_tokens")) -> SamplingParams:
        temperature = 1.0 if data.temperature is None else data.temperature  # OpenAI's default; 0 means greedy
        bias = {int(k): v for k, v in (data.logit_bias or {}).items()}
        if any(k >= ctx.vocab for k in bias):
            raise invalid(f"`logit_bias` token ids must be < {ctx.vocab}")
        if max_new == 0:  # scoring the prompt only
            ctx.max_new(n_input, 1, 1, names)
        else:
            max_new = ctx.max_new(n_input, max_new, default_max_new, names)
        return SamplingParams(max_new_tokens=max_new, do_sample=temperature > 0, temperature=temperature or 1.0,
                              top_p=data.top_p or 1.0, presence_penalty=data.presence_penalty or 0.0,
                              frequency_penalty=data.frequency_penalty or 0.0, logit_bias=bias or None,
                              stop=stop_list(data.stop, s.max_stop_sequences), seed=data.seed, top_n=top_n, prompt_logprobs=prompt_logprobs,
                              grammar=grammar)

    def within_max_client_batch_size(req: CompletionRequest) -> CompletionRequest:
        """A batch of prompts of at most --max-client-batch-size (TGI's words), and as many sequences (prompts x
        best_of, or n): checked before any tokenizing."""
        p, most = req.prompt, s.max_client_batch_size
        count = len(p) if isinstance(p, list) and p and not isinstance(p[0], int) else 1
        if count > most:
            raise ApiError(422, f"Number of prompts exceeds the maximum allowed batch size of {most}")
        if count * (per := req.best_of or req.n) > most:
            raise invalid(f"`prompt` x `best_of` (or `n`) must be <= {most} sequences (--max-client-batch-size). "
                          f"Given: {count} x {per}")
        return req

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

    def head(chat: bool, stream: bool):
        obj = "chat.completion" + (".chunk" if stream else "") if chat else "text_completion"
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": s.served_name, "system_fingerprint": "hqtflow"}

    def usage(prompts, seqs) -> dict:
        p, c = sum(len(x) for x in prompts), sum(len(q.tokens) for q in seqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # -- completions ----------------------------------------------------------------------------------------
    def prompts_of(req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [ctx.encode(p, "prompt")]
        if not p:
            raise invalid("`prompt` cannot be empty")
        if all(isinstance(x, int) for x in p):
            return [ctx.check_ids(p)]
        if all(isinstance(x, str) for x in p):
            return [ctx.encode(x, "prompt") for x in p]
        return [ctx.check_ids(x) for x in p]

    def echoed_prompts(req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """What `echo` gives back: a text prompt as the client sent it (not its tokens decoded, which would add a
        BOS such as `<s>` or drop a SentencePiece tokenizer's leading space), a token prompt decoded."""
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, str) for x in p):
            return list(p)
        return [tok.decode(ids) for ids in prompts]

    def completion_logprobs(tokens: list[tuple[int, float | None, list]], offset0: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = offset0
        for i, (tid, lp, top) in enumerate(tokens):
            text = token_text(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            if lp is None:
                out["top_logprobs"].append(None)
            else:
                d = {token_text(t): v for t, v in top}
                d.setdefault(text, lp)  # the chosen token is always listed (as vLLM does)
                out["top_logprobs"].append(d)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def scored(ids, prompt, seq_tokens):
        """(id, logprob, top) for the prompt (when scored) then the generated tokens."""
        out = [(i, lp, top) for i, (lp, top) in zip(ids, prompt)] if prompt else []
        return out + [(t.id, t.logprob, t.top or []) for t in seq_tokens]

    @r.post("/v1/completions")
    async def completions(request: Request):
        start = time.monotonic()
        req = within_max_client_batch_size(await ctx.read(CompletionRequest, request))
        with ctx.admit() as slot:  # a 429 before any tokenizing (TGI's order); handed on, or given back on an error
            prompts = await run_in_threadpool(prompts_of, req)  # off the event loop: /health and streams go on
            k = req.logprobs
            make = lambda n: params(req, n, req.max_tokens, top_n=k or 0, prompt_logprobs=k if req.echo and k is not None else None)  # noqa: E731
            per = req.best_of or req.n
            jobs = jobs_for(req, prompts, make, per)
            texts = echoed_prompts(req, prompts) if req.echo else [""] * len(prompts)
        if req.stream:
            return stream(jobs, prompts, req, chat=False, echo=texts if req.echo else None, slot=slot, arrival=start)
        seqs = await ctx.collect(jobs, request, slot)
        choices, returned = [], []
        for pi, ids in enumerate(prompts):
            group = seqs[pi * per:(pi + 1) * per]
            if per > req.n:  # best_of: the n with the highest total logprob
                group = sorted(group, key=lambda q: -q.logprob)[: req.n]
            returned += group
            for j, q in enumerate(group):
                lp = None
                if k is not None:
                    lp = completion_logprobs(scored(ids, q.last.prompt if req.echo else None,
                                                    before_stop(q.tokens, q.last.stop_at)), 0)
                choices.append({"index": pi * req.n + j, "text": texts[pi] + final_text(q.last), "logprobs": lp,
                                "finish_reason": FINISH[q.last.finish_reason]})
        ctx.answered(start, returned)
        return {**head(False, False), "choices": choices, "usage": usage(prompts, seqs)}

    # -- chat -----------------------------------------------------------------------------------------------
    def chat_logprobs(tokens) -> dict:
        def entry(tid, lp):
            text = token_text(tid)
            return {"token": text, "logprob": lp, "bytes": list(token_bytes(tok, tid, text))}
        return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in (t.top or [])]}
                            for t in tokens if not t.special]}  # the content's tokens: not the end-of-turn token

    def tools_grammar(plan: tools.ToolPlan):
        """The grammar of a call of one of the plan's tools, on one line; a schema that does not compile is named."""
        try:
            return compile_grammar(tok, "json", plan.schema, scale=TOOLS_SCALE)
        except GrammarError as e:
            for tool, i in zip(plan.offered, plan.given):
                try:
                    compile_grammar(tok, "json", tools.one_call_schema(tool))
                except GrammarError as alone:
                    raise invalid(f"`tools[{i}].function.parameters`: {alone}") from None
            raise invalid(f"`tools`: {e}") from None

    def chat_grammar(req: ChatRequest, plan: tools.ToolPlan | None):
        if plan is not None:
            return tools_grammar(plan)
        fmt = req.response_format
        try:
            if fmt is None or fmt.type == "text":
                return None
            if fmt.value is not None:  # TGI's grammar types: json (alias json_object) or regex, in `value`
                return compile_grammar(tok, "regex" if fmt.type == "regex" else "json", fmt.value)
            if fmt.type == "json_object":
                return compile_grammar(tok, "json_object")
            return compile_grammar(tok, "json", fmt.json_schema.schema_)
        except GrammarError as e:
            raise invalid(f"`response_format`: {e}") from None

    def chat_message(q, plan) -> tuple[dict, str]:
        """A finished choice's message and finish_reason: its text, or (with tools) its tool call."""
        text, finish = final_text(q.last), FINISH[q.last.finish_reason]
        if plan is None:
            return {"role": "assistant", "content": text}, finish
        reply = tools.read_reply(text, final=True)
        if reply.name is None:
            return {"role": "assistant", "content": reply.text}, finish
        call = tools.tool_call(tools.new_call_id(), reply.name, reply.text)
        return {"role": "assistant", "content": None, "tool_calls": [call]}, tools.finish_reason(reply, finish)

    def chat_prompt(req: ChatRequest, plan: tools.ToolPlan | None) -> list[int]:
        """The request's messages (and tools) through the chat template, tokenized."""
        try:
            template = tok.get_chat_template(tools=plan.offered if plan else None)  # (a model may have a tool_use one)
        except Exception:  # noqa: BLE001 - no template: apply_chat_template below says so
            template = None
        renders_tools = tools.renders(template, "tools")
        messages = chat_messages(req.messages, tools.renders(template, "tool_calls"), tools.renders(template, "developer"))
        if plan is not None:
            messages = tools.with_tools(messages, plan, renders_tools)
        try:
            prompt = tok.apply_chat_template(messages, tools=plan.offered if plan and renders_tools else None,
                                             tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - no or broken template
            raise invalid(f"`messages`: cannot apply the chat template: {e}") from None
        if not prompt:  # the messages were checked non-empty: the template dropped them
            raise invalid("`messages`: the chat template rendered no text from these messages")
        return ctx.encode(prompt, "messages", add_special_tokens=False)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        start = time.monotonic()
        req = await ctx.read(ChatRequest, request)
        with ctx.admit() as slot:  # a 429 before templating, tokenizing or compiling (TGI's order); handed on
            return await chat_answer(req, request, slot, start)

    async def chat_answer(req: ChatRequest, request: Request, slot, start: float):
        plan = tools.plan(req.tools, req.tool_choice, req.tool_prompt)
        if plan is not None and req.response_format is not None and req.response_format.type != "text":
            raise invalid("`response_format` cannot be combined with `tools`: a tool call's grammar holds the reply")
        if plan is not None and req.stop:  # a stop sequence would cut a call short of its grammar's end
            raise invalid("`stop` cannot be combined with `tools`: a tool reply ends where its grammar ends it")
        # templated and tokenized, then compiled, off the event loop (/health and streams go on)
        ids = await run_in_threadpool(chat_prompt, req, plan)
        fmt = req.response_format
        grammar = None if plan is None and (fmt is None or fmt.type == "text") else \
            await ctx.compile(request, chat_grammar, req, plan)  # (a request without one never waits for the compiles)
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        names = ("messages", "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        if req.max_completion_tokens is not None and req.max_tokens is not None:  # both given: each must fit
            ctx.max_new(len(ids), req.max_tokens, 100, names=("messages", "max_tokens"))
        make = lambda n: params(req, n, max_new, top_n=top_n, grammar=grammar, default_max_new=100, names=names)  # noqa: E731
        jobs = jobs_for(req, [ids], make, req.n)
        if req.stream:
            return stream(jobs, [ids], req, chat=True, plan=plan, slot=slot, arrival=start)
        seqs = await ctx.collect(jobs, request, slot)
        choices = []
        for j, q in enumerate(seqs):
            message, finish = chat_message(q, plan)
            lp = chat_logprobs(before_stop(q.tokens, q.last.stop_at)) if req.logprobs else None
            choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": finish})
        ctx.answered(start, seqs)  # once the answer is built (a failure building it is not also a success)
        return {**head(True, False), "choices": choices, "usage": usage([ids], seqs)}

    # -- streaming (both) -----------------------------------------------------------------------------------
    def stream(jobs, prompts, req, *, chat: bool, slot, arrival: float, echo: list[str] | None = None, plan=None) -> StreamingResponse:
        """`slot`: the request's place, taken by the route (a 429 comes before the 200 of the stream); `arrival`:
        when it came (time.monotonic())."""
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        h = {**head(chat, True), **({"usage": None} if include_usage else {})}  # as OpenAI: null until the last chunk
        per = len(jobs) // len(prompts)
        want_lp = bool(req.logprobs) if chat else req.logprobs is not None
        unnamed = set(range(len(jobs)))  # chat choices whose role has not been sent (OpenAI sends it once)

        calls = [tools.ToolStream() for _ in jobs] if plan is not None else None

        def choice(j, text, finish, toks, offset=0, prompt=None, delta=None):
            if chat:
                delta = delta if delta is not None else {"content": text} if text else {}
                if j in unnamed:
                    unnamed.discard(j)
                    delta = {"role": "assistant", "content": None if "tool_calls" in delta else text, **delta}
                return {"index": j, "delta": delta, "logprobs": chat_logprobs(toks) if want_lp and toks else None,
                        "finish_reason": finish}
            lp = completion_logprobs(scored(jobs[j][0], prompt, toks), offset) if want_lp and (toks or prompt) else None
            return {"index": j, "text": text, "finish_reason": finish, "logprobs": lp}

        async def chunks():
            sent, text, pending, seen = [""] * len(jobs), [""] * len(jobs), [[] for _ in jobs], [[] for _ in jobs]
            at = [0] * len(jobs)  # where the first pending token's text starts
            holds = [HeldBack(params.stop) for _, params in jobs]
            echoed = [not echo] * len(jobs)
            seqs = [Sequence() for _ in jobs]
            try:
                async for i, ev, _ in ctx.stream(jobs, slot=slot, start=arrival):
                    seqs[i].events.append(ev)
                    if not echoed[i]:  # the prompt first, scored (the engine attaches its logprobs to the first event)
                        echoed[i] = True
                        yield chunk({**h, "choices": [choice(i, echo[i // per], None, [], prompt=ev.prompt)]})
                    if ev.token is not None and not (chat and ev.token.special):  # chat logprobs: content tokens
                        pending[i].append(ev.token)
                        seen[i].append(ev.token)
                    if ev.stop_at is not None:  # the stop sequence's tokens, held back with its text, are left out
                        drop = len(seen[i]) - len(before_stop(seen[i], ev.stop_at))
                        pending[i] = pending[i][:max(0, len(pending[i]) - drop)]
                    # stream the text that cannot be part of a stop sequence, so chunks concatenate to the final text
                    if ev.finish_reason:
                        visible = final_text(ev)
                    else:
                        new = "" if ev.token.special else ev.token.text
                        text[i] += new
                        visible = text[i][:len(text[i]) - holds[i].feed(new)]
                    finish = ev.finish_reason and FINISH[ev.finish_reason]
                    if calls is not None:  # a tool reply: its call's deltas, or its text's
                        for d in calls[i].deltas(visible, bool(finish)):
                            yield chunk({**h, "choices": [choice(i, "", None, pending[i], delta=d)]})
                            pending[i] = []
                        if finish:
                            finish = calls[i].finish_reason(finish)
                    else:
                        delta, sent[i], start = visible[len(sent[i]):], visible, at[i]
                        # the tokens whose text has begun to show (those of a held-back stop sequence wait); at the
                        # end, every one left
                        n = len(pending[i]) if finish else len(before_stop(pending[i], len(visible) - start))
                        out, pending[i] = pending[i][:n], pending[i][n:]
                        at[i] += sum(len(t.text) for t in out)
                        if delta or out:
                            yield chunk({**h, "choices": [choice(i, delta, None, out, (len(echo[i // per]) if echo else 0) + start)]})
                    if finish:
                        yield chunk({**h, "choices": [choice(i, "", finish, pending[i] if calls is not None else [])]})
                if include_usage:
                    yield chunk({**h, "choices": [], "usage": usage(prompts, seqs)})
                yield "data: [DONE]\n\n"
            except ApiError as e:
                ctx.metrics.failed(e.error_type)
                yield chunk(openai_error(e.message, e.error_type, e.status))

        return event_stream(slot.tie_to(chunks()), {"x-compute-type": ctx.engine.device.type})

    def model_card() -> dict:
        return {"id": s.served_name, "object": "model", "created": 0, "owned_by": "hqtflow"}

    @r.api_route("/v1/models", methods=["GET", "HEAD"])  # HEAD: as every GET route (TGI's axum does)
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @r.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def get_model(model: str):
        if not model:  # `/v1/models/`: no such route (as every path with a trailing slash)
            raise HTTPException(404, "Not Found")
        if model != s.served_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves '{s.served_name}'", "model_not_found")
        return model_card()

    return r
