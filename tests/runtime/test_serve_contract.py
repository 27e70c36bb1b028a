"""The HTTP contract at its edges (stop 48's probes: schemathesis, hand-made hostile requests): what /openapi.json
publishes is what the routes accept and answer, and edge inputs are 4xx or right, never a 500."""

import json
import re

import httpx
import pytest

from conftest import need, running
from hqtflow.runtime.server import ServeSettings, create_app

BODY_ROUTES = ("/", "/generate", "/generate_stream", "/tokenize", "/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def url(lm):
    # TGI's --max-client-batch-size: schemathesis sends a batch of the most prompts published (64 by default: 10 min)
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96, max_batch_size=8,
                                        max_client_batch_size=4))
    with running(app) as base:
        yield base


@pytest.fixture(scope="module")
def spec(url):
    return httpx.get(f"{url}/openapi.json").json()


def post(url, path, body):
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_one_token_prompt_is_scored_like_longer_ones(url, lm):
    """A one-token prompt has one prefill entry (logprob null), as TGI; echo + logprobs lists it (it was a 500, and
    a list without the prompt token whose offsets pointed into the prompt)."""
    tok = lm[1]
    word = next(w for w in ("hi", "The", "a") if len(tok(w, add_special_tokens=False)["input_ids"]) == 1)
    [tid] = tok(word, add_special_tokens=False)["input_ids"]
    for path in ("/generate", "/"):
        r = post(url, path, {"inputs": word, "parameters": {"max_new_tokens": 1, "details": True, "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        out = r.json()[0] if path == "/" else r.json()
        assert out["details"]["prefill"] == [{"id": tid, "text": word, "logprob": None}]
    r = post(url, "/generate", {"inputs": f"{word} {word} {word}", "parameters": {
        "max_new_tokens": 1, "truncate": 1, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200 and len(r.json()["details"]["prefill"]) == 1, r.text
    for max_tokens in (2, 0):
        r = post(url, "/v1/completions", {"prompt": [tid], "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0})
        c = r.json()["choices"][0]
        lp = c["logprobs"]
        assert lp["tokens"][0] == word and lp["token_logprobs"][0] is None and lp["text_offset"][0] == 0
        assert "".join(lp["tokens"]) == c["text"] and len(lp["tokens"]) == 1 + max_tokens
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_edge_values_are_named_422s(url):
    huge_key = "1" * 4301  # passes isdigit(); int() refuses it (Python's 4300-digit limit): was a 500
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        r = post(url, path, {**body, "logit_bias": {huge_key: 1}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "logit_bias", r.text
    deep = "[" * 5000 + "]" * 5000  # a JSON string nested past Python's stack: a RecursionError (500) before
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1, "grammar": {"type": "json", "value": deep}}})
    assert r.status_code == 422 and "grammar" in r.json()["error"], r.text
    schema = {"type": "integer"}
    for _ in range(70):  # 71 levels: compiling such a schema takes seconds from ~300 levels (a cheap CPU burn)
        schema = {"type": "array", "items": schema}
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1, "grammar": {"type": "json", "value": schema}}})
    assert r.status_code == 422 and "nests deeper than 64 levels" in r.json()["error"], r.text
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1, "grammar": {
        "type": "json_schema", "value": {"name": "n", "schema": {"type": "object"}, "extra": 1}}}})
    assert r.status_code == 422 and "`parameters.grammar.value.extra` is not a supported parameter" in r.json()["error"], r.text
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1,
                                           "max_tokens": 200})
    assert r.status_code == 422 and "200 `max_tokens`" in r.json()["error"]["message"], r.text  # both given: each must fit
    r = post(url, "/tokenize", {"inputs": "x", "parameters": {"stop": [""]}})
    assert r.status_code == 422 and "`stop` sequences cannot be empty" in r.json()["error"], r.text
    r = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 1, "stop": ["a", "b" * 1001]})
    assert r.status_code == 422 and "at most 1000 characters. Given: 1001" in r.json()["error"]["message"], r.text
    wide = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(600)}}  # ~6 s to compile
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1, "grammar": {"type": "json", "value": wide}}})
    assert r.status_code == 422 and "more than 512 subschemas" in r.json()["error"], r.text
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": list(range(1001))}}}})
    assert r.status_code == 422 and "more than 1000 `enum` values" in r.json()["error"]["message"], r.text
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1.0, "seed": 7.0}})  # JSON Schema's integers
    assert r.status_code == 200, r.text
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1.5}})
    assert r.status_code == 422, r.text


