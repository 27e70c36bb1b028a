"""What a grammar may cost the server: the inputs that drive xgrammar's compile are bounded (a 422 naming the bound,
before anything compiles), and compiles run on their own threads, where a client that left skips its queued one."""

import threading
import time

import httpx
import pytest

from conftest import running
from hqtflow.runtime import grammar
from hqtflow.runtime.server import ServeSettings, create_app

X = "x" * 1500  # 10 enum strings of this: 1.3 s to compile on 2 shared cores; 40 of them 22 s, 1000 of them > 13 min


@pytest.fixture(scope="module")
def url(lm):
    with running(create_app(*lm, ServeSettings(max_input_tokens=32, max_total_tokens=64))) as base:
        yield base


def tgi(grammar_: dict) -> dict:
    return {"inputs": "x", "parameters": {"max_new_tokens": 1, "grammar": grammar_}}


@pytest.mark.parametrize("body, bound", [
    (tgi({"type": "json", "value": {"enum": [f"{i}{X}" for i in range(10)]}}), "`enum`/`const` string of more than 500"),
    (tgi({"type": "json", "value": {"const": X}}), "`enum`/`const` string of more than 500"),
    (tgi({"type": "json", "value": {"enum": [f"{i}" + "x" * 400 for i in range(40)]}}), "more than 15000 characters"),
    (tgi({"type": "json", "value": {"type": "object", "properties": {"k" * 600: {}}, "additionalProperties": False}}),
     "property name of more than 500 characters (at the root)"),
    (tgi({"type": "json", "value": {"type": "object", "properties": {f"{i:02d}" + "k" * 10: {} for i in range(43)}}}),
     "more than 512 characters of property names in objects open to other properties (give those objects "
     "`additionalProperties: false`)"),
    (tgi({"type": "json", "value": {"type": "string", "pattern": "[a-z]{0,300}"}}), "a `pattern` that repeats more than 128"),
    (tgi({"type": "regex", "value": "(.{0,20}){0,10}"}), "the regex repeats more than 128 times"),
    (tgi({"type": "regex", "value": "a" * 2001}), "the regex is longer than 2000 characters"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": {"type": "json_schema",
      "json_schema": {"name": "p", "schema": {"type": "string", "pattern": '[^"]{1,300}'}}}}, "repeats more than 128"),
])
def test_the_inputs_that_drive_a_compile_are_bounded(url, body, bound, monkeypatch):
    compiled = []
    monkeypatch.setattr(grammar, "_compile", lambda tok, kind, value, vocab: compiled.append(value))
    path = "/v1/chat/completions" if "messages" in body else "/generate"
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 422 and bound in (error["message"] if path.startswith("/v1/") else error), r.text
    assert compiled == []  # refused before compiling


def test_what_is_within_the_bounds_compiles(url):
    """A closed object's long property names, an enum up to the bounds and a bounded repetition are accepted."""
    closed = {"type": "object", "properties": {f"{i:03d}" + "k" * 97: {"type": "integer"} for i in range(20)},
              "additionalProperties": False}
    for g in ({"type": "json", "value": closed}, {"type": "json", "value": {"enum": [f"{i}" + "y" * 499 for i in range(4)]}},
              {"type": "regex", "value": "[a-z]{1,8}(-[a-z]{1,8}){0,3}"}):
        r = httpx.post(f"{url}/generate", json=tgi(g), timeout=120)
        assert r.status_code == 200, r.text


def test_repeat_size_multiplies_nested_counts_and_skips_classes_and_escapes():
    assert grammar.repeat_size("(a{0,10}){0,20}") == 200
    assert grammar.repeat_size("a{3}b{0,5}") == 8
    assert grammar.repeat_size(r"\{0,999\}[{]{2}") == 2
    assert grammar.repeat_size("[]{]{0,4}") == 4
    assert grammar.repeat_size(r"^\u{200}$") == 0 and grammar.repeat_size(r"^\u{41}{100}$") == 100  # one code point
    assert grammar.repeat_size(r"^\x{200}$") == 200  # xgrammar reads \x{200} as x, 200 times


