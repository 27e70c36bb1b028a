"""`hqtflow serve` driven by the official clients (text_generation, huggingface_hub, openai) and by lm-eval's
local-completions, on a real uvicorn server over a tiny Llama; plus TGI's error contract on every status."""

import json
import re

import httpx
import pytest
import torch

from conftest import client_lib, running
from hqtflow.runtime.engine import Engine, SamplingParams
from hqtflow.runtime.server import ServeSettings, create_app

PROMPT = "The tower is"
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def url(lm):
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=48, max_total_tokens=96, max_batch_size=8))
    with running(app) as base:
        yield base


def alone(lm, ids, n):
    model, tok = lm
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def prompt_logprobs(lm, ids):
    with torch.inference_mode():
        lp = torch.log_softmax(lm[0](torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[i, t]) for i, t in enumerate(ids[1:])], lp


def test_text_generation_client(url, lm):
    tg = client_lib("text_generation")
    tok = lm[1]
    ids = tok(PROMPT)["input_ids"]
    ref = alone(lm, ids, 8)
    c = tg.Client(url, timeout=60)
    r = c.generate(PROMPT, max_new_tokens=8, decoder_input_details=True, top_n_tokens=3)
    assert [t.id for t in r.details.tokens] == ref and r.generated_text == tok.decode(ref, skip_special_tokens=True)
    want, _ = prompt_logprobs(lm, ids)
    prefill = r.details.prefill
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    assert [t.logprob for t in prefill[1:]] == pytest.approx(want, abs=1e-4)
    assert len(r.details.top_tokens) == 8 and all(len(top) == 3 for top in r.details.top_tokens)
    for chosen, top in zip(r.details.tokens, r.details.top_tokens):  # greedy: the chosen token is the top one
        assert top[0].id == chosen.id and top[0].logprob == pytest.approx(chosen.logprob)
    best = c.generate(PROMPT, max_new_tokens=6, best_of=3, do_sample=True, temperature=1.5)
    others = best.details.best_of_sequences
    assert len(others) == 2
    mean = sum(t.logprob for t in best.details.tokens) / len(best.details.tokens)
    assert all(mean >= sum(t.logprob for t in o.tokens) / len(o.tokens) for o in others)
    short = c.generate(PROMPT + " " + PROMPT, max_new_tokens=2, truncate=3, decoder_input_details=True)
    assert [t.id for t in short.details.prefill] == tok(PROMPT + " " + PROMPT)["input_ids"][-3:]
    streamed = list(c.generate_stream(PROMPT, max_new_tokens=8, top_n_tokens=2))
    assert [e.token.id for e in streamed] == ref and all(len(e.top_tokens) == 2 for e in streamed)
    assert streamed[-1].generated_text == r.generated_text and streamed[-1].details.finish_reason == "length"
    with pytest.raises(tg.errors.ValidationError, match="best_of"):
        c.generate(PROMPT, max_new_tokens=2, best_of=9, do_sample=True)
    # TGI's regex grammar through xgrammar: exactly three digits, then the grammar ends the sequence
    g = c.generate(PROMPT, max_new_tokens=10, grammar={"type": "regex", "value": "[0-9]{3}"})
    assert re.fullmatch("[0-9]{3}", g.generated_text) and g.details.finish_reason == "eos_token"
    schema = {"name": "answer", "schema": {"enum": ["yes", "no"]}}  # TGI 3's json_schema grammar
    r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 10, "grammar": {"type": "json_schema", "value": schema}}}).json()
    assert json.loads(r["generated_text"]) in ("yes", "no")


def test_tiny_temperature_samples_the_greedy_tokens(url, lm):
    """A temperature so small that logits / temperature overflows float32 is the greedy limit, not a 424 (the
    probabilities were NaN, which failed every request of the engine step)."""
    tg = client_lib("text_generation")
    ref = alone(lm, lm[1](PROMPT)["input_ids"], 4)
    c = tg.Client(url, timeout=60)
    for extra in ({}, {"repetition_penalty": 1e-300}):  # a tiny penalty turns the prompt's positive logits into inf
        for t in (1e-40, 1e-320):  # 1e-320 is 0 in float32 (0 / 0 for the largest logit)
            r = c.generate(PROMPT, max_new_tokens=4, do_sample=True, temperature=t, seed=1, **extra)
            assert r.details.finish_reason == "length" and len(r.details.tokens) == 4
            if not extra:
                assert [t.id for t in r.details.tokens] == ref


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN and Infinity (which Python's json writes and reads) are refused."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_tiny_repetition_penalty_answers_finite_json(url, monkeypatch):
    """TGI takes any repetition_penalty > 0: 1e-40 turned the prompt's positive logits into inf, so greedy logprobs
    were NaN: a 500 on /generate (counted as a success too) and `NaN` in /generate_stream's events, which no JSON
    parser reads. Every answer is strict JSON, and the request counts are whole."""
    from tests.runtime.test_serve import metric_values

    hub = client_lib("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # the tests run offline; the server is on loopback
    body = {"inputs": "Hello Hello Hello", "parameters": {"max_new_tokens": 3, "repetition_penalty": 1e-40,
                                                           "details": True, "top_n_tokens": 2}}
    r = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokens = strict_json(r.text)["details"]["tokens"]
    assert len(tokens) == 3 and all(t["logprob"] is not None and t["logprob"] <= 0 for t in tokens)
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as stream:
        events = [strict_json(line[5:]) for line in stream.iter_lines() if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == [t["id"] for t in tokens]
    out = hub.InferenceClient(url, timeout=60).text_generation("Hello Hello Hello", max_new_tokens=3, details=True,
                                                                repetition_penalty=1e-40)
    assert [t.id for t in out.details.tokens] == [t["id"] for t in tokens]
    m = metric_values(httpx.get(f"{url}/metrics").text)
    failures = sum(v for k, v in m.items() if k.startswith("tgi_request_failure"))
    assert m["tgi_request_count"] == m["tgi_request_success"] + failures


def test_json_answers_write_a_non_finite_float_as_null():
    """The server's JSON (answers and SSE events) writes NaN and inf as null, as TGI's serde_json does, instead of
    Python's NaN (not JSON) or Starlette's refusal (a 500 for an answer already computed)."""
    from hqtflow.runtime.api import JSON, json_text

    data = {"a": [1.5, float("nan"), {"b": float("-inf")}], "c": (float("inf"), "x")}
    assert strict_json(json_text(data)) == {"a": [1.5, None, {"b": None}], "c": [None, "x"]}
    assert strict_json(JSON(data).body.decode()) == {"a": [1.5, None, {"b": None}], "c": [None, "x"]}
    assert json_text({"t": "é", "v": 0.25}) == json.dumps({"t": "é", "v": 0.25})  # finite data: json's own text


def test_a_500_closes_its_connection_and_the_next_request_gets_a_new_one(url, monkeypatch):
    """Starlette raises a route's bug again after its 500 is sent, and uvicorn then closes the connection: the 500
    says `Connection: close`, so a client sends its next request on a new connection instead of into a reset one."""
    import http.client
    from urllib.parse import urlparse

    from hqtflow.runtime.api import Ctx

    real, failed = Ctx.answered, []

    def answered_once(self, *args):
        if not failed:
            failed.append(1)
            raise RuntimeError("a bug")
        return real(self, *args)

    monkeypatch.setattr(Ctx, "answered", answered_once)
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 2}})
    answers = []
    for _ in range(2):  # the same HTTPConnection: it reconnects when told the connection closes
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        answers.append((r.status, r.getheader("connection"), json.loads(r.read())))
    conn.close()
    assert answers[0][:2] == (500, "close") and answers[0][2]["error_type"] == "internal"
    assert answers[1][0] == 200 and "generated_text" in answers[1][2]