def test_a_huge_repetition_penalty_leaves_the_logits_finite():
    """1.7e308 overflowed negative logits to -inf: where a grammar allowed only seen tokens, none was left (a 424
    seen by schemathesis). They now stay the lowest finite value, so the order among them holds."""
    import torch

    from hqtflow.runtime.engine import Engine, Request, SamplingParams

    req = Request([0, 1, 2], SamplingParams(repetition_penalty=1.7e308), emit=lambda ev: None)
    x = Engine._process(None, req, torch.tensor([-3.0, -1.0, 2.0, 5.0]))
    assert torch.isfinite(x).all() and x[3] == 5.0 and x[2] >= 0 and x[0] == x[1] == torch.finfo(torch.float32).min
    # a tiny one (TGI takes any penalty > 0) overflowed positive logits to inf: NaN logprobs, a 500 on /generate
    req = Request([0, 1, 2], SamplingParams(repetition_penalty=1e-40), emit=lambda ev: None)
    x = Engine._process(None, req, torch.tensor([-3.0, 1.0, 2.0, 5.0]))
    assert torch.isfinite(x).all() and x[1] == x[2] == torch.finfo(torch.float32).max and x[3] == 5.0
    assert torch.isfinite(torch.log_softmax(x, -1)[1:3]).all()


def test_routing_answers_before_the_body_checks(url):
    """A POST to a GET route is a 405 with Allow, an unknown path a 404, whatever the Content-Type (it was a 415);
    a query parameter on a body route is a 422 naming it (it was ignored)."""
    for path in ("/health", "/info", "/metrics", "/v1/models"):
        r = httpx.post(f"{url}{path}", content=b"x")
        assert r.status_code == 405 and "GET" in r.headers["allow"], (path, r.status_code, r.text)
    assert httpx.post(f"{url}/no-such-route", content=b"x").status_code == 404
    r = httpx.post(f"{url}/v1/completions?stream=true&bogus=1", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 422 and "`stream`, `bogus`" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/generate?max_new_tokens=1", json={"inputs": "hi"})
    assert r.status_code == 422 and "`max_new_tokens`" in r.json()["error"], r.text


def test_openapi_describes_the_routes(spec):
    paths = spec["paths"]
    for path in BODY_ROUTES:
        op = paths[path]["post"]
        assert op["requestBody"]["required"], path
        assert {"200", "413", "415", "422", "429"} <= set(op["responses"]), path
        assert "HTTPValidationError" not in json.dumps(op)  # FastAPI's default 422 body: the server never sends it
    assert set(paths["/generate_stream"]["post"]["responses"]["200"]["content"]) == {"text/event-stream"}
    assert set(paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert "404" in paths["/v1/models/{model}"]["get"]["responses"]
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids)), ids
    params = spec["components"]["schemas"]["TgiParameters"]["properties"]
    assert params["truncate"]["maximum"] == 48 and params["max_new_tokens"]["maximum"] == 95


# (the schema component, the field, a request it goes into): every published bound is the validator's own
BOUNDED = [("TgiParameters", "/generate", lambda p: {"inputs": "x", "parameters": p}, {"do_sample": True, "max_new_tokens": 1}),
           ("CompletionRequest", "/v1/completions", lambda p: {"prompt": "x", "max_tokens": 1, **p}, {}),
           ("ChatRequest", "/v1/chat/completions",
            lambda p: {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **p}, {"logprobs": True})]


def test_published_bounds_are_the_validators(url, spec):
    """For every number bound /openapi.json publishes, the value at the bound is accepted and one step past it is
    refused by name: the published schema and the validators (with TGI's and OpenAI's messages) agree."""
    checked = 0
    for name, path, body, context in BOUNDED:
        for field, prop in spec["components"]["schemas"][name]["properties"].items():
            integer = "integer" in json.dumps(prop)
            step = 1 if integer else 0.01
            cases = []
            if "minimum" in prop:
                cases += [(prop["minimum"], True), (prop["minimum"] - step, False)]
            if "exclusiveMinimum" in prop:
                cases += [(prop["exclusiveMinimum"] + step, True), (prop["exclusiveMinimum"], False)]
            if "maximum" in prop:
                cases += [(prop["maximum"], True), (prop["maximum"] + step, False)]
            if "exclusiveMaximum" in prop:
                cases += [(prop["exclusiveMaximum"] - step, True), (prop["exclusiveMaximum"], False)]
            for value, ok in cases:
                given = {**context, field: value}
                if field == "best_of" and name == "CompletionRequest":
                    given["n"] = min(value, 1) if value >= 1 else 1
                if field == "max_new_tokens" and ok and value > 1:
                    continue  # with the prompt's tokens it would pass max_total_tokens: checked after tokenizing
                if field in ("max_tokens", "max_completion_tokens") and ok and value > 1:
                    continue
                r = post(url, path, body(given))
                assert (r.status_code == 200) == ok, (name, field, value, r.status_code, r.text)
                if not ok:
                    assert f"`{field}" in r.text or f"`parameters.{field}" in r.text, (field, r.text)
                checked += 1
    assert checked >= 40, checked


