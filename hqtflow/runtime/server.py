"""TGI- and OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI; run with uvicorn).

The app composes: TGI's error JSON on every status (OpenAI's on /v1/), a guard (415 for a body that is not JSON, 413, the API key), the
engine's lifespan (and warmup), and the routers of tgi_routes.py, openai_routes.py and metrics.py (TGI's metric
names). Request models live in schemas.py, the n/best_of runner in api.py. The engine thread hands events to
asyncio queues through a mailbox (api.Mailbox: one loop wake-up per step, not per token); a client that disconnects
(mid-stream, or while it waits for a non-streaming answer: the ASGI `http.disconnect`) cancels its request, which
leaves the batch at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import warnings
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException

from hqtflow.models import DEFAULT_MODEL
from hqtflow.runtime import grammar
from hqtflow.runtime.api import JSON, Ctx, ServeSettings, logits_width
from hqtflow.runtime.docs_ui import docs_app
from hqtflow.runtime.engine import STOPPED, Engine, SamplingParams
from hqtflow.runtime.metrics import Metrics, metrics_router
from hqtflow.runtime.openai_routes import openai_router
from hqtflow.runtime.schemas import ApiError, openai_error, too_large
from hqtflow.runtime.tgi_routes import tgi_router


GENERATION_ROUTES = ("/", "/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions")
BODY_ROUTES = (*GENERATION_ROUTES, "/tokenize")  # the POST routes that read a JSON body
ERROR_TYPES = {401: "authentication_error", 404: "not_found", 405: "method_not_allowed", 413: "validation",
               415: "unsupported_media_type", 422: "validation", 429: "overloaded"}


def error(status: int, message: str, error_type: str | None = None, path: str = "") -> JSON:
    """TGI's error body; OpenAI's on the /v1/ routes (what each family's official client reads)."""
    error_type = error_type or ERROR_TYPES.get(status, "error")
    if path.startswith("/v1/"):
        return JSON(openai_error(message, error_type, status), status)
    return JSON({"error": message, "error_type": error_type}, status)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """TGI's error JSON for hqtflow's ApiError (counted as a failure) and for Starlette's HTTP errors (404, 405...)."""

    @app.exception_handler(ApiError)
    async def _api_error(req: Request, e: ApiError):
        if generation(req):
            metrics.failed(e.error_type)
        log_refusal(req, e)
        return error(e.status, e.message, e.error_type, req.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(req: Request, e: HTTPException):  # its headers kept: a 405's Allow
        response = error(e.status_code, str(e.detail), path=req.url.path)
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _server_error(req: Request, e: Exception):  # a bug: answered in the API's JSON (uvicorn logs the traceback)
        if generation(req):
            metrics.failed("internal")
        response = error(500, f"Internal server error ({type(e).__name__})", "internal", req.url.path)
        # Starlette raises the error again once this is sent, and uvicorn then closes the connection: said here, so a
        # client opens a new one for its next request instead of sending it into a closed socket
        response.headers["connection"] = "close"
        return response


def log_refusal(req: Request, e: ApiError) -> None:
    """One warning line for a 422: its reason (which names fields, never the prompt's text)."""
    if e.status == 422:
        logging.getLogger("uvicorn.error").warning("%s %s: 422 %s", req.method, req.url.path, e.message)


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines of GET/HEAD /health and /metrics (probes and scrapes, every few seconds)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[1] in ("GET", "HEAD") and args[2] in ("/health", "/metrics"))


def generation(req: Request) -> bool:
    """A request that counts in tgi_request_count (and so in its successes or failures)."""
    return req.method == "POST" and req.url.path in GENERATION_ROUTES


def authorized(req: Request, key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235, as TGI), the key compared in constant time."""
    scheme, _, given = req.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def request_guard(s: ServeSettings, metrics: Metrics):
    """The HTTP middleware before every route: counts generation requests, checks the API key, the body size and
    that a POST body is JSON."""

    async def guard(req: Request, call_next):
        counted = generation(req)
        if counted:
            metrics.counters.inc("tgi_request_count")

        def refuse(status: int, message: str, err: str):
            if counted:
                metrics.failed(err)
            return error(status, message, path=req.url.path)

        if s.api_key and req.url.path not in ("/health", "/metrics") and not authorized(req, s.api_key):
            response = refuse(401, "Invalid or missing API key", "authentication")
            response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme to answer with
            return response
        if int(req.headers.get("content-length") or 0) > s.payload_limit:
            return refuse(413, too_large(s.payload_limit).message, "validation")
        if req.method != "POST" or req.url.path not in BODY_ROUTES:  # other methods and paths: routing's 404 / 405
            return await call_next(req)
        if req.query_params:  # TGI and OpenAI take every parameter in the body: one in the URL would be ignored
            names = ", ".join(f"`{k}`" for k in dict.fromkeys(req.query_params.keys()))
            return refuse(422, f"Query parameters are not accepted (parameters go in the JSON body). Given: {names}", "validation")
        ctype, *options = [part.strip().lower() for part in req.headers.get("content-type", "").split(";")]
        if ctype != "application/json":
            return refuse(415, "Expected request with `Content-Type: application/json`", "validation")
        charset = next((o.split("=", 1)[1].strip('"') for o in options if o.startswith("charset=")), "utf-8")
        encoding = req.headers.get("content-encoding", "identity").strip().lower()
        if charset not in ("utf-8", "utf8") or encoding != "identity":
            return refuse(415, "Expected a UTF-8 JSON body without Content-Encoding (given charset "
                          f"{charset!r}, Content-Encoding {encoding!r})", "validation")
        return await call_next(req)

    return guard


def warm_up(engine: Engine, tokenizer, s: ServeSettings, state: dict, metrics: Metrics) -> None:
    """Run each bucketed prefill length once (and one decode at the smallest batch bucket; a prompt longer than
    --max-batch-prefill-tokens runs in chunks, so chunks with a past run too), then report healthy;
    stop at the first run that fails (the engine stopped because the server is shutting down, which must not wait on
    this thread; or a shape that cannot run, logged): /health then never reports ready. Its steps are not in TGI's
    tgi_batch_* metrics (nor those of requests served meanwhile, which share them)."""
    metrics.warming = True
    try:
        _warm_up(engine, tokenizer, s, state)
    finally:
        metrics.warming = False


def _warm_up(engine: Engine, tokenizer, s: ServeSettings, state: dict) -> None:
    step = max(1, s.pad_sequence_to_multiple_of)
    filler = next(i for i in range(len(tokenizer)) if i not in engine.eos and i not in engine.special)
    for n in range(step, s.max_input_tokens + 1, step) if step > 1 else [1]:
        error = engine.generate([filler] * n, SamplingParams(max_new_tokens=2))[-1].error
        if error:
            if error != STOPPED:
                logging.getLogger("uvicorn.error").error("Warm-up failed at a prompt of %d tokens: %s", n, error)
            return
    state["ready"] = True


def lifespan(engine: Engine, tokenizer, s: ServeSettings, state: dict, metrics: Metrics):
    """The engine thread runs while the app does; with warmup, the shapes are run in the background at start, and the
    grammar compiler is prepared on the grammar's thread (grammar.prepare). At the end, the engine's step is waited for
    until the shutdown deadline a signal set (`app.state.deadline`)."""

    @asynccontextmanager
    async def run(_app):
        if engine.graphs is not None:  # before the engine thread starts and before any request is accepted
            t = time.monotonic()
            n = engine.graphs.capture_all(s.max_total_tokens)
            failed = f" (failed: {engine.graphs.failed}; decode steps run eagerly)" if engine.graphs.failed else ""
            logging.getLogger("uvicorn.error").info("%d CUDA graphs of decode steps captured in %.1f s%s", n,
                                                    time.monotonic() - t, failed)
        engine.start()
        width = logits_width(engine.model)
        _app.state.grammar_prepared = grammar.compile_pool.submit(grammar.prepare, tokenizer, width)
        if s.warmup:
            asyncio.get_running_loop().run_in_executor(None, warm_up, engine, tokenizer, s, state, metrics)
        yield
        deadline = getattr(_app.state, "deadline", None)
        engine.stop(wait=30.0 if deadline is None else max(0.0, deadline - time.monotonic()))

    return run


def create_app(model, tokenizer, settings: ServeSettings) -> FastAPI:
    from hqtflow.runtime.cuda_graphs import parse_batch_sizes

    from hqtflow.models import context_length
    from hqtflow.runtime import limits

    from hqtflow.errors import ResourceError

    s = limits.fit(settings, context_length(model.config.to_dict()))  # the limits the model can hold (TGI's defaults)
    try:
        engine = Engine(model, tokenizer, max_batch_size=s.max_batch_size, batch_bucket=s.batch_bucket_size,
                        pad_to_multiple=s.pad_sequence_to_multiple_of, prefill_bucket=s.prefill_batch_bucket_size,
                        max_prefill_tokens=s.max_batch_prefill_tokens, max_batch_total_tokens=s.max_batch_total_tokens,
                        kv_cache=s.kv_cache, cuda_graphs=parse_batch_sizes(s.cuda_graphs) if s.cuda_graphs else None,
                        compile=s.compile)
    except ResourceError as e:  # the KV cache asked for does not fit: name what asked for it
        if s.max_batch_total_tokens is None:
            raise
        why = str(e)
        raise ResourceError(f"{s.given('max_batch_total_tokens')}: {why[0].lower()}{why[1:].rstrip('.')}; give fewer "
                            "tokens, or leave it out to size the cache from the free memory.") from None
    metrics = Metrics(engine)
    engine.on_step = metrics.on_step
    state = {"in_flight": 0, "ready": not s.warmup}
    app = docs_app(title="hqtflow serve", lifespan=lifespan(engine, tokenizer, s, state, metrics),
                   default_response_class=JSON,  # NaN or inf as null (TGI's), never a 500 for a computed answer
                   redirect_slashes=False)  # `/generate/` is a 404, not a redirect to a URL built from the Host header
    app.state.engine, app.state.metrics, app.state.model_id, app.state.settings = engine, metrics, s.model_id, s
    add_error_handlers(app, metrics)
    app.middleware("http")(request_guard(s, metrics))
    if s.cors_allow_origin:  # outermost: a browser's preflight is answered before the API key is asked for
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=s.cors_allow_origin, allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    ctx = app.state.ctx = Ctx(engine, tokenizer, s, metrics, state)
    for router in (tgi_router(ctx), openai_router(ctx), metrics_router(metrics)):
        app.include_router(router)

    def openapi() -> dict:  # FastAPI's, completed with the bodies and answers the routes handle themselves
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            from hqtflow import __version__
            from hqtflow.runtime.openapi import publish

            with warnings.catch_warnings():  # GET and HEAD share each GET route: publish() names them apart
                warnings.filterwarnings("ignore", "Duplicate Operation ID")
                spec = get_openapi(title=app.title, version=__version__, routes=app.routes)
            app.openapi_schema = publish(spec, vocab=len(tokenizer), max_input_tokens=s.max_input_tokens,
                                         max_total_tokens=s.max_total_tokens, max_stop_sequences=s.max_stop_sequences,
                                         max_best_of=s.max_best_of, max_top_n_tokens=s.max_top_n_tokens,
                                         max_client_batch_size=s.max_client_batch_size, payload_limit=s.payload_limit,
                                         api_key=bool(s.api_key))
        return app.openapi_schema

    app.openapi = openapi
    return app


def listen_socket(host: str, port: int, port_name: str = "--port"):
    """Bind host:port before anything is loaded, so a bad or busy address is one sentence, not a late uvicorn error
    (`port_name`: what set the port, the flag or PORT)."""
    import socket

    from hqtflow.errors import HqtflowError, ResourceError
    from hqtflow.runtime.transport import check_port

    check_port(port, port_name)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise HqtflowError(f"Cannot resolve --host {host!r} ({getattr(e, 'strerror', None) or e}).") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a live listener still refuses
        sock.bind(addr)
        sock.listen(2048)  # now, not in uvicorn once loaded: a second server started at once on this port is refused here
    except OSError as e:
        sock.close()
        raise ResourceError(f"Cannot listen on {host}:{port} ({e.strerror}); pick another --host or {port_name}.") from None
    return sock


def serve(model_ref: str | None, settings: ServeSettings, *, host: str = "127.0.0.1", port: int = 3000, kind: str = "bf16",
          measurement: str | None = None, backend: str = "auto", dtype: str = "auto", inc_device: str | None = None,
          config: str | None = None, scale_method: str | None = None, device: str | None = None,
          trust_pickle: bool = False) -> None:
    """Bind host:port, load MODEL (`kind` "fp8": an FP8 checkpoint, or a bf16 model quantized at start from
    `measurement` with the QUANTIZE `config` / `scale_method`, like TGI with QUANT_CONFIG, by hqtflow on `device`
    (hardware.run_device: a CUDA GPU when there is one) or by Neural Compressor on `inc_device`; "bf16": a plain
    model) and serve it until interrupted. `trust_pickle`: load a model whose weights are only pickles
    (models.load_model)."""
    from hqtflow.hardware import run_device

    from hqtflow.errors import HqtflowError
    from hqtflow.runtime.cuda_graphs import parse_batch_sizes

    device = run_device(device) if inc_device is None else None  # refused before the port is taken
    graphs = parse_batch_sizes(settings.cuda_graphs)
    no_graphs = bool(settings.cuda_graphs) and not graphs
    if settings.compile and (device != "cuda" or no_graphs):
        raise HqtflowError("--compile compiles the CUDA-graph decode steps: it needs hqtflow's engine on a CUDA GPU "
                           f"(--device cuda) with {settings.named('cuda_graphs')} other than 0.")
    if graphs and device != "cuda":
        none = settings.given("cuda_graphs").replace(settings.cuda_graphs, "0")
        raise HqtflowError(f"CUDA graphs ({settings.given('cuda_graphs')}) need a CUDA GPU; this model runs on "
                           f"{device or inc_device} (give {none}).")
    from hqtflow import models
    from hqtflow.runtime import limits

    # its limits from its config.json (a limit beyond its context refused before anything is loaded)
    settings = limits.fit(settings, models.context_length(models.load_config(models.resolve_model(model_ref))))
    sock = listen_socket(host, port, settings.named("port"))
    try:
        _serve(sock, model_ref, settings, kind=kind, measurement=measurement, backend=backend, dtype=dtype,
               inc_device=inc_device, config=config, scale_method=scale_method, device=device or "cpu",
               trust_pickle=trust_pickle)
    finally:
        sock.close()


def _run(app, sock) -> None:
    import contextlib
    import signal
    import threading

    import uvicorn

    timeout = app.state.settings.shutdown_timeout

    class Server(uvicorn.Server):
        """On SIGTERM, SIGHUP or Ctrl-C, running requests have --shutdown-timeout seconds to finish; then what is left
        ends with an error (a stream's last event says so) a second before uvicorn would cut the connections."""

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's signals (SIGINT, SIGTERM), and SIGHUP (a closed terminal, a supervisor) unless it is ignored
            (nohup). Its handler is put back before uvicorn raises the caught signals again once the server has
            stopped (exit 128 + the signal); a second SIGHUP while draining changes nothing, as a second SIGTERM."""
            with super().capture_signals():
                main = threading.current_thread() is threading.main_thread()
                hup = (signal.getsignal(signal.SIGHUP) or signal.SIG_DFL) if main else signal.SIG_IGN
                if hup is not signal.SIG_IGN:
                    signal.signal(signal.SIGHUP, self.handle_exit)
                try:
                    yield
                finally:
                    if hup is not signal.SIG_IGN:
                        signal.signal(signal.SIGHUP, hup)

        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                drain(app, timeout)
            super().handle_exit(sig, frame)

    from hqtflow.runtime.transport import raise_open_files_limit

    raise_open_files_limit()
    config = uvicorn_config(app, log_level="info")
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    host, port = sock.getsockname()[:2]
    logging.getLogger("uvicorn.error").info("Serving %s on http://%s:%d", app.state.model_id,
                                            f"[{host}]" if ":" in host else host, port)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt as e:  # uvicorn stopped cleanly, then raised the signal again
        e.served = True
        raise
    finally:  # stopped before drain's timer fired (an idle server): it has nothing left to end
        timer = getattr(app.state, "shutdown_timer", None)
        if timer is not None:
            timer.cancel()


def drain(app, timeout: float) -> None:
    """Start a graceful shutdown: running requests have `timeout` seconds (the engine's thread is waited for until
    then), and what is left ends with "the server is shutting down" a second before (half of it, when shorter), in
    time to be sent before uvicorn cancels what is still running at the timeout."""
    import threading

    app.state.deadline = time.monotonic() + timeout
    grace = max(0.0, timeout - min(1.0, timeout / 2))
    timer = threading.Timer(grace, shut_down, args=(app, "the server is shutting down"))
    timer.daemon = True  # an idle server exits at once, without waiting for it
    timer.start()
    app.state.shutdown_timer = timer


def shut_down(app, reason: str) -> None:
    """End every request with `reason`: the ones waiting on the engine at once (their answers go out even while a
    long step runs), and the engine's at its next step."""
    app.state.ctx.shut_down(reason)
    app.state.engine.abort(reason)


def exit_now(code: int) -> None:
    """End the process with `code` once the server has stopped, without the interpreter's teardown: freeing every
    object of torch, transformers and the model takes 1-3 s of CPU, which ran past --shutdown-timeout. The logs are
    flushed, weakref finalizers run (temporary files) and stdio is flushed first; the kernel frees the rest (a step
    the engine thread may still be running ends with the process). Not every atexit handler: torch._dynamo's imports
    tabulate to log a table of compile times, 1.3 s beside a running step."""
    import os
    import sys
    import weakref

    logging.shutdown()
    weakref.finalize._exitfunc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: the exit status still says how it ended
            pass
    os._exit(code)


def uvicorn_config(app, **options):
    """uvicorn's settings for an app of create_app: its --shutdown-timeout, and its --client-timeout on every
    connection (runtime/transport.py)."""
    import uvicorn

    from hqtflow.runtime.transport import protocol

    s = app.state.settings
    return uvicorn.Config(app, timeout_graceful_shutdown=s.shutdown_timeout, http=protocol(s.client_timeout), **options)


def _serve(sock, model_ref, settings: ServeSettings, *, kind: str, measurement: str | None, backend: str,
           dtype: str, inc_device: str | None = None, config: str | None = None, scale_method: str | None = None,
           device: str = "cpu", trust_pickle: bool = False) -> None:
    from hqtflow.errors import HqtflowError, ModelError
    from hqtflow.api import load_any

    if measurement is None and (config or scale_method):
        raise HqtflowError("-c/--config and --scale-method quantize a bf16 MODEL at start: give its measurement with -m DIR.")

    if inc_device is not None:
        if kind != "fp8":
            raise HqtflowError("--engine inc quantizes at start: use it with `hqtflow serve fp8 MODEL -m DIR`.")
        from hqtflow.engines import inc

        model, tok = inc.load_run(model_ref, measurement, device=inc_device, config=config, scale_method=scale_method,
                                  backend=backend, dtype=dtype, trust_pickle=trust_pickle)
        settings.model_id, settings.quantize = model_ref or DEFAULT_MODEL, "fp8"
        _run(_app(model, tok, settings), sock)
        return

    if measurement is not None:
        if kind != "fp8":
            raise HqtflowError("--measurement quantizes at start: use it with `hqtflow serve fp8`.")
        from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

        from hqtflow.api import guard_fp16
        from hqtflow.hardware import resolve_dtype
        from hqtflow.quantize.fp8_linear import set_backend

        dtype = resolve_dtype(dtype, device)  # auto: the fastest where it is served (bf16 on a GPU), as load_any
        model, tok = quantize_in_memory(QuantizeSettings(measurement=measurement, output="-", model=model_ref,
                                                         config=config, scale_method=scale_method), dtype,
                                        trust_pickle=trust_pickle)
        model.to(device)
        set_backend(model, backend)
        if dtype == "fp16":
            guard_fp16(model, model_ref or DEFAULT_MODEL)
        settings.model_id, settings.quantize = model_ref or DEFAULT_MODEL, "fp8"
        _run(_app(model, tok, settings), sock)
        return
    model, tok, loaded = load_any(model_ref, dtype, backend=backend, device=device,
                                  trust_pickle=trust_pickle)  # dtype auto: the fastest there
    if (loaded == "fp8") != (kind == "fp8"):
        raise ModelError(f"{model_ref or 'the default model'} is {'an FP8 checkpoint' if loaded == 'fp8' else 'not an FP8 checkpoint'}; "
                           f"use `hqtflow serve {'fp8' if loaded == 'fp8' else 'bf16'}`.")
    settings.model_id, settings.quantize = model_ref or DEFAULT_MODEL, "fp8" if loaded == "fp8" else None
    _run(_app(model, tok, settings), sock)


def _app(model, tok, settings: ServeSettings):
    """create_app, with the engine's refusals (--kv-cache fp8 without scales, a model the paged cache does not
    support) as one sentence."""
    from hqtflow.errors import HqtflowError

    try:
        return create_app(model, tok, settings)
    except ValueError as e:
        raise HqtflowError(str(e).replace("quantize it with `--kv-cache fp8`", "serve it with --kv-cache bf16, or quantize it "
                                          "with `hqtflow quantize --kv-cache fp8`")) from None
