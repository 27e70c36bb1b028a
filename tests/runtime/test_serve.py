"""`hqtflow serve`: a real uvicorn server on loopback with a tiny Llama, driven by httpx and the openai client."""

import json
import time

import httpx
import pytest
import torch

from conftest import run_cli, running
from hqtflow.runtime.engine import Engine, SamplingParams
from hqtflow.runtime.server import ServeSettings, create_app

PROMPT = "The tower is"


@pytest.fixture(scope="module")
def url(lm):
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=32, max_total_tokens=64, max_batch_size=4))
    with running(app) as base:
        yield base


def alone(lm, text, n, add_special_tokens=True):
    model, tok = lm
    x = tok(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    with torch.inference_mode():
        out = model.generate(**x, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)


def test_generate_and_stream(url, lm):
    ref = alone(lm, PROMPT, 10)
    r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "details": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == ref
    d = body["details"]
    assert d["finish_reason"] == "length" and d["generated_tokens"] == 10 and len(d["tokens"]) == 10
    assert set(d["tokens"][0]) == {"id", "text", "logprob", "special"}
    full = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 10, "return_full_text": True}})
    assert full.json()["generated_text"] == PROMPT + ref
    def stream(parameters):
        with httpx.stream("POST", f"{url}/generate_stream", json={"inputs": PROMPT, "parameters": parameters}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            return [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]

    events = stream({"max_new_tokens": 10, "details": True})
    assert len(events) == 10 and all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"] == ref
    assert events[-1]["details"]["finish_reason"] == "length"
    plain = stream({"max_new_tokens": 10})  # as TGI: the last event's details only when asked for
    assert plain[-1]["generated_text"] == ref and plain[-1]["details"] is None
    sampled = [httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 8, "do_sample": True, "temperature": 0.8, "seed": 3, "details": True}}).json() for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0]["details"]["seed"] == 3


def test_server_greedy_equals_hqtflow_generate(url, tiny_llama):
    """One engine: the server's greedy text is what `hqtflow generate` prints, with transformers' generate or with
    the serving engine (--engine serve)."""
    served = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 12}}).json()["generated_text"]
    for engine in ("transformers", "serve"):
        r = run_cli("generate", str(tiny_llama), "-p", PROMPT, "--max-new-tokens", "12", "--dtype", "fp32", "--engine", engine)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert r.stdout.rstrip("\n") == served, engine


def test_info_health_tokenize_and_validation(url, lm):
    assert httpx.get(f"{url}/health").status_code == 200
    info = httpx.get(f"{url}/info").json()
    assert info["max_input_tokens"] == 32 and info["max_total_tokens"] == 64 and info["model_id"] == "tiny"
    toks = httpx.post(f"{url}/tokenize", json={"inputs": PROMPT}).json()
    assert [t["id"] for t in toks] == lm[1](PROMPT)["input_ids"]
    long = " ".join(["tower"] * 40)
    n = len(lm[1](long)["input_ids"])
    r = httpx.post(f"{url}/generate", json={"inputs": long, "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 422 and r.json() == {
        "error": f"Input validation error: `inputs` must have less than 32 tokens. Given: {n}", "error_type": "validation"}
    r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 63}})
    assert r.status_code == 422 and "`inputs` tokens + `max_new_tokens` must be <= 64" in r.json()["error"]
    for bad in ({"temperature": 0}, {"top_p": 1.5}, {"stop": ["a"] * 17}, {"max_new_tokens": "x"}):
        assert httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": bad}).status_code == 422, bad
    assert httpx.post(f"{url}/generate", content=b"{", headers={"content-type": "application/json"}).status_code == 422
    big = httpx.post(f"{url}/generate", content=b"x" * (2 << 20), headers={"content-type": "application/json"})
    assert big.status_code == 413


