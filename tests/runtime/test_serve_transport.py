"""The server's connections: clients that send no whole request, or stop reading their answer, are let go within
--client-timeout (and what they asked for is cancelled); a client gone during its upload is a cancelled request;
requests whose clients left while queued leave the queue at once; --cors-allow-origin."""

import asyncio
import socket
import threading
import time

import httpx

from conftest import running
from hqtflow.runtime.engine import Engine, SamplingParams
from hqtflow.runtime.server import create_app
from hqtflow.runtime.settings import ServeSettings
from test_serve import PROMPT, metric_values


def connect(base: str, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    host, port = base.removeprefix("http://").split(":")
    s.connect((host, int(port)))
    return s


def closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes `s` within `seconds` (what it sends before is read and dropped)."""
    s.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not s.recv(1 << 16):
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return False


def test_a_client_that_sends_no_whole_request_is_let_go(lm):
    """With --client-timeout 1: a connection that sends nothing, half its headers, or half its body is closed
    within seconds (the half-read body counts as a cancelled request, not a server error); others are served."""
    app = create_app(*lm, ServeSettings(max_total_tokens=256, max_input_tokens=32, client_timeout=1))
    body = b'{"inputs": "Hel'
    with running(app) as base:
        idle, half_headers, half_body = connect(base), connect(base), connect(base)
        half_headers.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        half_body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n" + body)
        for s in (idle, half_headers, half_body):
            assert closed_within(s, 10)
            s.close()
        r = httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        m = metric_values(httpx.get(f"{base}/metrics").text)
        assert m['tgi_request_failure{err="cancelled"}'] == 1 and 'tgi_request_failure{err="internal"}' not in m, m


def test_a_client_that_stops_reading_is_let_go_and_its_stream_ends(lm):
    """A stream whose client keeps its socket open but reads nothing: once the socket's buffers are full, the
    connection is closed within --client-timeout, and the stream's generator sees its client gone (for a generation
    request: cancelled, its place given back). A client that reads, however slowly, is not cut."""
    from starlette.responses import StreamingResponse

    ended: list[threading.Event] = []

    async def endless(done: threading.Event):
        try:
            while True:
                yield b"x" * (1 << 16)
                await asyncio.sleep(0)
        finally:
            done.set()

    def stream():
        ended.append(threading.Event())
        return StreamingResponse(endless(ended[-1]))

    app = create_app(*lm, ServeSettings(max_total_tokens=256, max_input_tokens=32, client_timeout=1))
    app.add_api_route("/endless", stream, methods=["GET"])
    with running(app) as base:
        slow, stalled = connect(base, rcvbuf=4096), connect(base, rcvbuf=4096)
        for s in (slow, stalled):
            s.sendall(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(100)
        t0 = time.monotonic()
        while not ended[1].is_set() and time.monotonic() < t0 + 30:
            assert slow.recv(1 << 12)  # a few KB every 0.2 s: slow, never stalled
            time.sleep(0.2)
        assert ended[1].is_set(), "the stream went on for a client that reads nothing"
        for _ in range(15):  # three more --client-timeout periods of slow reading
            assert slow.recv(1 << 12)
            time.sleep(0.2)
        assert not ended[0].is_set(), "a slow reader was cut"
        assert closed_within(stalled, 30)
        for s in (slow, stalled):
            s.close()
        with httpx.stream("GET", f"{base}/generate", timeout=30) as r:  # routing still answers
            assert r.status_code == 405


def test_clients_gone_while_queued_leave_the_queue_at_once(lm):
    """With one sequence running and three waiting, the two waiting requests whose clients left are out of the
    queue (tgi_queue_size) at the engine's next step, not when the running one ends; the third still runs."""
    model, tok = lm
    engine = Engine(model, tok, max_batch_size=1)
    ids = tok(PROMPT)["input_ids"]
    gone, events = [], []
    engine.submit(ids, SamplingParams(max_new_tokens=50), lambda ev: None)
    waiting = [engine.submit(ids, SamplingParams(max_new_tokens=2), emit) for emit in (gone.append, gone.append, events.append)]
    engine.step()
    assert len(engine.pending) == 3
    waiting[0].cancel()
    waiting[1].cancel()
    engine.step()
    assert list(engine.pending) == [waiting[2]]
    while engine.step():
        pass
    assert gone == [] and events[-1].finish_reason == "length"


def test_cors_allow_origin_answers_a_browsers_preflight_before_the_api_key(lm):
    """--cors-allow-origin (TGI's flag): a listed origin's preflight is answered (no API key is sent with it) and
    its answers carry the origin; another origin gets no CORS header; without the flag there is none."""
    settings = ServeSettings(max_total_tokens=256, max_input_tokens=32, api_key="k", cors_allow_origin=["http://ui.example"])
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    with running(create_app(*lm, settings)) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example", r.headers
        r = httpx.get(f"{base}/v1/models", headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = httpx.get(f"{base}/v1/models", headers={"Origin": "http://evil.example", "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in r.headers
    with running(create_app(*lm, ServeSettings(max_total_tokens=256, max_input_tokens=32))) as base:
        r = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "http://ui.example", **preflight})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
