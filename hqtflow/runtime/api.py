"""What the TGI and OpenAI routes share: the served settings, prompt encoding and length checks, and running one
HTTP request as one or several engine sequences (n / best_of) whose events are merged into one async stream."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import anyio
from fastapi.responses import JSONResponse, StreamingResponse

from hqtflow.runtime.engine import Engine, Event, Request, SamplingParams
from hqtflow.runtime.grammar import compile_pool
from hqtflow.runtime.schemas import ApiError, invalid, parse, read_body, server_bounds
from hqtflow.runtime.settings import ServeSettings

def json_text(data, **kwargs) -> str:
    """`data` as JSON (`kwargs` as json.dumps'); a float that is not finite is written as null, as TGI's serde_json
    writes it (Python's json would write NaN or Infinity, which JSON parsers refuse)."""
    try:
        return json.dumps(data, allow_nan=False, **kwargs)
    except ValueError:  # rare: walked only when a non-finite float is there
        return json.dumps(_finite(data), allow_nan=False, **kwargs)


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class JSON(JSONResponse):
    """Every JSON answer of the server: Starlette's, with json_text's null for a float that is not finite (Starlette's
    own refuses it: a 500 for an answer already computed)."""

    def render(self, content) -> bytes:
        return json_text(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


KEEP_ALIVE_SECONDS = 15.0  # an SSE comment after this long without an event (TGI's axum KeepAlive::default())
KEEP_ALIVE = ":\n\n"  # an SSE comment, which every SSE client skips


@dataclass
class Sequence:
    """The events of one engine sequence, once finished."""
    events: list[Event] = field(default_factory=list)
    handle: Request | None = None

    @property
    def last(self) -> Event:
        return self.events[-1]

    @property
    def tokens(self):
        return [e.token for e in self.events if e.token is not None]

    @property
    def logprob(self) -> float:
        return sum(t.logprob for t in self.tokens)


class Slot:
    """A request's place among the in-flight ones; `release` is idempotent."""

    def __init__(self, state: dict):
        self.state, self.held = state, True
        state["in_flight"] += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state["in_flight"] -= 1

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, kind, value, tb) -> None:
        """`with ctx.admit() as slot:` gives the place back if the block fails (or its client leaves) before the
        block hands it on to a stream, which releases it at its end."""
        if kind is not None:
            self.release()

    def tie_to(self, stream):
        """Free the place when `stream` (an async generator) is gone, even if it never ran (a client that left
        before the response started)."""
        weakref.finalize(stream, self.release)
        return stream


async def _client_left(request) -> None:
    """Return at the ASGI `http.disconnect` of a request whose body has been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _disconnected(request, queue: asyncio.Queue) -> None:
    """Wait for the client of a request whose body has been read to leave, then wake the stream (None)."""
    await _client_left(request)
    queue.put_nowait((None, None))


def log_cancelled(request, cause: str) -> None:
    """One line for a non-streaming request cancelled by `cause` (uvicorn's access log has none: nothing was
    answered)."""
    logging.getLogger("uvicorn.error").info("%s %s: cancelled, %s", request.method, request.url.path, cause)


class Mailbox:
    """Events from the engine thread to the event loop's queues. A step emits a token to every running sequence;
    each `post` appends, and only the first of a burst wakes the loop (`call_soon_threadsafe` writes to the loop's
    self-pipe), so a step of 32 sequences costs the loop one wake-up, not 32."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.scheduled, self.lock = loop, deque(), False, threading.Lock()

    def post(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.items.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, deque(), False
        for queue, item in items:
            queue.put_nowait(item)


async def with_keep_alive(events):
    """`events` (an async generator of SSE text), with a comment whenever KEEP_ALIVE_SECONDS pass without one: a
    stream queued or in a long prefill is not silent on the wire (proxies cut idle connections, nginx's at 60 s)."""
    pending = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=KEEP_ALIVE_SECONDS)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(events))
    finally:  # the client left: the event awaited is cancelled (the request with it), then the stream closed
        pending.cancel()
        with anyio.CancelScope(shield=True):  # Starlette's cancel scope would cancel this cleanup's awaits too
            await asyncio.wait({pending})
            await events.aclose()


def event_stream(events, headers: dict[str, str]) -> StreamingResponse:
    """The SSE answer of `events` (an async generator of SSE text), with keep-alive comments, `headers` and TGI's
    `X-Accel-Buffering: no` (nginx passes each event on at once instead of buffering the answer)."""
    return StreamingResponse(with_keep_alive(events), media_type="text/event-stream",
                             headers={**headers, "X-Accel-Buffering": "no"})


def vocab_size(model, tokenizer) -> int:
    """Token ids a request may name: the tokenizer's, the embedding's rows and the logits' width, whichever is least
    (an id past the embedding or the logits is a device-side assert on CUDA, which breaks the whole server)."""
    return min(len(tokenizer), model.get_input_embeddings().num_embeddings, logits_width(model))


def logits_width(model) -> int:
    """The width of the model's logits: its lm_head's rows (often more than the tokenizer's tokens)."""
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None) or model.config.get_text_config(decoder=True).vocab_size