def test_openai_client(url, lm):
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == ["tiny"]
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    assert c.choices[0].text == alone(lm, PROMPT, 10) and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 10
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    messages = [{"role": "user", "content": "Hello"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    templated = lm[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert templated == "<user>Hello\n<assistant>"
    assert chat.choices[0].message.content == alone(lm, templated, 8, add_special_tokens=False)
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})
    # OpenAI's error body on /v1, naming the request's own fields
    assert r.status_code == 422 and "`prompt` tokens + `max_tokens` must be <=" in r.json()["error"]["message"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.code == "model_not_found" and "'gpt-4' does not exist" in e.value.message
    # null is "not given"; text parts are joined; stop sequences never reach the stream, not even in part
    same = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                                          max_tokens=8, temperature=0, n=None, stream=None, logprobs=None)
    assert same.choices[0].message.content == chat.choices[0].message.content
    full = c.choices[0].text
    for stop in (full[3:7], [full[5:6] + "@@", full[6:9]]):
        cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, stop=stop)
        first = min(full.find(x) for x in ([stop] if isinstance(stop, str) else stop) if x in full)
        assert cut.choices[0].text == full[:first] and cut.choices[0].finish_reason == "stop"
        chunks = [ch.choices[0].text for ch in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                                                         temperature=0, stop=stop, stream=True)]
        assert "".join(chunks) == full[:first], (stop, chunks)


def test_metrics(url):
    text = httpx.get(f"{url}/metrics").text
    for name in ("tgi_request_count", "tgi_request_success", "tgi_request_failure", "tgi_request_duration_bucket",
                 "tgi_request_generated_tokens_sum", "tgi_request_input_length_count", "tgi_queue_size",
                 "tgi_batch_current_size", 'tgi_batch_inference_duration_count{method="prefill"}',
                 'tgi_batch_inference_duration_count{method="decode"}', "hqtflow_preemptions 0.0"):
        assert name in text, name
    assert "_created" not in text  # TGI serves no creation-time series (prometheus_client's default adds them)
    before = float(next(l for l in text.splitlines() if l.startswith("tgi_request_count ")).split()[1])
    httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    after = httpx.get(f"{url}/metrics").text
    assert float(next(l for l in after.splitlines() if l.startswith("tgi_request_count ")).split()[1]) == before + 1
    # a request's input length is observed once, its prompt counted once, whatever its n
    ids = httpx.post(f"{url}/tokenize", json={"inputs": PROMPT}).json()
    httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "n": 3, "max_tokens": 2}).raise_for_status()
    last = metric_values(httpx.get(f"{url}/metrics").text)
    was = metric_values(after)
    assert last["tgi_request_input_length_count"] - was["tgi_request_input_length_count"] == 1
    assert last["tgi_request_input_length_sum"] - was["tgi_request_input_length_sum"] == len(ids)


def test_api_key_overload_and_disconnect(lm):
    app = create_app(*lm, ServeSettings(max_concurrent_requests=1, max_total_tokens=256, max_input_tokens=32, api_key="secret"))
    engine = app.state.engine
    engine.on_step = lambda *_: time.sleep(0.05)  # slow decode down (200 tokens >= 10 s) so the stream is still running
    auth = {"Authorization": "Bearer secret"}
    with running(app) as base:
        assert httpx.post(f"{base}/generate", json={"inputs": PROMPT}).status_code == 401
        assert httpx.post(f"{base}/generate", json={"inputs": PROMPT}, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200
        with httpx.stream("POST", f"{base}/generate_stream", headers=auth,
                          json={"inputs": PROMPT, "parameters": {"max_new_tokens": 200}}) as s:
            lines = s.iter_lines()  # keep a reference: a collected iterator closes the connection
            assert next(lines).startswith("data:")  # the request is running
            busy = httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, headers=auth)
            assert busy.status_code == 429 and busy.json()["error_type"] == "overloaded"
        t0 = time.monotonic()  # the disconnect cancels it: the slot frees up long before 200 tokens (10 s) are done
        while (engine.active or engine.pending) and time.monotonic() < t0 + 20:
            time.sleep(0.02)
        assert not engine.active and time.monotonic() - t0 < 5
        ok = httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, headers=auth)
        assert ok.status_code == 200
        # every generation request counted is a success or a failure of its kind: 2 x 401, the stream whose client
        # left (cancelled), the 429, the last one
        m = metric_values(httpx.get(f"{base}/metrics").text)
        assert m["tgi_request_count"] == 5 and m["tgi_request_success"] == 1, m
        assert (m['tgi_request_failure{err="authentication"}'], m['tgi_request_failure{err="cancelled"}'],
                m['tgi_request_failure{err="overloaded"}']) == (2, 1, 1), m