def test_a_failing_request_leaves_its_neighbours_alone(lm):
    """A request whose sampling fails gets its error; the requests decoding beside it in the same steps go on to
    their ends with the tokens they have alone."""
    import threading

    from hqtflow.runtime import engine as engine_module

    model, tok = lm
    ids = tok(PROMPT)["input_ids"]
    ref = alone(lm, ids, 6)
    eng = Engine(model, tok, max_batch_total_tokens=256)
    real, runs = engine_module._warp, []

    def broken(x, p):
        if p.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(x, p)

    def collect():
        events, done = [], threading.Event()
        runs.append((events, done))
        return lambda ev: (events.append(ev), (ev.finish_reason or ev.error) and done.set())

    engine_module._warp = broken
    try:
        for params in (SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, do_sample=True, seed=666),
                       SamplingParams(max_new_tokens=6)):
            eng.submit(ids, params, collect())  # all three wait for the engine: they run in the same steps
        eng.start()
        assert all(done.wait(60) for _, done in runs)
    finally:
        engine_module._warp = real
        eng.stop()
    (first, _), (failed, _), (third, _) = runs
    assert failed[-1].error and "probability tensor" in failed[-1].error
    for events in (first, third):
        assert not any(e.error for e in events) and [e.token.id for e in events] == ref


def test_huggingface_hub_inference_client(url, lm, monkeypatch):
    hub = client_lib("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # the tests run offline; the server is on loopback
    tok = lm[1]
    ids = tok(PROMPT)["input_ids"]
    want = tok.decode(alone(lm, ids, 8), skip_special_tokens=True)
    c = hub.InferenceClient(base_url=url, timeout=60)
    assert c.text_generation(PROMPT, max_new_tokens=8) == want
    d = c.text_generation(PROMPT, max_new_tokens=8, details=True, decoder_input_details=True)
    assert d.generated_text == want and len(d.details.prefill) == len(ids) and d.details.generated_tokens == 8
    assert "".join(c.text_generation(PROMPT, max_new_tokens=8, stream=True)) == want
    events = list(c.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True, top_n_tokens=2))
    assert events[-1].generated_text == want and events[-1].details.finish_reason == "length"
    assert all(len(e.top_tokens) == 2 for e in events)
    chat_ids = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    chat_want = tok.decode(alone(lm, tok(chat_ids, add_special_tokens=False)["input_ids"], 6), skip_special_tokens=True)
    v1 = hub.InferenceClient(base_url=f"{url}/v1", timeout=60)
    out = v1.chat_completion(MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert out.choices[0].message.content == chat_want
    content = out.choices[0].logprobs.content
    assert len(content) == 6 and all(len(x.top_logprobs) == 2 for x in content)
    parts = [ch.choices[0].delta.content or "" for ch in v1.chat_completion(MESSAGES, max_tokens=6, temperature=0, stream=True)
             if ch.choices]
    assert "".join(parts) == chat_want


def test_openai_completions_score_text(url, lm):
    openai = client_lib("openai")
    tok = lm[1]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    ids = tok(PROMPT)["input_ids"]
    want, lp = prompt_logprobs(lm, ids)
    # lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1, batched
    other = tok("A river")["input_ids"]
    c = client.completions.create(model="tiny", prompt=[ids, other], echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert [ch.index for ch in c.choices] == [0, 1]
    ch = c.choices[0]
    assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.token_logprobs[1:-1] == pytest.approx(want, abs=1e-4)
    assert len(ch.logprobs.tokens) == len(ids) + 1 and ch.text.startswith(tok.decode(ids))
    assert max(ch.logprobs.top_logprobs[1].values()) == pytest.approx(float(lp[0].max()), abs=1e-4)
    assert c.usage.prompt_tokens == len(ids) + len(other) and c.usage.completion_tokens == 2
    zero = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    assert zero.choices[0].text == PROMPT and zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert zero.usage.completion_tokens == 0
    strs = client.completions.create(model="tiny", prompt=[PROMPT, "A river"], max_tokens=4, temperature=0)
    assert strs.choices[1].text == tok.decode(alone(lm, tok("A river")["input_ids"], 4), skip_special_tokens=True)
    n = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=1, logprobs=2)
    assert [x.index for x in n.choices] == [0, 1] and all(len(x.logprobs.tokens) == len(x.logprobs.top_logprobs) for x in n.choices)
    for x in n.choices:  # sampled, so seldom among the 2 likeliest: the chosen token is listed too (as vLLM does)
        assert all(t in top for t, top in zip(x.logprobs.tokens, x.logprobs.top_logprobs))  # byte tokens may share a text
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=1, logprobs=2)
    assert [x.text for x in again.choices] == [x.text for x in n.choices]
    best = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=1, best_of=3, temperature=1.0, logprobs=0)
    assert len(best.choices) == 1
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True)
    parts = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True,
                                           stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == greedy.choices[0].text
    streamed = [p.choices[0].logprobs for p in parts if p.choices and p.choices[0].logprobs]
    want = greedy.choices[0].logprobs  # echo: the prompt scored first, then every token, offsets running on
    assert [x for lp in streamed for x in lp.token_logprobs] == pytest.approx(want.token_logprobs, abs=1e-5)
    assert [x for lp in streamed for x in lp.tokens] == want.tokens
    assert [x for lp in streamed for x in lp.text_offset] == want.text_offset
    assert parts[-1].usage.completion_tokens == 6
    with pytest.raises(openai.UnprocessableEntityError) as e:  # OpenAI's error body: message, param and code
        client.completions.create(model="tiny", prompt=PROMPT, temperature=2.5)
    assert "`temperature` must be >= 0.0 and <= 2.0" in e.value.message
    assert e.value.param == "temperature" and e.value.code == "validation" and e.value.type == "invalid_request_error"