def test_xgrammar_errors_do_not_show_its_build_paths(url):
    r = httpx.post(f"{url}/generate", json=tgi({"type": "regex", "value": "ab(("}))
    assert r.status_code == 422 and "`grammar`: regex grammar does not compile: Regex parsing error at" in r.json()["error"]
    assert ".cc:" not in r.text and "/project/" not in r.text, r.text
    r = httpx.post(f"{url}/generate", json=tgi({"type": "json", "value": {"type": "string", "pattern": "(("}}))
    assert r.status_code == 422 and ".cc:" not in r.text and "[" not in r.json()["error"].split("compile: ")[1], r.text


def cancelled(url) -> float:
    """The server's count of requests whose client left."""
    for line in httpx.get(f"{url}/metrics", timeout=60).text.splitlines():
        if line.startswith('tgi_request_failure{err="cancelled"}'):
            return float(line.split()[-1])
    return 0.0


def test_compiles_run_on_their_own_threads_and_a_client_that_left_skips_its_queued_compile(url, monkeypatch):
    """While every grammar thread is busy, tokenizing (the shared threadpool) and requests without a grammar go on;
    a request whose client left while its compile was queued never compiles."""
    compiled, release = [], threading.Event()
    real = grammar._compile
    monkeypatch.setattr(grammar, "_compile", lambda tok, kind, value, vocab: compiled.append(value) or real(tok, kind, value, vocab))
    busy = [grammar.compile_pool.submit(release.wait, 30) for _ in range(grammar.COMPILE_WORKERS)]
    try:
        assert httpx.post(f"{url}/tokenize", json={"inputs": "hello"}, timeout=60).status_code == 200
        plain = {"inputs": "x", "parameters": {"max_new_tokens": 1}}
        assert httpx.post(f"{url}/generate", json=plain, timeout=60).status_code == 200
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        before = cancelled(url)
        with pytest.raises(httpx.TimeoutException):  # its compile waits behind the busy threads; the client leaves
            httpx.post(f"{url}/generate", json=tgi({"type": "regex", "value": "left[0-9]"}), timeout=1)
        deadline = time.monotonic() + 30
        while cancelled(url) == before and time.monotonic() < deadline:  # the server drops the queued compile
            time.sleep(0.1)
        assert cancelled(url) == before + 1
    finally:
        release.set()
        for f in busy:
            f.result()
    r = httpx.post(f"{url}/generate", json=tgi({"type": "regex", "value": "stayed[0-9]"}), timeout=60)
    assert r.status_code == 200 and compiled == [grammar.utf8_classes("stayed[0-9]")], (r.text, compiled)


def test_a_tools_parameters_are_bounded_as_compiled_closed_to_their_properties():
    """A tool's parameters are compiled closed to their properties (tools.arguments_schema), so the bound on open
    objects' property names does not apply to them: 60 parameters of 10-character names pass; as a grammar they
    would not."""
    from hqtflow.runtime import tools

    params = {"type": "object", "properties": {f"p{i:02d}" + "q" * 7: {"type": "integer"} for i in range(60)}}
    assert tools.parameters_problem(params) is None
    assert "objects open to other properties" in grammar.schema_problem(params)


def test_a_server_prepares_its_grammar_compiler_at_start(lm):
    """A server's first grammar waited for xgrammar's import and the vocabulary's reading (~1.4 s for SmolLM2's,
    where an open object compiles in ~20 ms, and a repeat is a cache hit); the server's start does them now, on the
    grammar's thread, so the first request finds its tokenizer's compiler built."""
    import copy

    from hqtflow.runtime.api import logits_width
    from hqtflow.runtime.server import ServeSettings, create_app

    model, tok = lm[0], copy.deepcopy(lm[1])  # a tokenizer no compiler was built for yet
    app = create_app(model, tok, ServeSettings(max_input_tokens=32, max_total_tokens=64))
    with running(app):
        if (prepared := getattr(app.state, "grammar_prepared", None)) is not None:
            prepared.result(timeout=60)
        hits = grammar._compiler.cache_info().hits
        grammar._compiler(tok, logits_width(model))
        assert grammar._compiler.cache_info().hits == hits + 1