def test_top_p_and_typical_p_of_one_are_refused_as_tgi_refuses_them(url, spec):
    """TGI's routes refuse top_p and typical_p outside (0, 1), 1.0 included, in TGI's words (1.0 was accepted);
    OpenAI's routes take top_p up to 1 inclusive, as OpenAI."""
    for field in ("top_p", "typical_p"):
        r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1, field: 1.0}})
        assert r.status_code == 422 and f"`{field}` must be > 0.0 and < 1.0" in r.json()["error"], r.text
        assert spec["components"]["schemas"]["TgiParameters"]["properties"][field]["exclusiveMaximum"] == 1.0
    r = post(url, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1, "top_p": 0.99, "typical_p": 0.99}})
    assert r.status_code == 200, r.text
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        assert post(url, path, {**body, "max_tokens": 1, "top_p": 1.0}).status_code == 200


@pytest.mark.slow
def test_schemathesis_finds_the_server_as_published(url, tmp_path):
    """schemathesis (generated requests from /openapi.json, valid and invalid) against the live server: no 500,
    every status, content type, header and body as published, schema-violating requests refused. Its phases: the
    schema's examples, fuzzing (valid and invalid requests) and stateful; left out, its coverage phase, a sweep of
    every keyword's boundary values (most of this test's minutes; the hand-made edge requests in this file probe the
    boundaries that matter). Left out too: its check that every schema-valid request is accepted, since what no
    schema can say is checked after tokenizing (a prompt's length in tokens, whether a regex or JSON schema compiles,
    the sequences a batched prompt starts)."""
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).with_name("schemathesis")
    need(cli.exists(), "schemathesis is not installed (the test extra in pyproject.toml)")
    r = subprocess.run([str(cli), "run", f"{url}/openapi.json", "--max-examples", "5", "--seed", "1", "--workers", "1",
                        "--phases", "examples,fuzzing,stateful",
                        "--request-timeout", "60", "--exclude-checks", "positive_data_acceptance", "--output-sanitize",
                        "false", "--no-color"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert re.search(r"(\d+) generated, \1 passed", r.stdout), r.stdout[-2000:]


def test_stop_hold_back_is_the_longest_end_that_begins_a_stop():
    """What a stream holds back (the end of the text that may begin a stop sequence), fed token by token, equals its
    definition, the longest n with text.endswith(stop[:n]), at every token, on random texts, tokens and stops over a
    two-letter alphabet (overlapping prefixes)."""
    import random

    from hqtflow.runtime.openai_stream import HeldBack

    rng = random.Random(0)
    word = lambda lo, hi: "".join(rng.choice("ab") for _ in range(rng.randint(lo, hi)))  # noqa: E731
    for _ in range(5000):
        stops, hold, text = [word(1, 6) for _ in range(rng.randint(1, 3))], None, ""
        hold = HeldBack(stops)
        for _ in range(rng.randint(1, 6)):
            new = word(0, 3)
            text += new
            want = max((n for s in stops for n in range(min(len(s), len(text)), 0, -1) if text.endswith(s[:n])), default=0)
            assert hold.feed(new) == want, (text, stops)


def test_token_ids_past_the_model_are_named_422s(lm):
    """A tokenizer with tokens the model has no rows for (added without resizing the embeddings): prompt token ids
    and `logit_bias` keys are bounded by the least of the tokenizer, the embedding and the logits (past them, CUDA
    asserts on the device and the whole server is broken), not by the tokenizer alone."""
    import copy

    model, tok = lm
    tok = copy.deepcopy(tok)
    rows = model.get_input_embeddings().num_embeddings
    tok.add_tokens([f"<extra{i}>" for i in range(len(tok) + 3 - rows)])
    assert len(tok) > rows
    with running(create_app(model, tok, ServeSettings(max_input_tokens=32, max_total_tokens=64))) as base:
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [1, rows], "max_tokens": 1})
        assert r.status_code == 422 and f"must be in [0, {rows})" in r.json()["error"]["message"], r.text
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": {str(rows): 1}})
        assert r.status_code == 422 and f"must be < {rows}" in r.json()["error"]["message"], r.text
        assert httpx.post(f"{base}/v1/completions", json={"prompt": [1, rows - 1], "max_tokens": 1}).status_code == 200