def test_overloaded_server_answers_429_before_tokenizing_or_compiling(lm, monkeypatch):
    """The place among --max-concurrent-requests is taken first (TGI's order): with none free, a request with a
    grammar (which may take seconds to compile) is a 429 at once, on every route, and nothing is compiled."""
    from hqtflow.runtime import openai_routes, tgi_routes

    compiled = []
    for module in (openai_routes, tgi_routes):
        monkeypatch.setattr(module, "compile_grammar", lambda *a, **k: compiled.append(a))
    app = create_app(*lm, ServeSettings(max_concurrent_requests=1, max_total_tokens=256, max_input_tokens=32))
    app.state.engine.on_step = lambda *_: time.sleep(0.05)  # the stream below still runs while the others are sent
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    busy = [("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": schema}}}),
            ("/generate_stream", {"inputs": PROMPT, "parameters": {"grammar": {"type": "regex", "value": "[ab]+"}}}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "response_format": {
                "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2})]
    with running(app) as base:
        with httpx.stream("POST", f"{base}/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 200}}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data:")
            for route, body in busy:
                r = httpx.post(f"{base}{route}", json=body)
                assert r.status_code == 429, (route, r.text)
                if route.startswith("/v1/"):  # OpenAI's rate-limit error, and TGI's error_type beside it
                    assert r.json() == {"error": {"message": "Model is overloaded", "type": "requests", "param": None,
                                                  "code": "rate_limit_exceeded"}, "error_type": "overloaded"}, r.text
        assert compiled == []
        t0 = time.monotonic()  # the stream's client left: its place comes back at the engine's next step
        while (r := httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})).status_code == 429:
            assert time.monotonic() - t0 < 20, "a place was never given back"
            time.sleep(0.1)
        assert r.status_code == 200, r.text


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_a_signal_ends_running_streams_within_the_shutdown_timeout(tiny_llama_long, sig):
    """`hqtflow serve --shutdown-timeout 3`, SIGTERM (or SIGHUP: a closed terminal) with a long stream running: the
    stream ends with an error event saying the server is shutting down (not a cut connection, nor minutes more of
    tokens), and the process exits 128 + the signal by the timeout (the interpreter's teardown took 1-3 s more)."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # SIGHUP reset to its default (not nohup's SIG_IGN, if run so), then exec (the same pid): not with preexec_fn, which
    # makes subprocess fork() this big test process, which the kernel can refuse (ENOMEM), where it otherwise uses vfork
    reset = "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
    p = subprocess.Popen([sys.executable, "-c", reset, sys.executable, "-m", "hqtflow", "serve", "bf16",
                          str(tiny_llama_long), "--port", str(port), "--max-total-tokens", "4096", "--max-input-tokens",
                          "32", "--shutdown-timeout", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base, t0 = f"http://127.0.0.1:{port}", time.monotonic()
        while True:
            assert p.poll() is None and time.monotonic() - t0 < 120, "the server did not start"
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4000}}
        with httpx.stream("POST", f"{base}/generate_stream", json=body, timeout=60) as s:
            events = []
            for line in s.iter_lines():
                if line.startswith("data:"):
                    events.append(json.loads(line[5:]))
                    if len(events) == 5:
                        p.send_signal(getattr(signal, sig))
                        t_term = time.monotonic()
                        time.sleep(0.2)
                        p.send_signal(getattr(signal, sig))  # a closed terminal may send two: still a drain
        assert "shutting down" in events[-1].get("error", ""), events[-1]
        assert time.monotonic() - t_term < 10
        assert p.wait(timeout=30) == 128 + getattr(signal, sig), p.stderr.read()[-2000:]
        assert time.monotonic() - t_term < 3 + 2.5  # the timeout, and a margin for a loaded machine (it was 6.3 s)
    finally:
        p.kill()


@pytest.mark.slow
def test_a_signal_during_warmup_ends_the_process(tiny_llama_long):
    """WARMUP_ENABLED=true, SIGTERM while /health is still 503: the warm-up stops and the process exits 128 + the
    signal at once (it used to close its port and then wait forever on the warm-up thread)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "hqtflow", "serve", "bf16", str(tiny_llama_long), "--port", str(port),
                          "--max-total-tokens", "4096", "--max-input-tokens", "4000",
                          "--pad-sequence-to-multiple-of", "2"],  # 2000 prefill lengths: minutes of warm-up
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "WARMUP_ENABLED": "true"})
    try:
        base, t0 = f"http://127.0.0.1:{port}", time.monotonic()
        while True:
            assert p.poll() is None and time.monotonic() - t0 < 120, "the server did not start"
            try:
                status = httpx.get(f"{base}/health").status_code
                break
            except httpx.TransportError:
                time.sleep(0.3)
        assert status == 503
        time.sleep(1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 128 + signal.SIGTERM, p.stderr.read()[-2000:]
    finally:
        p.kill()


def metric_values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


@pytest.mark.parametrize("route", ["/generate_stream", "/v1/chat/completions"])
def test_streams_racing_for_the_last_place_get_429_or_a_whole_stream(lm, route):
    """With --max-concurrent-requests 1, streams sent at once: one runs to its end, the others are a 429 before any
    200 (never a 200 whose only event is an `overloaded` error); then the place is free again."""
    import asyncio

    app = create_app(*lm, ServeSettings(max_concurrent_requests=1, max_total_tokens=256, max_input_tokens=32))
    app.state.engine.on_step = lambda *_: time.sleep(0.02)
    body = ({"inputs": PROMPT, "parameters": {"max_new_tokens": 8}} if route == "/generate_stream" else
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True})

    async def send(client):
        async with client.stream("POST", f"{base}{route}", json=body) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line.startswith("data:")]

    async def race():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[send(client) for _ in range(4)])

    with running(app) as base:
        results = asyncio.run(race())
        assert sorted(code for code, _ in results).count(429) >= 1, results
        for code, events in results:
            assert code == 429 or (code == 200 and "error" not in events[-2 if route != "/generate_stream" else -1]
                                   and ("[DONE]" in events[-1] or json.loads(events[-1][5:])["generated_text"] is not None)), results
        assert not any(code == 200 and any('"error"' in e for e in events) for code, events in results), results
        m = metric_values(httpx.get(f"{base}/metrics").text)
        assert m["tgi_request_success"] + m['tgi_request_failure{err="overloaded"}'] == 4, m
        again = httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
        assert again.status_code == 200


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_non_streaming_client_disconnect_leaves_the_batch(lm, route):
    app = create_app(*lm, ServeSettings(max_total_tokens=256, max_input_tokens=32))
    engine, running_counts = app.state.engine, []

    def slow(*_):  # 200 tokens take >= 10 s; record the running batch size at every step
        running_counts.append((time.monotonic(), len(engine.active)))
        time.sleep(0.05)

    engine.on_step = slow
    body = ({"inputs": PROMPT, "parameters": {"max_new_tokens": 200}} if route == "/generate" else
            {"model": "m", "prompt": PROMPT, "max_tokens": 200, "temperature": 0})
    with running(app) as base:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(f"{base}{route}", json=body, timeout=httpx.Timeout(5, read=1.5))
        deadline = time.monotonic() + 20  # a loaded machine may not have run its first step within the 1.5 s
        while not running_counts and time.monotonic() < deadline:
            time.sleep(0.02)
        assert max((n for _, n in running_counts), default=0) == 1  # it was running when the client left
        t0 = time.monotonic()
        while engine.active and time.monotonic() < t0 + 20:
            time.sleep(0.02)
        assert not engine.active and not engine.pending and time.monotonic() - t0 < 5
        assert len(running_counts) < 100  # far fewer steps than its 200 tokens
        metrics = httpx.get(f"{base}/metrics").text
        assert 'tgi_request_failure{err="cancelled"} 1.0' in metrics and "tgi_request_success 0.0" in metrics


