"""The SSE streams of OpenAI's routes (completions and chat): chunks whose texts concatenate to the final text
(what may be the start of a stop sequence is held back: HeldBack), their logprobs, tool-call deltas, and
stream_options.include_usage."""

from __future__ import annotations

from typing import Callable

from fastapi.responses import StreamingResponse

from hqtflow.runtime import tools
from hqtflow.runtime.api import Ctx, Sequence, event_stream, json_text
from hqtflow.runtime.openai_text import (FINISH, before_stop, chat_logprobs, completion_logprobs, final_text, head,
                                         usage)
from hqtflow.runtime.schemas import ApiError, openai_error


def chunk(data) -> str:
    return "data: " + json_text(data) + "\n\n"


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


def stream(ctx: Ctx, token_text: Callable[[int], str], jobs, prompts, req, *, chat: bool, slot, arrival: float,
           echo: list[str] | None = None, plan=None) -> StreamingResponse:
    """The SSE answer of `jobs` (per prompt of `prompts`, as many sequences) to `req`, a chat or a completions
    request. `slot`: the request's place, taken by the route (a 429 comes before the 200 of the stream); `arrival`:
    when it came (time.monotonic())."""
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    h = {**head(ctx.s.served_name, chat, True), **({"usage": None} if include_usage else {})}  # as OpenAI: null until the last chunk
    per = len(jobs) // len(prompts)
    want_lp = bool(req.logprobs) if chat else req.logprobs is not None
    unnamed = set(range(len(jobs)))  # chat choices whose role has not been sent (OpenAI sends it once)

    calls = [tools.ToolStream(plan.names) for _ in jobs] if plan is not None else None
    logged = [[] for _ in jobs]  # completions: each choice's generated tokens whose logprobs were sent

    def choice(j, text, finish, toks, offset=0, prompt=None, delta=None):
        if chat:
            delta = delta if delta is not None else {"content": text} if text else {}
            if j in unnamed:
                unnamed.discard(j)
                delta = {"role": "assistant", "content": None if "tool_calls" in delta else text, **delta}
            return {"index": j, "delta": delta, "logprobs": chat_logprobs(ctx.tok, token_text, toks) if want_lp and toks else None,
                    "finish_reason": finish}
        lp = None
        if want_lp and (toks or prompt):
            lp = completion_logprobs(ctx.tok, token_text, jobs[j][0], prompt, toks, offset, before=logged[j])
            logged[j] += toks
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
                        yield chunk({**h, "choices": [choice(i, delta, None, out, len(echo[i // per]) if echo else 0)]})
                if finish:
                    yield chunk({**h, "choices": [choice(i, "", finish, pending[i] if calls is not None else [])]})
            if include_usage:
                yield chunk({**h, "choices": [], "usage": usage(prompts, seqs)})
            yield "data: [DONE]\n\n"
        except ApiError as e:
            ctx.metrics.failed(e.error_type)
            yield chunk(openai_error(e.message, e.error_type, e.status))

    return event_stream(slot.tie_to(chunks()), {"x-compute-type": ctx.engine.device.type})
