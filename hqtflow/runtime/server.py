"""TGI- and OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI; run with uvicorn).

The engine thread hands events to asyncio queues through loop.call_soon_threadsafe; a client that disconnects
mid-stream cancels its request. Metrics use TGI's names in a per-app prometheus CollectorRegistry.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, Histogram, generate_latest

from hqtflow.runtime.engine import Engine, SamplingParams

MAX_BODY = 1 << 20
MAX_STOP = 4


@dataclass
class ServeSettings:
    model_id: str = "model"
    dtype: str = "bf16"
    max_input_tokens: int = 4095
    max_total_tokens: int = 4096
    max_batch_size: int = 8
    max_concurrent_requests: int = 128
    api_key: str | None = None
    batch_bucket_size: int = 1
    prefill_batch_bucket_size: int = 1
    max_batch_prefill_tokens: int = 4096
    pad_sequence_to_multiple_of: int = 1
    warmup: bool = False


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "validation"):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


class Metrics:
    """TGI's metric names (counters exposed without a _total suffix, as TGI does)."""

    def __init__(self, engine: Engine):
        r = self.registry = CollectorRegistry()
        self.count = Gauge("tgi_request_count", "Requests received", registry=r)
        self.success = Gauge("tgi_request_success", "Requests that succeeded", registry=r)
        self.failure = Gauge("tgi_request_failure", "Requests that failed", ["err"], registry=r)
        secs = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60)
        toks = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
        self.duration = Histogram("tgi_request_duration", "End-to-end request seconds", buckets=secs, registry=r)
        self.generated = Histogram("tgi_request_generated_tokens", "Generated tokens per request", buckets=toks, registry=r)
        self.input_length = Histogram("tgi_request_input_length", "Input tokens per request", buckets=toks, registry=r)
        self.batch_duration = Histogram("tgi_batch_inference_duration", "Forward seconds", ["method"], buckets=secs, registry=r)
        self.batch_size = Histogram("tgi_batch_inference_size", "Batch size run (after bucketing)", ["method"], buckets=toks, registry=r)
        self.shapes = Gauge("hqtflow_batch_shape_runs", "Forward passes per input shape run", ["method", "batch", "seq"], registry=r)
        Gauge("tgi_queue_size", "Requests waiting", registry=r).set_function(lambda: len(engine.pending))
        Gauge("tgi_batch_current_size", "Requests in the running batch", registry=r).set_function(lambda: len(engine.active))
        Gauge("tgi_batch_current_max_tokens", "KV length of the running batch", registry=r).set_function(
            lambda: 0 if engine.mask is None else engine.mask.shape[0] * engine.mask.shape[1])

    def on_step(self, kind: str, batch: int, seconds: float, shape: tuple) -> None:
        self.batch_duration.labels(kind).observe(seconds)
        self.batch_size.labels(kind).observe(batch)
        self.shapes.labels(kind, str(shape[0]), str(shape[1])).inc()


def _params(p: dict, n_input: int, s: ServeSettings, *, default_max_new: int = 100) -> SamplingParams:
    def num(key, kind=float):
        v = p.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and v != int(v))):
            raise ApiError(422, f"Input validation error: `{key}` must be a number")
        return None if v is None else kind(v)

    temperature, top_p, top_k, rep = num("temperature"), num("top_p"), num("top_k", int), num("repetition_penalty")
    max_new, seed = num("max_new_tokens", int), num("seed", int)
    if temperature is not None and temperature <= 0:
        raise ApiError(422, "Input validation error: `temperature` must be strictly positive")
    if top_p is not None and not 0 < top_p <= 1:
        raise ApiError(422, "Input validation error: `top_p` must be > 0.0 and < 1.0")
    if top_k is not None and top_k <= 0:
        raise ApiError(422, "Input validation error: `top_k` must be strictly positive")
    if rep is not None and rep <= 0:
        raise ApiError(422, "Input validation error: `repetition_penalty` must be strictly positive")
    stop = p.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise ApiError(422, "Input validation error: `stop` must be a list of strings")
    if len(stop) > MAX_STOP:
        raise ApiError(422, f"Input validation error: `stop` supports up to {MAX_STOP} stop sequences. Given: {len(stop)}")
    if n_input > s.max_input_tokens:
        raise ApiError(422, f"Input validation error: `inputs` must have less than {s.max_input_tokens} tokens. Given: {n_input}")
    if max_new is None:
        max_new = max(1, min(default_max_new, s.max_total_tokens - n_input))
    if max_new <= 0:
        raise ApiError(422, "Input validation error: `max_new_tokens` must be strictly positive")
    if n_input + max_new > s.max_total_tokens:
        raise ApiError(422, f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {s.max_total_tokens}. "
                            f"Given: {n_input} `inputs` tokens and {max_new} `max_new_tokens`")
    warpers = (temperature not in (None, 1.0)) or (top_k is not None) or (top_p not in (None, 1.0))
    return SamplingParams(max_new_tokens=max_new, do_sample=bool(p.get("do_sample")) or warpers,
                          temperature=temperature or 1.0, top_k=top_k or 0, top_p=top_p or 1.0,
                          repetition_penalty=rep or 1.0, stop=tuple(stop), seed=seed)