def test_cli_serve_help():
    r = run_cli("serve", "--help")
    assert r.exit_code == 0 and "fp8" in r.stdout and "bf16" in r.stdout
    r = run_cli("serve", "fp8", "--help")  # the environment variables stay visible (not eaten as rich markup)
    assert r.exit_code == 0 and "MAX_BATCH_SIZE" in r.stdout and "HQTFLOW_API_KEY" in r.stdout


def test_engine_with_fp8_checkpoint(tiny_llama, wiki_text, tmp_path):
    from hqtflow.evaluate import load_any
    from hqtflow.hardware import fastest_dtype
    from hqtflow.quantize.fp8_linear import set_backend

    meas, ck = tmp_path / "m", tmp_path / "fp8"
    assert run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", meas, "-o", ck).exit_code == 0
    model, tok, kind = load_any(str(ck))
    assert kind == "fp8"
    eng = Engine(model, tok).start()
    try:
        events = eng.generate(tok(PROMPT)["input_ids"], SamplingParams(max_new_tokens=5))
    finally:
        eng.stop()
    assert events[-1].finish_reason in ("length", "eos_token") and len(events) <= 5
    # FP8 on the CPU kernel in the dtype `serve fp8` runs here (fp32 on a CPU without native bf16, else bf16): every
    # token's logprob is the same bit for bit alone and beside copies of itself and other requests (no batched
    # matmul anywhere: the FP8 layers and the bf16 lm_head on the kernel)
    served, tok, _ = load_any(str(ck), fastest_dtype())
    assert set_backend(served, "cpu") > 0
    jobs = [(tok(p)["input_ids"], SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in (PROMPT, "A river", "In 1990 the")]

    def run(batch):  # every request submitted before the first step, run to the end from this thread
        eng, out = Engine(served, tok), [[] for _ in batch]
        for job, events in zip(batch, out):
            eng.submit(*job, events.append)
        while eng.step():
            pass
        return [[(e.token.id, e.token.logprob) for e in events] for events in out]

    alone = [run([job])[0] for job in jobs]
    assert all(len(a) == 12 for a in alone)
    assert run(jobs + jobs) == alone + alone


def test_warmup_buckets_and_health(lm):
    app = create_app(*lm, ServeSettings(max_input_tokens=32, max_total_tokens=64, warmup=True, batch_bucket_size=4,
                                        pad_sequence_to_multiple_of=8))
    metrics_step = app.state.engine.on_step
    app.state.engine.on_step = lambda *a: (time.sleep(0.1), metrics_step(*a))  # warmup takes about a second
    with running(app) as base:
        assert httpx.get(f"{base}/health").status_code == 503
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text = httpx.get(f"{base}/metrics").text
        for seq in (8, 16, 24, 32):  # every bucketed prefill length ran once
            assert f'hqtflow_batch_shape_runs_total{{batch="1",method="prefill",seq="{seq}"}} 1.0' in text
        shapes = [line for line in text.splitlines() if "shape" in line]  # decode: 1 sequence, padded to 4 tokens
        assert 'hqtflow_batch_shape_runs_total{batch="1",method="decode",seq="4"}' in text, shapes
        assert "# TYPE hqtflow_batch_shape_runs_total counter" in text  # a count since start, not a gauge
        assert "tgi_batch_inference_duration_count" not in text and "tgi_batch_next_size_count 0.0" in text  # not warm-up's
        r = httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6}})
        assert r.json()["generated_text"] == alone(lm, PROMPT, 6)  # padding and dummy rows change nothing