class Ctx:
    def __init__(self, engine: Engine, tokenizer, settings: ServeSettings, metrics, state: dict):
        self.engine, self.tok, self.s, self.metrics, self.state = engine, tokenizer, settings, metrics, state
        self.mailbox: Mailbox | None = None
        self.waiting: set[asyncio.Queue] = set()  # the queues of the requests waiting on the engine now
        self.closing: str | None = None  # set by shut_down: the error every request ends with
        self.vocab = vocab_size(engine.model, tokenizer)
        self.width = logits_width(engine.model)  # what a grammar's masks cover
        self.bounds = server_bounds(settings.max_best_of, settings.max_top_n_tokens)  # for schemas.parse

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        if self.mailbox is None or self.mailbox.loop is not loop:
            self.mailbox = Mailbox(loop)
        return self.mailbox

    async def read(self, model, request):
        """The request's body, read up to --payload-limit bytes, as `model`, within this server's bounds."""
        return parse(model, await read_body(request, self.s.payload_limit), self.bounds)

    def encode(self, text: str, name: str = "inputs", add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise invalid(f"`{name}` cannot be empty")
        return self.tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def check_ids(self, ids: list[int], name: str = "prompt") -> list[int]:
        if not ids:
            raise invalid(f"`{name}` cannot be empty")
        if not all(0 <= i < self.vocab for i in ids):
            raise invalid(f"`{name}` token ids must be in [0, {self.vocab})")
        return ids

    def max_new(self, n_input: int, max_new: int | None, default: int, names=("inputs", "max_new_tokens")) -> int:
        """TGI's length checks, naming the request's own fields; returns max_new_tokens (default: `default`, capped
        to what fits)."""
        s, (inputs, new) = self.s, names
        if n_input > s.max_input_tokens:
            raise invalid(f"`{inputs}` must have less than {s.max_input_tokens} tokens. Given: {n_input}")
        if max_new is None:
            max_new = max(1, min(default, s.max_total_tokens - n_input))
        if n_input + max_new > s.max_total_tokens:
            raise invalid(f"`{inputs}` tokens + `{new}` must be <= {s.max_total_tokens}. "
                          f"Given: {n_input} `{inputs}` tokens and {max_new} `{new}`")
        return max_new

    async def compile(self, request, fn, *args):
        """`fn(*args)`, a grammar compile, on the grammar's own threads (grammar.compile_pool): off the event loop and
        off the threadpool that tokenizes. A client that leaves meanwhile gets its 499 at once: its compile is skipped
        if still queued; one already running ends on its own (xgrammar cannot be interrupted) and is not waited for."""
        future = asyncio.get_running_loop().run_in_executor(compile_pool, functools.partial(fn, *args))
        watcher = asyncio.ensure_future(_client_left(request))
        try:
            await asyncio.wait({future, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not future.done():
                raise ApiError(499, "Client closed the request", "cancelled")
            return future.result()
        finally:
            future.cancel()  # a compile still queued never runs (a no-op once it has run)
            watcher.cancel()

    def answered(self, start: float, seqs: list[Sequence]) -> None:
        """A non-streaming request answered with `seqs` (`start`: its arrival): its success metrics, once."""
        self.metrics.finished(start, [(q.handle, len(q.tokens)) for q in seqs])

    def shut_down(self, reason: str) -> None:
        """(Any thread.) End every request waiting on the engine with `reason` (a 424, a stream's error event) now,
        without waiting for the engine's step to end, and any later one at once: a long step must not hold the
        answers past uvicorn's shutdown deadline, which cancels what is left (a plain-text 500)."""
        self.closing = reason
        if self.mailbox is not None and not self.mailbox.loop.is_closed():  # closed: the server has stopped
            self.mailbox.loop.call_soon_threadsafe(self._end_waiting, reason)

    def _end_waiting(self, reason: str) -> None:
        for queue in self.waiting:
            queue.put_nowait((0, Event(0, None, error=reason)))

    def admit(self) -> Slot:
        """One of `--max-concurrent-requests` places, taken now (a 429 when none is free), freed by the request."""
        if self.state["in_flight"] >= self.s.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")
        return Slot(self.state)

    async def stream(self, jobs: list[tuple[list[int], SamplingParams]], request=None, slot: Slot | None = None,
                     start: float | None = None, record: bool = True):
        """Run the jobs as one request; yields (job index, event, handle) as tokens come; cancels what is left
        when the consumer goes away (counted as cancelled), or, given the HTTP `request` (a non-streaming one, whose
        body is read), as soon as its client disconnects (the sequences leave the engine's batch at its next step).
        `slot`: the place a streaming route took before its 200 (else one is taken here). `record`: the request's
        success metrics once every job has finished (`start`: its arrival; default now), else the caller's, which
        knows the sequences it answers with (Metrics.finished)."""
        start = time.monotonic() if start is None else start
        slot = slot or self.admit()
        queue = asyncio.Queue()
        mailbox = self._mailbox(asyncio.get_running_loop())
        handles, counts, left = [], [0] * len(jobs), len(jobs)
        watcher = asyncio.ensure_future(_disconnected(request, queue)) if request is not None else None
        self.waiting.add(queue)
        try:
            if self.closing:
                raise ApiError(424, self.closing, "generation")
            # once per request: its prompts, each once (the n sequences of a prompt share its list)
            self.metrics.input_length.observe(sum(len(ids) for ids in {id(ids): ids for ids, _ in jobs}.values()))
            for i, (ids, params) in enumerate(jobs):
                handles.append(self.engine.submit(ids, params, lambda ev, i=i: mailbox.post(queue, (i, ev))))
            while left:
                i, ev = await queue.get()
                if ev is None:  # the client is gone
                    for h in handles:
                        h.cancel()
                    log_cancelled(request, "the client closed the request")
                    raise ApiError(499, "Client closed the request", "cancelled")
                if ev.error:
                    raise ApiError(424, ev.error, "generation")
                counts[i] += ev.token is not None
                left -= ev.finish_reason is not None
                yield i, ev, handles[i]
            if record:
                self.metrics.finished(start, list(zip(handles, counts)))
        except (GeneratorExit, asyncio.CancelledError):  # a client went away (a non-streaming one: its task cancelled)
            self.metrics.failed("cancelled")
            if request is not None:  # its task cancelled: the client left, or the shutdown deadline passed
                log_cancelled(request, "its task was cancelled (the client left, or the shutdown deadline passed)")
            raise
        finally:
            slot.release()
            self.waiting.discard(queue)
            if watcher is not None:
                watcher.cancel()
            for h in handles:
                h.cancel()  # a no-op for finished sequences

    async def collect(self, jobs, request=None, slot: Slot | None = None) -> list[Sequence]:
        """Every event of the jobs; with the HTTP `request`, a client that disconnects cancels them. `slot`: the
        place the route took (else one is taken here). The caller records the success (`answered`)."""
        out = [Sequence() for _ in jobs]
        async for i, ev, handle in self.stream(jobs, request, slot, record=False):
            out[i].events.append(ev)
            out[i].handle = handle
        return out