def test_openai_text_offsets_index_the_text_across_split_characters(url):
    """/v1/completions' `text_offset` indexes the returned text's characters when tokens hold parts of a character
    (an emoji, CJK): each token's text is at its offset; a token holding part of a character is named by its bytes
    (OpenAI's "bytes:\\xNN"), at the offset of the character they belong to; streamed the same."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    ask = dict(model="tiny", prompt="I love \U0001f355 and \u65e5\u672c\u8a9e!", echo=True, logprobs=2, max_tokens=8,
               temperature=0)
    (c,) = client.completions.create(**ask).choices
    lp, text = c.logprobs, c.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    split = 0
    for name, at in zip(lp.tokens, lp.text_offset):
        if name.startswith("bytes:"):
            split += 1
            raw = bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
            assert raw in text[at].encode() or text[at] == "\ufffd", (name, at, text)
        else:
            assert text[at:at + len(name)] == name, (name, at, text)
    assert split >= 2 and "\ufffd" not in "".join(lp.tokens[:12])  # the emoji and the CJK split in the prompt's tokens
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])
    parts = [p.choices[0].logprobs for p in client.completions.create(**ask, stream=True) if p.choices and p.choices[0].logprobs]
    assert [x for q in parts for x in q.text_offset] == lp.text_offset and [x for q in parts for x in q.tokens] == lp.tokens


def test_tgi_logprobs_are_of_the_processed_distribution_openais_of_the_models(url, lm):
    """TGI's routes return the logprobs of the distribution each token is chosen from (TGI's NextTokenChooser): with
    a grammar the top tokens are allowed ones only, renormalised, the chosen one first (greedy); with top_k 1 every
    logprob is 0. OpenAI's routes return the model's own (raw) logprobs, as vLLM's default. (Both were raw: the
    grammar's top tokens were ones it forbids.)"""
    tok = lm[1]
    r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 6, "top_n_tokens": 3, "details": True, "grammar": {"type": "regex", "value": "[0-9]{3}-[a-z]{2}"}}},
        timeout=60).json()
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r["generated_text"]), r
    for chosen, top in zip(r["details"]["tokens"], r["details"]["top_tokens"]):
        if chosen["special"]:  # the grammar's end (EOS)
            continue
        assert top[0]["id"] == chosen["id"] and top[0]["logprob"] == pytest.approx(chosen["logprob"]), (chosen, top)
        assert all(re.fullmatch("[0-9]+|-|[0-9]*-?[a-z]*", t["text"]) for t in top), top  # never a forbidden token
    for path in ("/generate", "/generate_stream"):
        r = httpx.post(f"{url}{path}", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 4, "top_k": 1, "do_sample": True, "details": True, "top_n_tokens": 2}}, timeout=60)
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")] if "stream" in path else \
            [{"token": t, "top_tokens": top} for t, top in zip(r.json()["details"]["tokens"], r.json()["details"]["top_tokens"])]
        assert [e["token"]["logprob"] for e in events] == [0.0] * 4, events
        assert all(len(e["top_tokens"]) == 1 for e in events), events  # the tokens top_k rules out are not listed
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    c = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0.05, seed=1, logprobs=1).choices[0]
    _, lp = prompt_logprobs(lm, tok(PROMPT)["input_ids"])
    assert torch.isclose(lp[-1], torch.tensor(c.logprobs.token_logprobs[0]), atol=1e-4).any()  # one of the model's
    assert max(c.logprobs.top_logprobs[0].values()) == pytest.approx(float(lp[-1].max()), abs=1e-4)


def test_tgi_best_of_returns_the_highest_logprob_per_token(url):
    """TGI's best_of returns the sequence with the highest mean logprob per token (its router's rule; it took the
    highest total, so the shortest won), the others in details.best_of_sequences. Requests are repeated until the
    two rules disagree (sequences cut short by a stop sequence differ in length)."""
    def per_token(q):
        return sum(t["logprob"] for t in q["tokens"]) / len(q["tokens"])

    for _ in range(40):
        r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {
            "max_new_tokens": 12, "best_of": 4, "do_sample": True, "stop": ["e"], "details": True}}, timeout=60).json()
        seqs = [r["details"], *r["details"]["best_of_sequences"]]
        assert per_token(seqs[0]) == max(map(per_token, seqs)), seqs
        if max(seqs, key=lambda q: sum(t["logprob"] for t in q["tokens"])) is not max(seqs, key=per_token):
            break
    else:
        pytest.fail("no answer where the total and the per-token rule disagree")