def test_cli_serve_checks_kind(tiny_llama):
    r = run_cli("serve", "fp8", tiny_llama)
    assert r.exit_code == 4 and "not an FP8 checkpoint" in r.stderr and "hqtflow serve bf16" in r.stderr
    r = run_cli("serve", "bf16", tiny_llama, "--max-input-tokens", "10", "--max-total-tokens", "10")
    assert r.exit_code == 2 and "must be less than" in r.stderr
    r = run_cli("serve", "bf16", tiny_llama, "--cuda-graphs", "1,x")
    assert r.exit_code == 2 and "--cuda-graphs takes batch sizes like 1,2,4,8" in r.stderr
    r = run_cli("serve", "bf16", tiny_llama, "--cuda-graphs", "1,2", "--port", "1", "--device", "cpu")  # graphs on a CPU
    assert r.exit_code == 2 and "CUDA graphs (--cuda-graphs 1,2) need a CUDA GPU; this model runs on cpu (give " \
        "--cuda-graphs 0)" in r.stderr, r.stderr


def test_fp8_quantized_at_start_equals_checkpoint(tiny_llama, wiki_text, tmp_path):
    """`serve fp8 MODEL -m MEASUREMENT` quantizes in memory exactly like `hqtflow quantize` does on disk."""
    import hqtflow
    from hqtflow import models
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

    meas, ck = tmp_path / "m", tmp_path / "fp8"
    assert run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", meas, "-o", ck).exit_code == 0
    for dtype in ("bf16", "fp32"):  # the compute dtype (serve --dtype; auto: the fastest here) as loading gives it
        live, tok = quantize_in_memory(QuantizeSettings(measurement=str(meas), output="-"), dtype)
        saved, _ = hqtflow.load(ck, backend="qdq", dtype=dtype)  # quantize_in_memory returns reference modules
        ids = torch.tensor([tok.encode(PROMPT)])
        with torch.inference_mode():
            out = live(ids).logits
            assert out.dtype == models.torch_dtype(dtype) and torch.equal(out, saved(ids).logits)
    # artifacts are checked before the port is bound
    r = run_cli("serve", "fp8", tiny_llama, "-m", tmp_path / "nope", "--port", "1")
    assert r.exit_code == 3 and "does not exist" in r.stderr
    r = run_cli("serve", "bf16", tiny_llama, "-m", meas, "--port", "1")
    assert r.exit_code == 2 and "use it with `hqtflow serve fp8`" in r.stderr