def test_a_chat_template_that_renders_nothing_is_named(lm):
    """A chat template that renders no text (empty, or dropping every message) is a 422 that says so, not
    "`messages` cannot be empty" about messages that were not empty; streamed too."""
    import copy

    model, tok = lm
    body = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    for template in ("", "{% for m in messages %}{% endfor %}"):
        t = copy.deepcopy(tok)
        t.chat_template = template
        with running(create_app(model, t, ServeSettings(max_input_tokens=32, max_total_tokens=64))) as base:
            for stream in (False, True):
                r = post(base, "/v1/chat/completions", {**body, "stream": stream})
                assert r.status_code == 422 and "chat template rendered no text" in r.json()["error"]["message"], r.text


def test_max_best_of_and_max_top_n_tokens_bound_each_route(lm):
    """--max-best-of bounds TGI's best_of and OpenAI's n and best_of, --max-top-n-tokens TGI's top_n_tokens: a
    request over them is a 422 naming the field (TGI's wording), /info and /openapi.json say this server's values."""
    s = ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96, max_best_of=1, max_top_n_tokens=2)
    with running(create_app(*lm, s)) as base:
        for path, body, field in (
                ("/generate", {"inputs": "a", "parameters": {"best_of": 2, "do_sample": True}}, "best_of"),
                ("/generate", {"inputs": "a", "parameters": {"top_n_tokens": 3}}, "top_n_tokens"),
                ("/v1/completions", {"prompt": "a", "n": 2, "max_tokens": 1}, "n"),
                ("/v1/completions", {"prompt": "a", "best_of": 2, "max_tokens": 1}, "best_of"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 2, "max_tokens": 1}, "n")):
            r = post(base, path, body)
            assert r.status_code == 422 and f"`{field}` must be" in r.text, (path, body, r.text)
        assert post(base, "/generate", {"inputs": "a", "parameters": {"top_n_tokens": 2, "max_new_tokens": 1}}).status_code == 200
        info = httpx.get(f"{base}/info").json()
        assert (info["max_best_of"], info["max_top_n_tokens"]) == (1, 2)
        schemas = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]
        assert json.dumps(schemas["TgiParameters"]["properties"]["top_n_tokens"]).count('"maximum": 2') == 1
        assert json.dumps(schemas["ChatRequest"]["properties"]["n"]).count('"maximum": 1') == 1


def test_error_words_and_types_as_tgi_and_openai_give_them(url):
    """The stop-sequence limit in TGI's exact words; on /v1, a failed generation (424) is OpenAI's `server_error`."""
    from hqtflow.runtime.schemas import openai_error

    r = post(url, "/generate", {"inputs": "a", "parameters": {"stop": ["x"] * 17}})
    assert r.status_code == 422 and r.json()["error"] == "Input validation error: `stop` supports up to 16 stop sequences. Given: 17"
    assert openai_error("it broke", "generation", 424) == {
        "error": {"message": "it broke", "type": "server_error", "param": None, "code": "generation"}, "error_type": "generation"}


def test_payload_limit_bounds_a_body_as_tgis(lm, url):
    """--payload-limit (TGI's; default 2000000 bytes, TGI's, where 1 MiB was fixed) bounds a body: a 413 above it,
    with or without a content-length; /openapi.json says it."""
    big = {"inputs": "a", "parameters": {"max_new_tokens": 1}, "padding": "x" * 1_500_000}
    r = post(url, "/generate", big)  # read and parsed: the unknown field is named
    assert r.status_code == 422 and "`padding` is not a supported parameter" in r.text, r.text[:200]
    s = ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96, payload_limit=1000)
    with running(create_app(*lm, s)) as base:
        body = json.dumps({"inputs": "a" * 1000}).encode()
        for headers in ({}, {"transfer-encoding": "chunked"}):
            content = body if not headers else iter([body[:500], body[500:]])
            r = httpx.post(f"{base}/tokenize", content=content, headers={"content-type": "application/json", **headers})
            assert r.status_code == 413 and r.json()["error"] == "Request body larger than 1000 bytes (--payload-limit)", r.text
        assert post(base, "/tokenize", {"inputs": "a" * 900}).status_code == 200
        spec = httpx.get(f"{base}/openapi.json").json()
        assert spec["paths"]["/generate"]["post"]["responses"]["413"]["description"] == "a body over 1000 bytes (--payload-limit)"