def test_openai_best_of_returns_the_highest_logprob_per_token(url):
    """OpenAI's best_of returns the candidate with the highest log probability per token (it took the highest total,
    so the shortest won); candidate j is the request alone with seed + j. Seeds are tried until the two rules
    disagree (candidates cut short by a stop sequence differ in length)."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, stop=["e"], logprobs=0)
    for seed in range(0, 200, 4):
        cands = []
        for j in range(4):
            c = client.completions.create(n=1, seed=seed + j, **kw).choices[0]
            lps = c.logprobs.token_logprobs
            cands.append((c.text, sum(lps), sum(lps) / max(1, len(lps))))
        by_total, by_mean = max(cands, key=lambda c: c[1])[0], max(cands, key=lambda c: c[2])[0]
        if by_total != by_mean:
            break
    else:
        pytest.fail("no seed where the total and the per-token rule disagree")
    assert client.completions.create(best_of=4, n=1, seed=seed, **kw).choices[0].text == by_mean, (seed, cands)


def test_openai_chat_n_logprobs_usage_and_json(url, lm):
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=2, temperature=0.9, seed=4,
                                          logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=0.5)
    assert len(chat.choices) == 2 and sum(len(c.logprobs.content) for c in chat.choices) == chat.usage.completion_tokens
    for c in chat.choices:
        assert all(len(t.top_logprobs) == 3 for t in c.logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=2, temperature=0.9, seed=4,
                                                 stream=True, stream_options={"include_usage": True}, presence_penalty=0.5,
                                                 frequency_penalty=0.5))
    texts = ["", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in chat.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    schema = {"enum": ["yes", "no"]}
    js = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(js.choices[0].message.content) in ("yes", "no") and js.choices[0].finish_reason == "stop"
    # store=false is what the server does anyway (store=true is refused, REFUSED); `user` only tags the request
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, n=2)
    tagged = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, n=2,
                                            store=False, user="u-1")
    assert [c.message.content for c in tagged.choices] == [c.message.content for c in plain.choices]


def test_huggingface_hub_chat_with_tgi_response_formats(url, monkeypatch):
    """huggingface_hub's `chat_completion` documents TGI's grammar types as `response_format`: `json` with a schema
    in `value` (object or string), `regex`, and `json_schema` with `value`; it sends OpenAI's `json_schema` as
    TGI's `json_object` with the schema in `value`. A wrong `value` is a 422 naming it."""
    hub = client_lib("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    c = hub.InferenceClient(base_url=url, timeout=60)
    schema = {"enum": ["yes", "no"]}
    for fmt in ({"type": "json", "value": schema}, {"type": "json", "value": json.dumps(schema)},
                {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}):  # sent as json_object + value
        out = c.chat_completion(MESSAGES, max_tokens=10, temperature=0, response_format=fmt).choices[0]
        assert json.loads(out.message.content) in ("yes", "no") and out.finish_reason == "stop", fmt
    tgi_schema = {"type": "json_schema", "value": {"name": "a", "schema": schema}}  # TGI's form (the hub cannot send it)
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 10, "response_format": tgi_schema})
    assert json.loads(r.json()["choices"][0]["message"]["content"]) in ("yes", "no"), r.text
    out = c.chat_completion(MESSAGES, max_tokens=10, temperature=0, response_format={"type": "regex", "value": "(ab|cd)e"})
    assert out.choices[0].message.content in ("abe", "cde")
    for fmt, name in (({"type": "regex", "value": {"a": 1}}, "response_format.value"),
                      ({"type": "json"}, "response_format.value"), ({"type": "text", "value": "x"}, "response_format.value")):
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "response_format": fmt})
        assert r.status_code == 422 and name in r.json()["error"]["message"], (fmt, r.text)


def test_openai_stop_lists_as_lm_eval_sends_them(url):
    """lm-eval's local-completions sends a task's whole `until` list plus EOS (humaneval: 6 strings), more than
    OpenAI's 4: accepted up to --max-stop-sequences (16), the text ends before the first stop found; more is a 422
    naming `stop`, and /info says the limit."""
    from openai import OpenAI

    c = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    full = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[4:7]
    assert len(stop) == 3, full
    until = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    until = [u for u in until if u not in full] + [stop]
    out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=until).choices[0]
    assert (out.text, out.finish_reason) == (full[:full.find(stop)], "stop")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": [f"s{i}" for i in range(17)]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "stop", r.text
    assert "up to 16" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/info").json()["max_stop_sequences"] == 16