def test_fp8_quantized_at_start_with_a_method(tiny_llama, wiki_text, tmp_path, monkeypatch):
    """`serve fp8 MODEL -m DIR --scale-method M` (or -c CONFIG) quantizes at start with that method; either
    without -m is refused."""
    from hqtflow.quantize.fp8_linear import FP8Linear
    from hqtflow.runtime import server

    meas = tmp_path / "m"
    assert run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "2").exit_code == 0
    served = {}
    monkeypatch.setattr(server, "_app", lambda model, tok, settings: served.update(model=model))
    monkeypatch.setattr(server, "_run", lambda app, sock: None)
    server._serve(None, str(tiny_llama), ServeSettings(), kind="fp8", measurement=str(meas), backend="auto",
                  dtype="auto", scale_method="fp8_dynamic")
    layers = [m for m in served["model"].modules() if isinstance(m, FP8Linear)]
    assert layers and {m.activation for m in layers} == {"dynamic_token"}
    cfg = tmp_path / "pow2.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "maxabs_pow2", "blocklist": {"names": ["lm_head"]}}))
    server._serve(None, str(tiny_llama), ServeSettings(), kind="fp8", measurement=str(meas), backend="auto",
                  dtype="auto", config=str(cfg))
    scales = [float(m.input_scale) for m in served["model"].modules() if isinstance(m, FP8Linear)]
    assert scales and all(torch.log2(torch.tensor(v)).frac() == 0 for v in scales)  # power-of-two scales
    for flag in (["-c", str(cfg)], ["--scale-method", "maxabs_pow2"]):
        r = run_cli("serve", "fp8", tiny_llama, *flag, "--port", "1")
        assert r.exit_code == 2 and "give its measurement with -m DIR" in r.stderr, r.stderr