def create_app(model, tokenizer, settings: ServeSettings) -> FastAPI:
    s = settings
    engine = Engine(model, tokenizer, max_batch_size=s.max_batch_size, batch_bucket=s.batch_bucket_size,
                    pad_to_multiple=s.pad_sequence_to_multiple_of, prefill_bucket=s.prefill_batch_bucket_size,
                    max_prefill_tokens=s.max_batch_prefill_tokens)
    metrics = Metrics(engine)
    engine.on_step = metrics.on_step
    state = {"in_flight": 0, "ready": not s.warmup}

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        if s.warmup:
            asyncio.get_running_loop().run_in_executor(None, _warmup)
        yield
        engine.stop()

    app = FastAPI(title="hqtflow serve", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    def _warmup():
        """Run each bucketed prefill length once (and one decode at the smallest batch bucket), then report healthy."""
        step = max(1, s.pad_sequence_to_multiple_of)
        filler = next(i for i in range(len(tokenizer)) if i not in engine.eos and i not in engine.special)
        for n in range(step, s.max_input_tokens + 1, step) if step > 1 else [1]:
            engine.generate([filler] * n, SamplingParams(max_new_tokens=2))
        state["ready"] = True

    def error(req: Request, status: int, message: str, error_type: str) -> JSONResponse:
        if req.url.path.startswith("/v1"):
            return JSONResponse({"error": {"message": message, "type": error_type, "param": None, "code": status}}, status)
        return JSONResponse({"error": message, "error_type": error_type}, status)

    @app.exception_handler(ApiError)
    async def _api_error(req: Request, e: ApiError):
        metrics.failure.labels(e.error_type).inc()
        return error(req, e.status, e.message, e.error_type)

    @app.middleware("http")
    async def _guard(req: Request, call_next):
        if s.api_key and req.url.path not in ("/health", "/metrics") and req.headers.get("authorization") != f"Bearer {s.api_key}":
            return error(req, 401, "Invalid or missing API key", "authentication_error")
        if int(req.headers.get("content-length") or 0) > MAX_BODY:
            return error(req, 413, f"Request body larger than {MAX_BODY} bytes", "validation")
        return await call_next(req)

    async def body(req: Request) -> dict:
        chunks, size = [], 0
        async for chunk in req.stream():  # the limit holds while streaming (chunked bodies have no content-length)
            size += len(chunk)
            if size > MAX_BODY:
                raise ApiError(413, f"Request body larger than {MAX_BODY} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = json.loads(raw)
        except ValueError:
            raise ApiError(422, "Input validation error: the body is not valid JSON") from None
        if not isinstance(data, dict):
            raise ApiError(422, "Input validation error: the body must be a JSON object")
        return data

    def encode(text, add_special_tokens=True) -> list[int]:
        if not isinstance(text, str) or not text:
            raise ApiError(422, "Input validation error: `inputs` cannot be empty")
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    async def run(ids: list[int], params: SamplingParams):
        """Admit a request and yield its engine events; cancels it if the consumer goes away."""
        if state["in_flight"] >= s.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")
        state["in_flight"] += 1
        metrics.count.inc()
        metrics.input_length.observe(len(ids))
        loop, queue, t0 = asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter()
        handle = engine.submit(ids, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        n, ok = 0, False
        try:
            while True:
                ev = await queue.get()
                if ev.error:
                    raise ApiError(424, ev.error, "generation")
                n += 1
                ok = ev.finish_reason is not None
                yield ev, handle
                if ok:
                    return
        finally:
            state["in_flight"] -= 1
            if ok:
                metrics.success.inc()
                metrics.duration.observe(time.perf_counter() - t0)
                metrics.generated.observe(n)
            else:
                handle.cancel()

    async def collect(ids, params):
        pairs = [pair async for pair in run(ids, params)]
        return [ev for ev, _ in pairs], pairs[-1][1]

    def sse(data) -> str:
        return f"data:{json.dumps(data)}\n\n"

    def token_json(t):
        return {"id": t.id, "text": t.text, "logprob": t.logprob, "special": t.special}

    # ---- TGI routes ----------------------------------------------------------------------------------------
    def tgi_request(data):
        inputs, p = data.get("inputs"), data.get("parameters") or {}
        ids = encode(inputs)
        return inputs, ids, p, _params(p, len(ids), s)

    @app.post("/generate")
    async def generate(req: Request):
        inputs, ids, p, params = tgi_request(await body(req))
        events, handle = await collect(ids, params)
        last = events[-1]
        text = (inputs if p.get("return_full_text") else "") + last.generated_text
        out = {"generated_text": text}
        if p.get("details"):
            out["details"] = {"finish_reason": last.finish_reason, "generated_tokens": len(events), "seed": handle.seed,
                              "prefill": [], "tokens": [token_json(e.token) for e in events]}
        return out

    @app.post("/generate_stream")
    async def generate_stream(req: Request):
        inputs, ids, p, params = tgi_request(await body(req))
        if state["in_flight"] >= s.max_concurrent_requests:  # fail before the 200 of the stream
            raise ApiError(429, "Model is overloaded", "overloaded")

        async def events():
            try:
                async for ev, handle in run(ids, params):
                    out = {"index": ev.index, "token": token_json(ev.token), "generated_text": None, "details": None}
                    if ev.finish_reason:
                        out["generated_text"] = (inputs if p.get("return_full_text") else "") + ev.generated_text
                        out["details"] = {"finish_reason": ev.finish_reason, "generated_tokens": ev.index + 1,
                                          "seed": handle.seed, "input_length": len(ids)}
                    yield sse(out)
            except ApiError as e:
                yield sse({"error": e.message, "error_type": e.error_type})

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        if not state["ready"]:
            return JSONResponse({"error": "warming up", "error_type": "unhealthy"}, 503)
        return Response(status_code=200)

    @app.get("/info")
    async def info():
        from hqtflow import __version__

        return {"model_id": s.model_id, "model_sha": None, "model_dtype": s.dtype, "model_device_type": engine.device.type,
                "max_concurrent_requests": s.max_concurrent_requests, "max_best_of": 1, "max_stop_sequences": MAX_STOP,
                "max_input_tokens": s.max_input_tokens, "max_total_tokens": s.max_total_tokens, "validation_workers": 1,
                "max_client_batch_size": 1, "router": "hqtflow", "version": __version__}

    @app.post("/tokenize")
    async def tokenize(req: Request):
        inputs = (await body(req)).get("inputs")
        encode(inputs)
        enc = tokenizer(inputs, return_offsets_mapping=True)
        return [{"id": i, "text": inputs[a:b], "start": a, "stop": b} for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"])]

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- OpenAI routes -------------------------------------------------------------------------------------
    def openai_params(data, n_input):
        if data.get("n", 1) != 1:
            raise ApiError(422, "Only n=1 is supported")
        temperature = data.get("temperature", 1.0)
        p = {"max_new_tokens": data.get("max_completion_tokens", data.get("max_tokens")), "stop": data.get("stop"),
             "seed": data.get("seed"), "top_p": data.get("top_p")}
        if temperature:  # OpenAI: 0 means greedy
            p.update(do_sample=True, temperature=temperature)
        return _params(p, n_input, s, default_max_new=16)

    finish_map = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}

    async def openai(req: Request, chat: bool):
        data = await body(req)
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(422, "`messages` must be a non-empty list")
            try:
                prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - no or broken template
                raise ApiError(422, f"Cannot apply the chat template: {e}") from None
            ids = encode(prompt, add_special_tokens=False)
        else:
            prompt = data.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
            ids = encode(prompt)
        params = openai_params(data, len(ids))
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "created": created, "model": s.model_id}

        def choice(text, finish, stream):
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key = "delta" if stream else "message"
            return {"index": 0, key: {"role": "assistant", "content": text} if not stream or text else {}, "finish_reason": finish}

        if not data.get("stream"):
            events, _ = await collect(ids, params)
            last = events[-1]
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(events), "total_tokens": len(ids) + len(events)}
            return {**head, "object": obj, "choices": [choice(last.generated_text, finish_map[last.finish_reason], False)], "usage": usage}
        if state["in_flight"] >= s.max_concurrent_requests:
            raise ApiError(429, "Model is overloaded", "overloaded")

        async def chunks():
            sent = ""
            try:
                async for ev, _ in run(ids, params):
                    # stream the visible text (stop sequences trimmed), so chunks concatenate to the final text
                    visible = ev.generated_text if ev.finish_reason else sent + ("" if ev.token.special else ev.token.text)
                    if ev.finish_reason is None and any(stop in visible for stop in params.stop):
                        continue
                    delta, sent = visible[len(sent):], visible
                    if delta:
                        yield "data: " + json.dumps({**head, "object": obj + ("" if not chat else ".chunk"), "choices": [choice(delta, None, True)]}) + "\n\n"
                    if ev.finish_reason:
                        yield "data: " + json.dumps({**head, "object": obj + ("" if not chat else ".chunk"),
                                                     "choices": [choice("", finish_map[ev.finish_reason], True)]}) + "\n\n"
                yield "data: [DONE]\n\n"
            except ApiError as e:
                yield "data: " + json.dumps({"error": {"message": e.message, "type": e.error_type, "param": None, "code": e.status}}) + "\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(req: Request):
        return await openai(req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: Request):
        return await openai(req, chat=True)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": s.model_id, "object": "model", "created": 0, "owned_by": "hqtflow"}]}

    return app


def listen_socket(host: str, port: int):
    """Bind host:port before anything is loaded, so a bad or busy address is one sentence, not a late uvicorn error."""
    import socket

    from hqtflow.errors import HqtflowError

    if not 1 <= port <= 65535:
        raise HqtflowError(f"--port must be between 1 and 65535, not {port}.")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise HqtflowError(f"Cannot resolve --host {host!r} ({getattr(e, 'strerror', None) or e}).") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a live listener still refuses
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise HqtflowError(f"Cannot listen on {host}:{port} ({e.strerror}); pick another --host or --port.") from None
    return sock


def serve(model_ref: str | None, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 3000, kind: str = "bf16",
          measurement: str | None = None, backend: str = "auto") -> None:
    """Bind host:port, load MODEL (`kind` "fp8": an FP8 checkpoint, or a bf16 model quantized at start from
    `measurement`, like TGI with QUANT_CONFIG; "bf16": a plain model) and serve it until interrupted."""
    sock = listen_socket(host, port)
    try:
        _serve(sock, model_ref, settings, kind=kind, measurement=measurement, backend=backend)
    finally:
        sock.close()


def _run(app, sock) -> None:
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])


def _serve(sock, model_ref, settings: ServeSettings, *, kind: str, measurement: str | None, backend: str) -> None:
    from hqtflow.errors import HqtflowError
    from hqtflow.evaluate import load_any

    if measurement is not None:
        if kind != "fp8":
            raise HqtflowError("--measurement quantizes at start: use it with `hqtflow serve fp8`.")
        from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

        from hqtflow.quantize.fp8_linear import set_backend

        model, tok = quantize_in_memory(QuantizeSettings(measurement=measurement, output="-", model=model_ref))
        set_backend(model, backend)
        settings.model_id, settings.dtype = model_ref or "smollm2", "fp8"
        _run(create_app(model, tok, settings), sock)
        return
    model, tok, loaded = load_any(model_ref, backend=backend)  # compute dtype: the fastest here
    if (loaded == "fp8") != (kind == "fp8"):
        raise HqtflowError(f"{model_ref or 'the default model'} is {'an FP8 checkpoint' if loaded == 'fp8' else 'not an FP8 checkpoint'}; "
                           f"use `hqtflow serve {'fp8' if loaded == 'fp8' else 'bf16'}`.")
    settings.model_id, settings.dtype = model_ref or "smollm2", loaded
    _run(create_app(model, tok, settings), sock)