def test_openai_n_with_the_largest_seed(url):
    """n sequences with seed S sample with S, S + 1, ... wrapped at 2**64: the largest accepted seed is no 500."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    top = 2**64 - 1
    runs = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, n=2, seed=top) for _ in range(2)]
    assert [c.text for c in runs[0].choices] == [c.text for c in runs[1].choices] and len(runs[0].choices) == 2
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, n=2, seed=top)
    assert len(chat.choices) == 2


def test_openai_seed_top_p_and_assistant_turns_as_openai(url):
    """OpenAI's ranges: a negative seed (an int64, as clients derive them from hashes) samples as seed mod 2**64;
    top_p 0 keeps the most likely token only (greedy); an assistant turn with neither content nor tool calls is a
    422 naming it, not an empty turn rendered into the prompt."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    sample = lambda **kw: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.5, **kw).choices[0].text  # noqa: E731
    assert sample(seed=-5) == sample(seed=-5) == sample(seed=2**64 - 5)
    with pytest.raises(openai.UnprocessableEntityError, match="seed"):
        sample(seed=-(2**63) - 1)
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    assert sample(top_p=0, seed=1) == sample(top_p=0, seed=2) == greedy
    for turn in ({"role": "assistant"}, {"role": "assistant", "content": None, "tool_calls": []}):
        with pytest.raises(openai.UnprocessableEntityError, match=r"messages\[1\].*`content` or `tool_calls`"):
            client.chat.completions.create(model="tiny", messages=[*MESSAGES[:1], turn, *MESSAGES[:1]], max_tokens=2)
    ok = client.chat.completions.create(model="tiny", messages=[*MESSAGES[:1], {"role": "assistant", "content": ""}, *MESSAGES[:1]], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


REFUSED = [
    ("/generate", {"inputs": PROMPT, "parameters": {"typical_p": 1.5}}, "typical_p"),
    ("/generate", {"inputs": PROMPT, "parameters": {"truncate": -1}}, "truncate"),
    ("/generate", {"inputs": PROMPT, "parameters": {"best_of": 9, "do_sample": True}}, "best_of"),
    ("/generate", {"inputs": PROMPT, "parameters": {"best_of": 2}}, "best_of"),
    ("/generate", {"inputs": PROMPT, "parameters": {"top_n_tokens": 50}}, "top_n_tokens"),
    ("/generate", {"inputs": PROMPT, "parameters": {"frequency_penalty": 3}}, "frequency_penalty"),
    ("/generate", {"inputs": PROMPT, "parameters": {"adapter_id": "lora"}}, "adapter_id"),
    ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "json", "value": "{"}}}, "grammar"),
    ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "regex", "value": ""}}}, "value"),
    ("/generate", {"inputs": PROMPT, "parameters": {"grammar": {"type": "lark", "value": "x"}}}, "grammar"),
    ("/generate", {"inputs": PROMPT, "parameters": {"foo": 1}}, "foo"),
    ("/generate_stream", {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}, "decoder_input_details"),
    ("/generate", {"inputs": PROMPT, "stream": True}, "stream"),
    ("/", {"inputs": PROMPT, "stream": True, "parameters": {"best_of": 2, "do_sample": True}}, "best_of"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "presence_penalty": -3}, "presence_penalty"),
    ("/v1/completions", {"prompt": [[1]] * 40, "n": 2, "max_tokens": 1}, "`prompt`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": MESSAGES, "metadata": {"team": "a"}}, "metadata"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 9}, "`n`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": 1}, "`stream`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "stream_options": {"foo": 1}}, "`stream_options.foo`"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "`messages[0].role`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "`messages[0].content[0]`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, "`messages[0].content`"),  # >= 1 part
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "`max_tokens` must be >= 0. Given: -1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]}, "`messages[0].content[0].cache_control`"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"\u00b2": 5}}, "logit_bias"),  # isdigit() but not a number
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"\u0663": 5}}, "logit_bias"),  # an Arabic-Indic 3
    ("/v1/chat/completions", {"messages": [{**MESSAGES[0], "name": "bob"}]}, "`messages[0].name`"),
    ("/v1/chat/completions", {"messages": [{**MESSAGES[0], "foo": "bar"}]}, "`messages[0].foo`"),
    ("/v1/chat/completions", {"messages": MESSAGES + [{"role": "user", "content": "x", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "`messages[1].tool_calls`"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_object", "json_schema": {"name": "a", "schema": {"type": "integer"}}}}, "response_format.json_schema"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "text", "json_schema": {"name": "a", "schema": {"type": "integer"}}}}, "response_format.json_schema"),
]


def test_refused_parameters_are_named(url):
    for path, body, name in REFUSED:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code == 422, (path, body, r.text)
        if path.startswith("/v1/"):  # OpenAI's error body
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and name in err["message"], (body, err)
        else:
            assert set(r.json()) == {"error", "error_type"} and name in r.json()["error"], (body, r.json())


def test_openai_chat_stream_helper_and_the_end_of_turn(url, lm):
    """The openai SDK's `chat.completions.stream` helper joins the deltas: the role comes once (in each choice's first
    chunk), so the final message's role is "assistant" and its content the non-streamed one. Chat logprobs cover the
    content's tokens, not the end-of-turn token. With include_usage every chunk but the last has `usage: null`.
    Message fields given as null are fields not given."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, n=2)
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, n=2) as s:
        for _ in s:  # (get_final_completion() raises on finish_reason "length", with any server)
            pass
        final = s.current_completion_snapshot
    assert [c.message.role for c in final.choices] == ["assistant"] * 2
    assert [c.message.content for c in final.choices] == [c.message.content for c in plain.choices]
    eos = lm[1].eos_token_id
    ended = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True,
             "logit_bias": {str(eos): 100}}  # the first token is the end of the turn
    out = client.chat.completions.create(**ended).choices[0]
    assert (out.finish_reason, out.message.content, out.logprobs.content) == ("stop", "", [])
    chunks = list(client.chat.completions.create(**ended, stream=True))
    assert all(not (c.logprobs and c.logprobs.content) for ch in chunks for c in ch.choices), chunks
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in e and e["usage"] is None for e in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 3
    history = [{"role": "user", "content": "Hello", "name": None},
               {"role": "assistant", "content": "Hi", "tool_calls": None, "refusal": None, "function_call": None},
               {"role": "user", "content": "Again"}]
    assert client.chat.completions.create(model="tiny", messages=history, max_tokens=2).choices[0].message.content is not None


def test_openai_completions_stream_without_echo_starts_with_text(url):
    """Without echo, no chunk of a completions stream is empty (the prompt's chunk is sent only with echo)."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    parts = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, stream=True))
    assert all(p.choices[0].text or p.choices[0].finish_reason for p in parts), [p.choices[0] for p in parts]
    assert all(p.choices[0].logprobs.tokens for p in parts if p.choices[0].text)


def test_openai_json_schema_fields_are_checked(url):
    """response_format.json_schema is OpenAI's {name, description, schema, strict}: another field is a 422 naming it,
    not ignored; `strict` is accepted (false here: true keeps a schema to OpenAI's strict mode, whose root is an
    object, test_grammar_conformance)."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    schema = {"name": "a", "description": "yes or no", "strict": False, "schema": {"enum": ["yes", "no"]}}
    ok = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0,
                                        response_format={"type": "json_schema", "json_schema": schema})
    assert json.loads(ok.choices[0].message.content) in ("yes", "no")
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                       response_format={"type": "json_schema", "json_schema": {**schema, "strikt": True}})
    assert e.value.param == "response_format.json_schema.strikt", e.value.message


def test_openai_bad_message_is_named_once(url):
    """A message the server refuses (the deprecated `function` role) is one validation error whose `param` is that
    message's field, not wrapped as a chat template failure of `messages`."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES + [{"role": "function", "content": "4", "name": "f"}],
                                       max_tokens=2)
    assert e.value.param == "messages[1].role" and e.value.message.count("Input validation error") == 1, e.value.message
    assert "chat template" not in e.value.message


NON_FINITE = [
    ("/generate", '{"inputs": "The tower is", "parameters": {"do_sample": true, "repetition_penalty": NaN, "max_new_tokens": 2}}',
     "repetition_penalty"),
    ("/generate", '{"inputs": "The tower is", "parameters": {"temperature": Infinity, "max_new_tokens": 2}}', "temperature"),
    ("/v1/completions", '{"prompt": "The tower is", "temperature": NaN, "max_tokens": 2}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi"}], "top_p": NaN, "max_tokens": 2}', "top_p"),
]


def test_non_finite_numbers_are_refused(url):
    """NaN and Infinity (which Python's json writes by default) are a 422 naming the field, not a garbled or failed
    generation (the official clients refuse to send them)."""
    for path, body, name in NON_FINITE:
        r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, (body, r.status_code, r.text)
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["error"]
        assert re.search(rf"`(parameters\.)?{name}`: Input should be a finite number", message), message


def test_a_number_of_thousands_of_digits_is_named(url):
    """Valid JSON whose number the parser cannot read (more than 4300 digits) is not called invalid JSON."""
    for path, body in (("/generate", '{"inputs": "a", "parameters": {"max_new_tokens": %s}}'),
                       ("/v1/completions", '{"prompt": "a", "max_tokens": %s}')):
        r = httpx.post(f"{url}{path}", content=body % ("9" * 5000), headers={"content-type": "application/json"})
        message = r.json()["error"]["message"] if path.startswith("/v1/") else r.json()["error"]
        assert r.status_code == 422 and "a number with more digits than can be read" in message, r.text


def test_error_json_and_content_type(url):
    for r, status in ((httpx.get(f"{url}/nope"), 404), (httpx.get(f"{url}/generate"), 405),
                      (httpx.post(f"{url}/generate", content=json.dumps({"inputs": PROMPT}), headers={"content-type": "text/plain"}), 415),
                      (httpx.post(f"{url}/", content=json.dumps({"inputs": PROMPT})), 415),
                      (httpx.post(f"{url}/generate", json={"inputs": ""}), 422)):
        assert r.status_code == status and set(r.json()) == {"error", "error_type"}, (status, r.text)
    text = httpx.get(f"{url}/metrics").text
    for name in ("tgi_request_queue_duration_bucket", "tgi_request_mean_time_per_token_duration_count", "tgi_batch_next_size_sum",
                 "# TYPE tgi_request_count counter", "# TYPE tgi_request_success counter", "# TYPE tgi_request_failure counter"):
        assert name in text, name
    gzipped = __import__("gzip").compress(json.dumps({"inputs": PROMPT}).encode())
    for r in (httpx.post(f"{url}/generate", content=gzipped, headers={"content-type": "application/json",
                                                                      "content-encoding": "gzip"}),
              httpx.post(f"{url}/generate", content=json.dumps({"inputs": PROMPT}).encode("latin-1"),
                         headers={"content-type": "application/json; charset=latin-1"})):
        assert r.status_code == 415 and "UTF-8 JSON body" in r.json()["error"], r.text
    ok = httpx.post(f"{url}/generate", content=json.dumps({"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}),
                    headers={"content-type": "application/json; charset=UTF-8"})
    assert ok.status_code == 200, ok.text
    slash = httpx.post(f"{url}/generate/", json={"inputs": PROMPT}, headers={"host": "evil.example"})
    assert slash.status_code == 404 and "location" not in slash.headers and set(slash.json()) == {"error", "error_type"}
    models_slash = httpx.get(f"{url}/v1/models/")  # not a model named ''
    assert models_slash.status_code == 404 and "does not exist" not in models_slash.text, models_slash.text
    assert httpx.put(f"{url}/generate", json={}).headers.get("allow") == "POST"  # a 405 says what is allowed
    assert httpx.head(f"{url}/health").status_code == 200
    pieces = httpx.post(f"{url}/tokenize", json={"inputs": PROMPT, "parameters": {"truncate": 1}}).json()
    assert len(pieces) == 1 and pieces[0]["stop"] == len(PROMPT), pieces  # the last token, as the generation routes keep
    count = lambda t: float(re.search(r"^tgi_request_count (\S+)", t, re.M).group(1))  # noqa: E731
    before = count(httpx.get(f"{url}/metrics").text)
    httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"typical_p": 2}})
    assert count(httpx.get(f"{url}/metrics").text) == before + 1  # validation failures are counted


@pytest.mark.slow
def test_lm_eval_local_completions_matches_in_process(tiny_llama_long, wiki_text, data_dir, tmp_path):
    """lm-eval's local-completions against the server gives the in-process `hqtflow eval` metrics (FP8 checkpoint)."""
    from conftest import run_cli
    from lm_eval.evaluator import simple_evaluate

    from hqtflow import lmeval
    from hqtflow.eval_run import run_eval
    from hqtflow.evaluate import load_any

    meas, ck, tasks = tmp_path / "m", tmp_path / "fp8", tmp_path / "tasks"
    assert run_cli("measure", tiny_llama_long, "-o", meas, "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", meas, "-o", ck).exit_code == 0
    tasks.mkdir()
    (tasks / "lambada_gen.yaml").write_text(GEN_TASK.format(data=data_dir / "lambada_openai.jsonl"))
    names, limit = ["lambada_openai_local", "lambada_gen"], 12
    local = json.loads(run_eval(str(ck), baseline=None, use_source=False, tasks=tuple(names), include_path=(str(tasks),),
                                data_dir=str(data_dir), limit=limit, batch_size=4, ppl_file=None, ppl_windows=None,
                                report=tmp_path / "r.json", backend="auto") and (tmp_path / "r.json").read_text())
    model, tok, _ = load_any(str(ck))
    with running(create_app(model, tok, ServeSettings(model_id="fp8", max_input_tokens=1023, max_total_tokens=1024))) as base:
        res = simple_evaluate(model="local-completions", model_args=f"model=fp8,base_url={base}/v1/completions,tokenizer={ck},"
                              "num_concurrent=1,max_retries=1,batch_size=4,tokenized_requests=True", tasks=names, limit=limit,
                              task_manager=lmeval.task_manager([tasks], data_dir, names), bootstrap_iters=0, verbosity="ERROR",
                              log_samples=True)
    served = {t: {k.split(",")[0]: v for k, v in m.items() if isinstance(v, (int, float))} for t, m in res["results"].items()}
    print("served", served, "local", local)
    assert served["lambada_openai_local"]["acc"] == pytest.approx(_metric(local, "lambada_openai_local", "acc"))
    # in process, lm-eval's requests go through the serving engine too: the same log-likelihoods, not only close
    assert served["lambada_openai_local"]["perplexity"] == pytest.approx(_metric(local, "lambada_openai_local", "perplexity"), rel=1e-9)
    assert served["lambada_gen"]["exact_match"] == _metric(local, "lambada_gen", "exact_match")
    # a random model scores 0 either way: the generations themselves are the greedy in-process ones, of the serving
    # engine run alone on each context (the same rows whatever lm-eval batched beside them).
    samples = res["samples"]["lambada_gen"]
    assert len(samples) == limit
    for sample in samples:
        args = sample["arguments"]
        context = args["gen_args_0"]["arg_0"] if isinstance(args, dict) else args[0][0]
        assert sample["filtered_resps"][0] == gen_task_answer(model, tok, context), sample


@pytest.mark.slow
def test_lm_eval_local_chat_completions_generates_as_the_engine(lm_long, data_dir, tmp_path):
    """lm-eval's local-chat-completions (a generate_until task, the chat template applied by the server, the task's
    stop list sent as `stop`): every response is the serving engine's greedy text for that templated context."""
    from lm_eval.evaluator import simple_evaluate

    from hqtflow import lmeval

    model, tok = lm_long  # lambada's contexts pass the 256-token context of `lm`
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "lambada_gen.yaml").write_text(GEN_TASK.format(data=data_dir / "lambada_openai.jsonl"))
    with running(create_app(model, tok, ServeSettings(model_id="tiny", max_input_tokens=1023, max_total_tokens=1024))) as base:
        res = simple_evaluate(model="local-chat-completions", model_args=f"model=tiny,base_url={base}/v1/chat/completions,"
                              "num_concurrent=1,max_retries=1", apply_chat_template=True, tasks=["lambada_gen"], limit=6,
                              task_manager=lmeval.task_manager([tasks], data_dir, ["lambada_gen"]), bootstrap_iters=0,
                              verbosity="ERROR", log_samples=True)
    samples = res["samples"]["lambada_gen"]
    assert len(samples) == 6
    for sample in samples:
        args = sample["arguments"]
        context = args["gen_args_0"]["arg_0"] if isinstance(args, dict) else args[0][0]
        messages = json.loads(context[0] if isinstance(context, tuple) else context)  # (JSON of the messages,)
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert sample["resps"][0][0] == gen_task_answer(model, tok, prompt), sample


def gen_task_answer(model, tok, prompt: str) -> str:
    """GEN_TASK's answer to a prompt: the serving engine's greedy tokens, alone, cut at the task's stop sequences."""
    engine, events = Engine(model, tok), []
    engine.submit(tok(prompt, add_special_tokens=False)["input_ids"], SamplingParams(max_new_tokens=6), events.append)
    while engine.step():
        pass
    text = tok.decode([e.token.id for e in events], skip_special_tokens=True)
    for stop in ("\n", "."):
        text = text.split(stop)[0]
    return text


GEN_TASK = """task: lambada_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: "{data}"
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{' ' + continuation}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def _metric(report, task, metric):
    (results,) = report["results"].values()
    return results["tasks"][task][metric]


def test_json_grammars_write_one_line_and_json_mode_an_object(lm):
    """JSON grammars allow no whitespace between tokens but OpenAI's ", " and ": " (a model free to pad with newlines
    may pad until max_tokens cuts the JSON short), and OpenAI's JSON mode is an object, never an array or a value."""
    from hqtflow.runtime.grammar import compile_grammar, matcher

    def accepts(compiled, text):
        m = matcher(compiled)
        return m.accept_string(text) and m.accept_token(lm[1].eos_token_id)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for kind, value in (("json", schema), ("json_object", None)):
        g = compile_grammar(lm[1], kind, value)
        assert accepts(g, '{"a": 1}')
        assert not any(accepts(g, t) for t in ('{\n"a": 1}', '{"a" : 1}', '{ "a": 1}', '{"a": 1}\n'))
    obj = compile_grammar(lm[1], "json_object")
    assert accepts(obj, '{"b": [1, {"c": "x y\\n"}]}') and not any(accepts(obj, t) for t in ("[null]", "1", '"a"', "null"))