def test_a_refusal_quotes_the_limit_in_force(lm):
    """best_of, n and top_n_tokens out of range, past the schema's widest bound or below the least, are refused
    quoting this server's --max-best-of / --max-top-n-tokens (TGI's words), not the schema's 4 and 5."""
    s = ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96, max_best_of=2, max_top_n_tokens=2)
    chat = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    with running(create_app(*lm, s)) as base:
        for path, body, message in (
                ("/generate", {"inputs": "a", "parameters": {"best_of": 9, "do_sample": True}}, "`best_of` must be > 0 and <= 2. Given: 9"),
                ("/generate", {"inputs": "a", "parameters": {"best_of": 0}}, "`best_of` must be > 0 and <= 2. Given: 0"),
                ("/", {"inputs": "a", "parameters": {"top_n_tokens": 9}}, "`top_n_tokens` must be >= 0 and <= 2. Given: 9"),
                ("/tokenize", {"inputs": "a", "parameters": {"top_n_tokens": -1}}, "`top_n_tokens` must be >= 0 and <= 2. Given: -1"),
                ("/v1/completions", {"prompt": "a", "n": 9}, "`n` must be >= 1 and <= 2. Given: 9"),
                ("/v1/completions", {"prompt": "a", "best_of": 0}, "`best_of` must be >= 1 and <= 2. Given: 0"),
                ("/v1/completions", {"prompt": "a", "n": 2, "best_of": 1}, "`best_of` must be >= `n` and <= 2. Given: 1"),
                ("/v1/chat/completions", {**chat, "n": 0}, "`n` must be >= 1 and <= 2. Given: 0")):
            r = post(base, path, body)
            error = r.json()["error"]
            assert r.status_code == 422 and (error if isinstance(error, str) else error["message"]) \
                == f"Input validation error: {message}", (path, body, r.text)