def test_the_key_check_takes_the_scheme_in_any_case_and_a_401_says_bearer(lm):
    """The check compared the whole header with "Bearer KEY": `bearer KEY` (RFC 7235: the scheme is
    case-insensitive; TGI takes it) was a 401, and a 401 had no WWW-Authenticate. The openai client still reads it."""
    import openai

    app = create_app(*lm, ServeSettings(max_total_tokens=64, max_input_tokens=16, api_key="secret"))
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}
    with running(app) as base:
        for header in ("bearer secret", "BEARER secret", "Bearer  secret"):
            assert httpx.post(f"{base}/generate", json=body, headers={"Authorization": header}).status_code == 200, header
        for header in ("Bearer secre", "Bearer secrett", "Basic secret", "secret", ""):
            r = httpx.post(f"{base}/generate", json=body, headers={"Authorization": header})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (header, r.headers)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model="x", prompt="hi", max_tokens=1)
        assert e.value.status_code == 401 and "Invalid or missing API key" in str(e.value)


def test_served_model_name_is_the_name_clients_see(lm, monkeypatch):
    """TGI's --served-model-name (env SERVED_MODEL_NAME) was missing: /info, /v1/models and every /v1 answer sent
    the model as given to serve, an absolute checkpoint path."""
    from hqtflow.runtime import server

    app = create_app(*lm, ServeSettings(model_id="/srv/secret/ckpt", served_model_name="tiny", max_total_tokens=64,
                                        max_input_tokens=16))
    with running(app) as base:
        answers = [httpx.get(f"{base}/info"), httpx.get(f"{base}/v1/models"), httpx.get(f"{base}/v1/models/tiny"),
                   httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})]
        assert [r.status_code for r in answers] == [200] * 4
        assert answers[0].json()["model_id"] == "tiny" and answers[1].json()["data"][0]["id"] == "tiny"
        assert answers[3].json()["model"] == "tiny" and not any("/srv/secret" in r.text for r in answers)
    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, settings, **kw: seen.update(settings=settings))
    monkeypatch.setenv("SERVED_MODEL_NAME", "from-env")
    assert run_cli("serve", "fp8", "/srv/secret/ckpt").exit_code == 0 and seen["settings"].served_name == "from-env"


def test_request_histograms_are_observed_once_per_successful_request(lm):
    """TGI's request histograms (duration, validation, queue, inference, mean time per token, generated tokens) get
    one observation per successful request, with the tokens of the sequences it answers with (best_of's other
    sequence left out); a cancelled request is in none of them, only in input_length (observed at validation, as TGI)."""
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=32, max_total_tokens=64))
    engine = app.state.engine
    with running(app) as base:
        was = metric_values(httpx.get(f"{base}/metrics").text)
        best = httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 5, "best_of": 2, "do_sample": True, "details": True}})
        assert best.status_code == 200, best.text
        best = best.json()["details"]
        two = httpx.post(f"{base}/v1/completions", json={"prompt": [PROMPT, "Hello"], "max_tokens": 3}).json()
        assert httpx.post(f"{base}/generate", json={"inputs": ""}).status_code == 422
        step = engine._forward
        engine._forward = lambda plan: (time.sleep(0.5), step(plan))[1]
        with pytest.raises(httpx.TimeoutException):  # a client that leaves: its request is cancelled
            httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 20}}, timeout=0.3)
        deadline = time.monotonic() + 20
        while 'tgi_request_failure{err="cancelled"}' not in (now := metric_values(httpx.get(f"{base}/metrics").text)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        engine._forward = step
    grew = lambda name: now.get(name, 0) - was.get(name, 0)  # noqa: E731
    assert grew("tgi_request_success") == 2
    for name in ("duration", "validation_duration", "queue_duration", "inference_duration",
                 "mean_time_per_token_duration", "generated_tokens"):
        assert grew(f"tgi_request_{name}_count") == 2, name
    returned = best["generated_tokens"] + two["usage"]["completion_tokens"]
    assert best["best_of_sequences"] and grew("tgi_request_generated_tokens_sum") == returned
    assert grew("tgi_request_input_length_count") == 3  # the 2 answered and the cancelled one, validated


def test_health_is_503_when_the_engine_thread_has_died(lm):
    """/health is TGI's 503 ({"error": "unhealthy", "error_type": "healthcheck"}) once the engine's thread has
    failed (it reflected only the warm-up); the request it failed on, and any later one, end with the reason (they
    waited forever)."""
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=32, max_total_tokens=64))
    engine = app.state.engine
    with running(app) as base:
        assert httpx.get(f"{base}/health").status_code == 200

        def broken():
            raise RuntimeError("the engine failed")

        engine._admit = broken  # outside a step's error handling: the thread ends
        for reason in ("the engine has stopped (RuntimeError: the engine failed)", "the engine has stopped"):
            r = httpx.post(f"{base}/generate", json={"inputs": PROMPT}, timeout=30)  # the one it failed on, a later one
            assert r.status_code == 424 and r.json()["error"] == reason, r.text
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json() == {"error": "unhealthy", "error_type": "healthcheck"}, r.text