@pytest.mark.slow
def test_smollm2_json_schema_chat(smollm2):
    """The real SmolLM2 answers in the asked JSON schema (xgrammar masks the logits), via the openai client."""
    openai = client_lib("openai")
    from hqtflow import models

    app = create_app(models.load_model(smollm2, "bf16"), models.load_tokenizer(smollm2), ServeSettings(model_id="smollm2"))
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            max_tokens=40, temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}
        hi = [{"role": "user", "content": "Hi"}]  # greedy, it padded with newlines to max_tokens when it could
        padded = client.chat.completions.create(model="smollm2", messages=hi, max_tokens=60, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": person}}).choices[0]
        mode = client.chat.completions.create(model="smollm2", messages=hi, max_tokens=60, temperature=0,
                                              response_format={"type": "json_object"}).choices[0]
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"city", "country"} and r.choices[0].finish_reason == "stop", answer
    # no newline can pad the JSON any more (none is allowed outside strings, and JSON strings hold none raw); what the
    # model writes may still run to max_tokens (an integer's digits), so the JSON is checked when it ended
    for out in (padded, mode):
        assert "\n" not in out.message.content and out.message.content.startswith("{"), out
        assert out.finish_reason != "stop" or isinstance(json.loads(out.message.content), dict), out


def test_logprobs_end_where_a_stop_sequence_cuts_the_text(url):
    """The stop sequence is left out of the text and so out of the logprobs (streamed or not, completions and chat):
    the tokens listed are the greedy answer's up to the one where the stop sequence begins."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    ask = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    full = client.completions.create(**ask).choices[0]
    toks, text, offsets = full.logprobs.tokens, full.text, full.logprobs.text_offset
    plain = [not t.startswith("bytes:") for t in toks]  # not a part of a character (named by its bytes)
    assert all(text.startswith(t, at) for t, at, whole in zip(toks, offsets, plain) if whole)
    k = next(i for i in range(1, len(toks)) if toks[i] and plain[i] and text.find(toks[i]) == offsets[i])  # its first occurrence
    cut = client.completions.create(**ask, stop=[toks[k]]).choices[0]
    assert (cut.text, cut.logprobs.tokens, cut.finish_reason) == (text[:offsets[k]], toks[:k], "stop")
    streamed = [t for ch in client.completions.create(**ask, stop=[toks[k]], stream=True) for c in ch.choices
                if c.logprobs for t in c.logprobs.tokens]
    assert streamed == toks[:k]
    # a stream holds token k back (it may begin the first stop), then releases it as token k + 1 begins the second:
    # token k + 1 is held back in turn, and left out with its stop sequence
    k = next(i for i in range(1, len(toks) - 2) if toks[i] and toks[i + 1] and all(plain[i:i + 3])
             and text.find(toks[i + 1] + toks[i + 2]) == offsets[i + 1])
    stops = [toks[k] + "\u2603\u2603", toks[k + 1] + toks[k + 2]]
    cut = client.completions.create(**ask, stop=stops).choices[0]
    assert (cut.text, cut.logprobs.tokens) == (text[:offsets[k + 1]], toks[:k + 1])
    streamed = [(c.text, c.logprobs.tokens) for ch in client.completions.create(**ask, stop=stops, stream=True)
                for c in ch.choices if c.logprobs]
    assert "".join(t for t, _ in streamed) == cut.text and [t for _, ts in streamed for t in ts] == toks[:k + 1]

    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True}
    answer = client.chat.completions.create(**chat).choices[0]
    toks = [t.token for t in answer.logprobs.content]
    offsets, text = [sum(map(len, toks[:i])) for i in range(len(toks))], answer.message.content
    assert "".join(toks) == text
    k = next(i for i in range(1, len(toks)) if toks[i] and text.find(toks[i]) == offsets[i])
    cut = client.chat.completions.create(**chat, stop=[toks[k]]).choices[0]
    assert (cut.message.content, [t.token for t in cut.logprobs.content]) == (text[:offsets[k]], toks[:k])
    streamed = [t.token for ch in client.chat.completions.create(**chat, stop=[toks[k]], stream=True) for c in ch.choices
                if c.logprobs for t in c.logprobs.content]
    assert streamed == toks[:k]


def test_tgi_clients_type_the_errors_of_the_v1_routes(url):
    """/v1 errors carry TGI's `error_type` beside OpenAI's `error` object (as TGI's own /v1 routes answer), so
    text-generation's client raises its typed error there too; a refused nested field is named by its whole path."""
    tg = client_lib("text_generation")
    with pytest.raises(tg.errors.ValidationError):
        tg.Client(url, timeout=60).chat(messages=[{"role": "user", "content": "x" * 400}], max_tokens=90)
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "stream": True,
                                                       "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats", r.text
    r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"adapter_id": "a"}})
    assert r.status_code == 422 and "`parameters.adapter_id` is not supported" in r.json()["error"], r.text