def test_max_client_batch_size_bounds_a_completions_batch(lm, url):
    """--max-client-batch-size (TGI's) bounds the prompts of a /v1/completions request, in TGI's words, and its
    sequences (prompts x n); /info and /openapi.json say it. Its default, 64, lets lm-eval send its batches."""
    assert ServeSettings().max_client_batch_size == 64 and httpx.get(f"{url}/info").json()["max_client_batch_size"] == 4
    s = ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96, max_client_batch_size=3)
    with running(create_app(*lm, s)) as base:
        for prompt in (["a"] * 4, [[5]] * 4):
            r = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["message"] == "Number of prompts exceeds the maximum allowed batch size of 3"
        for prompt, choices in ((["a"] * 3, 3), ([5] * 10, 1)):  # three prompts; one prompt of ten token ids
            r = post(base, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200 and len(r.json()["choices"]) == choices, r.text
        r = post(base, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1, "temperature": 1})
        assert r.status_code == 422 and "must be <= 3 sequences (--max-client-batch-size). Given: 2 x 2" in r.text, r.text
        assert httpx.get(f"{base}/info").json()["max_client_batch_size"] == 3
        prompt = httpx.get(f"{base}/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
        assert [branch.get("maxItems") for branch in prompt["anyOf"]] == [None, 3, None, 3]


def test_duplicate_fields_head_requests_and_the_seed_bound(url):
    """A field given twice is a 422 naming it (TGI's serde refuses; the parser would keep the last silently); every
    GET route answers HEAD (TGI's axum does: uptime probes send it) without a body; the seed's bound is u64's, exact."""
    for path, raw, field in (("/generate", '{"inputs":"a","parameters":{"max_new_tokens":2},"parameters":{"max_new_tokens":3}}', "parameters"),
                             ("/v1/completions", '{"prompt":"a","max_tokens":1,"n":1,"max_tokens":2}', "max_tokens"),
                             ("/generate", '{"inputs":"a","parameters":{"max_new_tokens":1,"stop":["x"],"max_new_tokens":2}}', "max_new_tokens")):
        r = httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 422 and f"duplicate field `{field}`" in r.text, (path, r.text)
    for path in ("/health", "/info", "/metrics", "/v1/models", "/v1/models/tiny"):
        got, head = httpx.get(f"{url}{path}"), httpx.head(f"{url}{path}")
        assert head.status_code == got.status_code == 200 and head.content == b"", path
        assert head.headers.get("content-type") == got.headers.get("content-type"), path
    r = post(url, "/generate", {"inputs": "a", "parameters": {"seed": 2**64, "do_sample": True}})
    assert r.status_code == 422 and "Input should be >= 0 and <= 18446744073709551615 (a u64)" in r.text, r.text


def test_generate_sends_tgis_timing_headers(url):
    """/generate and POST / answer with TGI's headers: times in ms (x-compute-time in s), prompt and generated
    token counts as the details count them (clients and load tests read them)."""
    for path in ("/generate", "/"):
        r = post(url, path, {"inputs": "The river", "parameters": {"max_new_tokens": 3, "details": True}})
        assert r.status_code == 200, r.text
        body = r.json()[0] if path == "/" else r.json()
        h = r.headers
        assert int(h["x-generated-tokens"]) == body["details"]["generated_tokens"]
        assert int(h["x-prompt-tokens"]) == len(httpx.post(f"{url}/tokenize", json={"inputs": "The river"}).json())
        parts = [int(h[f"x-{k}-time"]) for k in ("validation", "queue", "inference")]
        assert min(parts) >= 0 and sum(parts) <= int(h["x-total-time"]) + 2 and float(h["x-compute-time"]) >= 0
        assert int(h["x-time-per-token"]) <= int(h["x-inference-time"]) and h["x-compute-type"] == "cpu"
        assert int(h["x-compute-characters"]) == len("The river")


def test_streams_send_tgis_headers(url):
    """Every SSE answer has TGI's `X-Accel-Buffering: no` (nginx passes events on at once); TGI's streams add
    x-compute-type and x-compute-characters."""
    body = {"inputs": "The river", "parameters": {"max_new_tokens": 2}}
    v1 = {"model": "tiny", "max_tokens": 2, "stream": True}
    for path, payload in [("/generate_stream", body), ("/", {**body, "stream": True}),
                          ("/v1/completions", {**v1, "prompt": "The river"}),
                          ("/v1/chat/completions", {**v1, "messages": [{"role": "user", "content": "Hi"}]})]:
        with httpx.stream("POST", f"{url}{path}", json=payload, timeout=30) as r:
            h = r.headers
            assert r.status_code == 200 and h["x-accel-buffering"] == "no" and h["x-compute-type"] == "cpu", (path, h)
            if not path.startswith("/v1/"):
                assert int(h["x-compute-characters"]) == len("The river"), h


def _page_urls(html: str) -> list[str]:
    """Every script, stylesheet, icon and link URL a page loads or points to, and the OpenAPI URL Swagger UI fetches."""
    return re.findall(r'(?:src|href|spec-url)="([^"]*)"', html) + re.findall(r"""url:\s*['"]([^'"]+)['"]""", html)


def test_docs_pages_need_no_network(url):
    """/docs (Swagger UI) and /redoc load their scripts and styles from this server (the `docs` extra's
    fastapi-offline copy), not from a CDN: offline they were a blank page. Each asset is served."""
    import importlib.util

    need(importlib.util.find_spec("fastapi_offline") is not None, "fastapi-offline (the docs extra) is not installed")
    for page in ("/docs", "/redoc"):
        r = httpx.get(f"{url}{page}")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), (page, r.status_code)
        urls = _page_urls(r.text)
        assert urls and not [u for u in urls if re.match(r"(https?:)?//", u)], (page, urls)
        assert "/openapi.json" in urls, (page, urls)
        for u in urls:
            assert httpx.get(f"{url}{u}").status_code == 200, (page, u)


def test_docs_page_without_the_docs_extra_says_what_to_install(lm, monkeypatch):
    """Without fastapi-offline, /docs is a page that loads nothing from the network: it links /openapi.json and names
    the extra that serves Swagger UI offline (FastAPI's own page would stay blank offline); /redoc is not served."""
    import sys

    from fastapi.testclient import TestClient

    monkeypatch.setitem(sys.modules, "fastapi_offline", None)  # import fails as if not installed
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96))
    client = TestClient(app)  # no lifespan: the engine never starts
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert _page_urls(r.text) == ["/openapi.json"] and "hqtflow[docs]" in r.text
    assert client.get("/redoc").status_code == 404