def test_refusals_and_cancellations_are_logged_and_probes_are_not(lm, caplog):
    """A 422's reason is one warning line (no prompt text), a non-streaming request its client left one line; uvicorn's
    access lines of GET /health and /metrics are dropped (QuietProbes), the others kept."""
    import logging

    from hqtflow.runtime.server import QuietProbes

    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=32, max_total_tokens=64))
    log = logging.getLogger("uvicorn.error")
    try:
        with running(app) as base:
            log.addHandler(caplog.handler)  # after uvicorn's logging config, which replaces its handlers
            log.setLevel(logging.INFO)  # as `hqtflow serve` runs uvicorn (the tests' is at warning)
            secret = "zebra " * 40
            assert httpx.post(f"{base}/generate", json={"inputs": secret}).status_code == 422
            step = app.state.engine._forward
            app.state.engine._forward = lambda plan: (time.sleep(0.5), step(plan))[1]
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{base}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 20}}, timeout=0.3)
            deadline = time.monotonic() + 20
            while not any("cancelled" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            app.state.engine._forward = step
    finally:
        log.removeHandler(caplog.handler)
    refused = [r for r in caplog.records if "422" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING and "must have less than 32 tokens" in refused[0].getMessage()
    assert "zebra" not in caplog.text
    access = lambda method, path: logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',  # noqa: E731
                                                    ("127.0.0.1:1", method, path, "1.1", 200), None)
    quiet = QuietProbes()
    assert not quiet.filter(access("GET", "/health")) and not quiet.filter(access("GET", "/metrics"))
    assert quiet.filter(access("POST", "/generate"))


def test_info_reports_the_torch_dtype_and_fp8_as_quantize(url, tiny_kv, monkeypatch):
    """/info's model_dtype was "fp8" (or "bf16") where TGI reports the torch dtype the model computes in
    ("torch.float16"); it is that dtype now, and an FP8 model says so in `quantize` (TGI's --quantize value).
    (huggingface_hub's InferenceClient.get_endpoint_info returns this JSON as it is.)"""
    from hqtflow.runtime import server

    info = httpx.get(f"{url}/info").json()
    assert info["model_dtype"] == "torch.float32" and info["quantize"] is None  # the fp32 tiny model
    served = {}
    monkeypatch.setattr(server, "_app", lambda *a: served.update(app=server.create_app(*a)))
    monkeypatch.setattr(server, "_run", lambda app, sock: None)
    server._serve(None, str(tiny_kv[1]), ServeSettings(max_total_tokens=64, max_input_tokens=16), kind="fp8",
                  measurement=None, backend="auto", dtype="bf16")
    with running(served["app"]) as base:
        info = httpx.get(f"{base}/info").json()
    assert info["model_dtype"] == "torch.bfloat16" and info["quantize"] == "fp8"