def test_developer_is_system_to_a_template_that_does_not_name_it(url):
    """OpenAI's `developer` role reaches a template that knows only `system` (the tiny model's: SmolLM2's) as
    `system`: the same prompt and answer, where such a template would drop it or refuse it."""
    ask = {"max_tokens": 4, "temperature": 0}
    as_system, as_developer = (httpx.post(f"{url}/v1/chat/completions", json={**ask, "messages": [
        {"role": role, "content": "Answer in French."}, *MESSAGES]}).json() for role in ("system", "developer"))
    assert as_developer["usage"] == as_system["usage"] and as_developer["choices"] == as_system["choices"]


def test_a_shutdown_during_a_long_step_answers_every_client_with_the_shutdown_error(lm, monkeypatch):
    """A graceful shutdown while the engine's step runs past the timeout (a long prefill, a loaded machine): every
    waiting request still ends with "the server is shutting down" (a 424 JSON, a stream's error event), what the
    official clients raise as such, before uvicorn's deadline cancels the tasks (its plain-text 500, which
    text_generation failed to parse), and the server stops by the timeout."""
    import threading
    import time

    import uvicorn

    from hqtflow.runtime.server import drain, uvicorn_config

    tg, hub, openai = client_lib("text_generation"), client_lib("huggingface_hub"), client_lib("openai")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=32, max_total_tokens=64, shutdown_timeout=2))
    stuck, released = threading.Event(), threading.Event()

    def long_step(plan):  # the engine's step outlasts the shutdown timeout
        stuck.set()
        released.wait(30)

    monkeypatch.setattr(app.state.engine, "_forward", long_step)
    with socket_port() as port:
        server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    base, results = f"http://127.0.0.1:{port}", {}
    calls = {"tgi": lambda: tg.Client(base, timeout=30).generate(PROMPT, max_new_tokens=4),
             "tgi_stream": lambda: list(tg.Client(base, timeout=30).generate_stream(PROMPT, max_new_tokens=4)),
             "hub": lambda: hub.InferenceClient(base_url=base, timeout=30).text_generation(PROMPT, max_new_tokens=4),
             "openai": lambda: openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).chat.completions.create(
                 model="tiny", messages=MESSAGES, max_tokens=4)}

    def call(name):
        try:
            results[name] = calls[name]()
        except Exception as e:  # noqa: BLE001 - what each client raises is the result
            results[name] = e

    clients = [threading.Thread(target=call, args=(name,)) for name in calls]
    try:
        for c in clients:
            c.start()
        assert stuck.wait(30)
        while app.state.ctx.state["in_flight"] < len(calls):  # every request is waiting on the stuck step
            time.sleep(0.05)
        t0 = time.monotonic()
        drain(app, 2.0)
        server.should_exit = True  # what uvicorn's signal handler does
        for c in clients:
            c.join(30)
        assert time.monotonic() - t0 < 2.0  # answered before uvicorn's deadline
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - t0 < 2.0 + 1.0
    finally:
        released.set()
    for name, raised in results.items():
        assert "the server is shutting down" in str(raised), (name, repr(raised))
    assert isinstance(results["tgi"], tg.errors.GenerationError) and isinstance(results["hub"], hub.errors.GenerationError)
    assert isinstance(results["openai"], openai.APIStatusError) and results["openai"].status_code == 424


def socket_port():
    """A free loopback port (the socket closed when the block ends)."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def port():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            yield sock.getsockname()[1]

    return port()


def test_streams_send_keep_alive_comments_the_official_clients_skip(lm, monkeypatch):
    """Every SSE route sends a comment after KEEP_ALIVE_SECONDS without an event (TGI's 15 s; 0.05 s here, with 0.2 s
    steps), so a queued stream is not silent on the wire; text_generation (Client, AsyncClient), huggingface_hub
    (text_generation, chat_completion) and openai stream the same text as without them."""
    import asyncio
    import time

    from hqtflow.runtime import api

    tg, hub, openai = client_lib("text_generation"), client_lib("huggingface_hub"), client_lib("openai")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=32, max_total_tokens=64))
    engine = app.state.engine
    with running(app) as base:
        want = tg.Client(base).generate(PROMPT, max_new_tokens=3).generated_text
        chat = openai.OpenAI(base_url=f"{base}/v1", api_key="x").chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=3, temperature=0).choices[0].message.content
        step = engine._forward
        monkeypatch.setattr(engine, "_forward", lambda plan: (time.sleep(0.2), step(plan))[1])
        monkeypatch.setattr(api, "KEEP_ALIVE_SECONDS", 0.05)
        body = {"model": "tiny", "max_tokens": 3, "stream": True}
        for route, payload in [("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}),
                               ("/", {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}, "stream": True}),
                               ("/v1/completions", {**body, "prompt": PROMPT}),
                               ("/v1/chat/completions", {**body, "messages": MESSAGES})]:
            raw = httpx.post(f"{base}{route}", json=payload, timeout=30).text
            assert raw.startswith(":\n\n") and raw.count(":\n\n") >= 3, (route, raw)
        assert "".join(r.token.text for r in tg.Client(base).generate_stream(PROMPT, max_new_tokens=3)) == want

        async def async_stream():
            return [r async for r in tg.AsyncClient(base).generate_stream(PROMPT, max_new_tokens=3)]

        assert "".join(r.token.text for r in asyncio.run(async_stream())) == want
        c = hub.InferenceClient(base_url=base, timeout=30)
        assert "".join(c.text_generation(PROMPT, max_new_tokens=3, stream=True)) == want
        parts = c.chat_completion(MESSAGES, max_tokens=3, temperature=0, stream=True)
        assert "".join(p.choices[0].delta.content or "" for p in parts) == chat
        parts = openai.OpenAI(base_url=f"{base}/v1", api_key="x").chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, stream=True)
        assert "".join(p.choices[0].delta.content or "" for p in parts) == chat
