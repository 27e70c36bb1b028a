"""What a grammar lets through: every output a model could write under it (a random walk over the tokens its masks
allow, multi-character tokens included) ends as text that parses and holds to the schema or regex; what it cannot
hold the output to is a 422 naming it; a model whose logits are wider than its tokenizer gets grammars too."""

import json
import random
import re

import httpx
import pytest
import torch

from conftest import _served, client_lib, running
from hqtflow.runtime import grammar
from hqtflow.runtime.grammar import GrammarError, compile_grammar, mask_logits, matcher
from hqtflow.runtime.server import ServeSettings, create_app


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def walk(tok, compiled, seed: int, width: int | None = None, steps: int = 200, raw: bool = False) -> str | bytes | None:
    """A random walk through the tokens the grammar allows, as the engine masks them; the decoded text once the
    grammar ends (`raw`: its bytes, undecoded; None: cut by `steps`)."""
    rng, m, out = random.Random(seed), matcher(compiled), []
    for _ in range(steps):
        logits = torch.zeros(width or len(tok))
        mask_logits(m, logits)
        allowed = torch.nonzero(logits == 0).flatten().tolist()
        t = rng.choice(allowed)
        assert m.accept_token(t)
        if m.is_terminated():
            return token_bytes(tok, out) if raw else tok.decode(out)
        out.append(t)
    return None


@pytest.fixture(scope="module")
def padded(tiny_factory, tokenizer_dir):
    """The tiny Llama with 64 lm_head rows more than its tokenizer has tokens (as Qwen2.5 and Phi-3 have)."""
    from transformers import AutoTokenizer

    return _served(tiny_factory("llama", vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)) + 64))


def test_a_model_with_more_logits_than_tokens_gets_grammars(padded):
    model, tok = padded
    assert model.get_output_embeddings().out_features == len(tok) + 64
    with running(create_app(model, tok, ServeSettings(max_input_tokens=32, max_total_tokens=64))) as url:
        r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {
            "max_new_tokens": 8, "do_sample": True, "seed": 1, "grammar": {"type": "regex", "value": "[0-9]{3}"}}}, timeout=120)
        assert r.status_code == 200 and r.json()["generated_text"].isdigit(), r.text
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 6, "response_format": {"type": "json_object"}}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{"), r.text


def test_the_padded_ids_are_never_allowed_and_masks_of_another_width_fail_in_one_sentence(tok):
    width = len(tok) + 64
    compiled = compile_grammar(tok, "regex", "[0-9]{3}", vocab_size=width)
    logits = torch.zeros(width)
    mask_logits(matcher(compiled), logits)
    assert torch.isinf(logits[len(tok):]).all() and (logits[: len(tok)] == 0).any()
    with pytest.raises(GrammarError) as e:  # a grammar compiled for the tokenizer's length, on the wider logits
        mask_logits(matcher(compile_grammar(tok, "regex", "[0-9]{3}")), torch.zeros(width))
    assert str(e.value) == f"the grammar could not mask the model's {width} logits"


def accepts(tok, compiled, text: str) -> bool:
    """Whether the grammar takes `text` and may end there."""
    m = matcher(compiled)
    return m.accept_string(text) and m.accept_token(tok.eos_token_id)


def strings(value, schema):
    """(string, its schema) for each string the schemas below bound."""
    if schema.get("type") == "string":
        yield value, schema
    for k, sub in schema.get("properties", {}).items():
        yield from strings(value[k], sub)


BOUNDED = [
    {"type": "string", "maxLength": 8},
    {"type": "string", "minLength": 2},
    {"type": "string", "minLength": 1, "maxLength": 4},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", BOUNDED, ids=lambda s: json.dumps(s)[:60])
def test_a_length_bounded_string_is_always_valid_json(tok, schema):
    """xgrammar 0.2.9's length-bounded string let raw control characters through ("a<TAB>b": not JSON)."""
    compiled = compile_grammar(tok, "json", schema)
    ended = 0
    for seed in range(60):
        if (text := walk(tok, compiled, seed, raw=True)) is None:
            continue
        ended += 1
        value = strict_json(text)  # raises on a raw control character
        for s, sub in strings(value, schema):
            assert sub.get("minLength", 0) <= len(s) <= sub.get("maxLength", 10**9), text
    assert ended >= 30
    if schema.get("type") == "string":
        assert not accepts(tok, compiled, '"a\tb"') and not accepts(tok, compiled, '"a\x01b"')
        assert accepts(tok, compiled, '"a\\tb"') and accepts(tok, compiled, '"\\u00e9\\""')  # escapes count as one


def stand_ins() -> dict[int, str]:
    """Each byte's printable stand-in in a byte-level tokenizer's tokens (GPT-2's)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(b for b in range(256) if b not in printable)}


def byte_tokens(tok) -> dict[int, int]:
    """Each byte's token in the byte-level tokenizer."""
    return {b: tok.convert_tokens_to_ids(c) for b, c in stand_ins().items()}


def token_bytes(tok, ids: list[int]) -> bytes:
    """The bytes the byte-level tokenizer's tokens stand for (tok.decode would turn bytes that are not UTF-8 into
    U+FFFD)."""
    byte = {c: b for b, c in stand_ins().items()}
    return bytes(byte[c] for t in tok.convert_ids_to_tokens(ids) for c in t)


def strict_json(raw: bytes):
    """The JSON value of output bytes, refused (ValueError) unless they are UTF-8 and it holds no lone surrogate."""
    value = json.loads(raw.decode("utf-8"))  # strict UTF-8: a surrogate's bytes (ED A0 80) raise
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate (escaped "\\ud800") raises
    return value



@pytest.mark.parametrize("kind, schema, before", [
    ("json", {"type": "string"}, '"'),
    ("json", {"type": "string", "maxLength": 4}, '"'),
    ("json_object", None, '{"'),  # a key of any object
    ("json", {"type": "object", "additionalProperties": {"type": "string"}}, '{"k": "'),
    ("json", {"type": "string", "format": "json-pointer"}, '"/'),
])
def test_a_string_never_takes_a_surrogates_bytes(tok, kind, schema, before):
    """xgrammar's string characters took U+D800-DFFF, whose UTF-8 bytes (ED A0 80) are not UTF-8: one "character"
    decoded as three U+FFFD (past a maxLength). The character before the surrogates (U+D7FF) still passes."""
    ids, compiled = byte_tokens(tok), compile_grammar(tok, kind, schema)

    def takes(raw: bytes) -> bool:
        m = matcher(compiled)
        return m.accept_string(before) and all(m.accept_token(ids[b]) for b in raw)

    assert takes("\ud7ff\ue000\U0001f600".encode()) and takes(b"\xed\x9f")
    assert not takes(b"\xed\xa0") and not takes(b"\xed\xbf")


@pytest.mark.parametrize("kind, value, before", [
    ("json", {"type": "string", "pattern": "^.{1,8}$"}, '"'),
    ("json", {"type": "string", "pattern": "^[^a]+$"}, '"'),
    ("json", {"type": "string", "pattern": "^\\W+$"}, '"'),
    ("json", {"type": "string", "pattern": "^[\\s\\S]+$"}, '"'),
    ("json", {"type": "string", "pattern": "^[\\u0080-\\uffff]+$"}, '"'),
    ("json", {"type": "object", "properties": {"p": {"type": "string", "pattern": "^(a|.)+$"}}}, '{"p": "'),
    ("regex", "[^a]+", ""),
])
def test_a_pattern_never_takes_a_surrogates_or_overlong_bytes(tok, kind, value, before):
    """A pattern's `.`, negated classes and shorthands, and a range across U+D800-DFFF, took the surrogates' bytes
    (ED A0 80: not UTF-8), and a range across two UTF-8 lengths overlong bytes (E0 9A 92 for U+0692, F0 8F BF BF):
    they are rewritten without them. The characters either side (U+D7FF, U+E000, U+0800) still pass."""
    ids, compiled = byte_tokens(tok), compile_grammar(tok, kind, value)

    def takes(raw: bytes) -> bool:
        m = matcher(compiled)
        return m.accept_string(before) and all(m.accept_token(ids[b]) for b in raw)

    assert takes("\ud7ff".encode()) and takes("\ue000".encode()) and takes(b"\xed\x9f") and takes("\u0800".encode())
    assert not takes(b"\xed\xa0") and not takes(b"\xed\xbf") and not takes(b"\xe0\x9a") and not takes(b"\xe0\x80")
    if kind != "regex" and "\\uffff" not in value.get("pattern", ""):
        assert takes("\U0001f600".encode()) and not takes(b"\xf0\x8f")


def test_a_class_with_braced_code_points_keeps_its_meaning(tok):
    """xgrammar reads `\\u{41}` as "A"; the rewrite of classes (utf8_classes) read `[\\u{41}\\u{42}]` as `\\u`,
    `{`, `4`, ... and took "u" but not "A"."""
    compiled = compile_grammar(tok, "json", {"type": "string", "pattern": "^[\\u{41}\\u{42}]+$"})
    assert accepts(tok, compiled, '"AB"') and not accepts(tok, compiled, '"u"') and not accepts(tok, compiled, '"{"')
    compiled = compile_grammar(tok, "json", {"type": "string", "pattern": "^[\\u{41}-\\u{5a}]+$"})
    assert accepts(tok, compiled, '"AZB"') and not accepts(tok, compiled, '"u"')


@pytest.mark.parametrize("pattern, named", [("^\\ud800$", "\\ud800"), ("^[a\\udc00]+$", "\\udc00"),
                                            ("^[\\ud800-\\udbff]$", "\\ud800-\\udbff")])
def test_a_pattern_naming_a_surrogate_is_refused(tok, pattern, named):
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, "json", {"type": "string", "pattern": pattern})
    assert str(e.value) == (f"the JSON schema has a `pattern` that names {named!r}, a UTF-16 surrogate (U+D800-DFFF), "
                            "which no UTF-8 text holds (at the root)")


@pytest.mark.parametrize("regex, named", [("[\\u{110000}]", "\\u{110000}"),
                                          ("[\\u{0}-\\u{FFFFFFFF}]+", "\\u{0}-\\u{FFFFFFFF}"),
                                          ("a\\u{10FFFF}\\u{110000}", "\\u{110000}")])
def test_a_code_point_beyond_unicode_is_refused(tok, regex, named):
    """xgrammar forced the bytes F4 90 80 80 (not UTF-8) for U+110000: the answer came back as U+FFFD, matching
    nothing the regex asked for. U+10FFFF, the last code point, is taken."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, "regex", regex)
    assert f"names {named!r}, beyond U+10FFFF, the last Unicode code point" in str(e.value)
    compile_grammar(tok, "regex", "a\\u{10FFFF}")


def test_a_date_has_its_months_days(tok):
    """xgrammar's date took any day 01-31 in any month (2021-02-31, 2021-04-31, 1900-02-29): a date now has its
    month's days, February's 29th in leap years only, alone, in a date-time and in an object's property."""
    import datetime

    day = compile_grammar(tok, "json", {"type": "string", "format": "date"})
    for year in (1900, 2000, 2021, 2024):
        for month in range(1, 13):
            for d in range(1, 32):
                text = f"{year:04d}-{month:02d}-{d:02d}"
                try:
                    valid = bool(datetime.date.fromisoformat(text))
                except ValueError:
                    valid = False
                assert accepts(tok, day, json.dumps(text)) == valid, text
    stamp = compile_grammar(tok, "json", {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}})
    assert accepts(tok, stamp, '{"at": "2024-02-29T23:59:59Z"}') and not accepts(tok, stamp, '{"at": "2023-02-29T23:59:59Z"}')
    assert not accepts(tok, stamp, '{"at": "2023-06-31T00:00:00+01:00"}') and accepts(tok, stamp, '{"at": "2023-07-31T00:00:00Z"}')


@pytest.mark.parametrize("pattern, named", [
    ('^a"b$', '"'), ("^C:\\\\x$", "\\\\"), ("^a\\tb$", "\\t"), ("^[\\n]$", "\\n"), ("^\\u0022$", "\\u0022"),
    ("^\\x5c$", "\\x5c"), ("^a\tb$", "\t"), ('^(x|")$', '"'), ("^a\\u{22}$", "\\u{22}"), ("^[\\u{9}]$", "\\u{9}"),
])
def test_a_pattern_naming_a_quote_backslash_or_control_character_is_refused(tok, pattern, named):
    """xgrammar writes a pattern's literal characters raw between the quotes: `^a"b$` gave `"a"b"` (not JSON), and so
    did `^a\\u{22}$` (xgrammar reads `\\u{22}` as a quote; it passed as `\\u` and `{22}`)."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, "json", {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}})
    assert str(e.value).startswith(f"`pattern` {pattern!r} (at /properties/p) names {named!r}, a quote"), str(e.value)


@pytest.mark.parametrize("pattern", ["^.{1,8}$", "^[^a]+$", "^[ -~]{1,6}$", "^\\S{1,5}$", '^[^"\\\\]{2}$', "^\\W{1,4}$"])
def test_classes_in_a_pattern_never_write_a_quote_backslash_or_control_character(tok, pattern):
    """(classes as xgrammar reads them: ASCII shorthands, `\\W` takes "é")"""
    compiled = compile_grammar(tok, "json", {"type": "string", "pattern": pattern})
    ended = 0
    for seed in range(40):
        if (text := walk(tok, compiled, seed, raw=True)) is None:
            continue
        ended += 1
        value = strict_json(text)
        assert re.fullmatch(pattern.strip("^$"), value, re.ASCII), text
        assert not re.search(r'["\\\x00-\x1f]', value), text
    assert ended >= 20


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, "`maxLength` beside `pattern` (at the root)"),
    ({"type": "string", "format": "date", "minLength": 30}, "`minLength` beside `format` (at the root)"),
    ({"$defs": {"s": {"const": "toolong"}}, "$ref": "#/$defs/s", "maxLength": 3}, "`maxLength` beside `$ref` (at the root)"),
    ({"properties": {"a": {"$ref": "#/$defs/s", "type": "integer"}}, "$defs": {"s": {"type": "string"}}},
     "`type` beside `$ref` (at /properties/a)"),
])
def test_what_xgrammar_would_drop_is_refused_naming_it(tok, schema, message):
    """xgrammar ignored these (the length bounds with a warning on the server's stderr): `^abcdef$` with maxLength 3
    gave "abcdef"."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, "json", schema)
    assert str(e.value).startswith(message + " is not enforced by the grammar"), str(e.value)


@pytest.mark.parametrize("fmt, valid, invalid", [
    ("time", ["23:59:59Z", "00:00:00.5+01:30", "12:34:56-23:59"], ["12:00:60Z", "22:59:60Z", "24:00:00Z", "12:00:00"]),
    ("date-time", ["2024-02-29T23:59:59Z"], ["2024-01-01T12:00:60Z", "2024-01-01T23:59:60+01:00"]),
    ("ipv4", ["0.0.0.0", "10.0.0.1", "100.200.249.9", "255.255.255.255"], ["01.2.3.4", "1.2.3.04", "1.002.3.4", "256.1.1.1"]),
    ("ipv6", ["::1", "::ffff:1.2.3.4", "1:2::255.0.10.100"], ["::ffff:01.2.3.4", "1:2::03.4.5.6", "1::2::3"]),
    ("hostname", ["a", "A-1", "a--b", "ab-c-d", "1.2.3.4", "x" * 63, ".".join(["x" * 63] * 3 + ["x" * 61])],
     ["x" * 64, "xn--a", "ab--cd", "-a", "a-", "a..b", "a.", "a_b", ".".join(["x" * 63] * 3 + ["x" * 62])]),
    ("email", ["a@b.c", "first.last@mail.example.co.uk", "!#$%&'*+/=?^_`{|}~-@b.cd", "x" * 64 + "@b.c",
               "x" * 64 + "@" + ".".join(["y" * 46] * 4), "a@test.tests"],
     ["x" * 65 + "@b.c", ".a@b.c", "a.@b.c", "a..b@c.d", "a@" + "x" * 47 + ".cd", "a@xn--ab.cd", "a@b.xn--kva",
      "a@b-.cd", "a@-b.cd", "a@b_c.d", "a b@c.d", "a", "a@b", "a@b.c.d.e.f", "a@b.test", "a@b.LocalHost", "a@b.c1"]),
])
def test_a_format_is_held_exactly(tok, fmt, valid, invalid):
    """xgrammar took a leap second at any minute (12:00:60Z: RFC 3339 has one only at 23:59:60 UTC; hqtflow's time has
    none), IPv4 octets with a leading zero (01.2.3.4, in an ipv6's dotted tail too), and hostname and email labels of
    more than 63 characters, `xn--a`, `ab--cd` and local parts of more than 64 characters (jsonschema_rs refuses each),
    and email domains pydantic's EmailStr refuses (`a@b`, `a@b.test`). Narrower than the standard: at most 4 labels
    of a hostname; an email's domain labels of at most 46 characters, at most 4, the last of letters only."""
    compiled = compile_grammar(tok, "json", {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}})
    assert [v for v in valid if not accepts(tok, compiled, json.dumps({"v": v}))] == []
    assert [v for v in invalid if accepts(tok, compiled, json.dumps({"v": v}))] == []


def closing_walk(tok, compiled, seed: int, steps: int = 96) -> bytes | None:
    """A random walk that takes a token closing the string (one with a quote, or the end) ever more often; its bytes
    once the grammar ends (None: cut by `steps`)."""
    rng, m, out, quote = random.Random(seed), matcher(compiled), [], stand_ins()[ord('"')]
    for step in range(steps):
        logits = torch.zeros(len(tok))
        mask_logits(m, logits)
        allowed = torch.nonzero(logits == 0).flatten().tolist()
        closing = [t for t in allowed if t == tok.eos_token_id or quote in tok.convert_ids_to_tokens(t)]
        t = rng.choice(closing if closing and rng.random() < step / steps else allowed)
        assert m.accept_token(t)
        if m.is_terminated():
            return token_bytes(tok, out)
        out.append(t)
    return None


@pytest.mark.parametrize("fmt", grammar.EXACT_FORMATS)
def test_what_a_held_format_writes_passes_a_format_validator(tok, fmt):
    """Random walks through each format the grammar holds (grammar.EXACT_FORMATS) end as strings jsonschema_rs's
    format check takes (before: `12:00:60Z` for a time, `01.2.3.4` for an ipv4)."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    schema = {"type": "string", "format": fmt}
    compiled, check = compile_grammar(tok, "json", schema), jsonschema_rs.validator_for(schema, validate_formats=True)
    values = [strict_json(raw) for seed in range(30) if (raw := closing_walk(tok, compiled, seed)) is not None]
    assert len(values) >= 10 and [v for v in values if not check.is_valid(v)] == []
    if fmt == "email":  # and pydantic's EmailStr (email-validator) takes them, as the openai client's parse() runs it
        validate_email = client_lib("email_validator").validate_email
        assert [validate_email(v, check_deliverability=False) for v in values]


def test_the_openai_clients_parse_of_an_email_field_gets_an_email(lm_long):
    """pydantic's EmailStr is `format: email`, which openai's `parse()` sends as a strict json_schema: it was a 422
    (the grammar refused email); now the reply parses as the model and its address passes the format check."""
    openai = client_lib("openai")
    client_lib("email_validator")  # pydantic's EmailStr needs it
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    from pydantic import BaseModel, EmailStr

    class Contact(BaseModel):
        email: EmailStr

    check = jsonschema_rs.validator_for({"type": "string", "format": "email"}, validate_formats=True)
    with running(create_app(*lm_long, ServeSettings(max_input_tokens=32, max_total_tokens=512))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        for seed in range(2):
            r = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              response_format=Contact, max_tokens=400, temperature=1.0, seed=seed)
            parsed = r.choices[0].message.parsed
            assert isinstance(parsed, Contact) and check.is_valid(parsed.email), r


@pytest.mark.parametrize("schema, message", [
    ({"type": "string", "format": "iri", "minLength": 2}, '`format` "iri" (at the root) is not held by the grammar (it holds date, '),
    ({"properties": {"e": {"type": "string", "format": "idn-email"}}}, '`format` "idn-email" (at /properties/e) is not held'),
    ({"type": "string", "format": "regex"}, '`format` "regex" (at the root) is not held'),
    ({"format": ["date"]}, '`format` ["date"] (at the root) is not held'),
    ({"format": "date"}, '`format` (at the root) needs `"type": "string"` beside it: the grammar holds a format on strings only'),
    ({"type": "string", "format": "date", "pattern": "^x$"}, "`pattern` beside `format` (at the root) is not enforced"),
    ({"type": "string", "format": "date", "enum": ["x"]}, "`enum` beside `format` (at the root) is not enforced"),
], ids=["iri", "idn-email", "regex", "a-list", "no-type", "pattern", "enum"])
def test_a_format_the_grammar_does_not_hold_is_refused_naming_it(tok, schema, message):
    """xgrammar ignored a format it does not know (OpenAPI's `password`, `int32`; a list was a TypeError) and one
    without `type` or beside a `pattern` or an `enum` (`"x"` for a date)."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, "json", schema)
    assert str(e.value).startswith(message), str(e.value)
    assert compile_grammar(tok, "json", {"type": ["string", "null"], "format": "date"})


def test_a_format_json_schema_does_not_define_is_an_annotation_except_in_strict_mode(tok):
    """pydantic's SecretStr ("password"), bytes ("binary") and IPvAnyAddress ("ipvanyaddress"), OpenAPI's int32: no
    validator checks them (JSON Schema: unknown formats are annotations), so the schema is held without them, its
    other keywords kept; OpenAI's strict mode takes its listed formats only, so there they are refused."""
    from hqtflow.runtime.grammar import strict_problem

    compiled = compile_grammar(tok, "json", {"type": "string", "format": "password", "minLength": 2})
    assert accepts(tok, compiled, '"ab"') and not accepts(tok, compiled, '"a"')
    assert compile_grammar(tok, "json", {"type": "integer", "format": "int32"})
    for fmt in ("binary", "ipvanyaddress"):
        assert compile_grammar(tok, "json", {"type": "object", "properties": {"x": {"type": "string", "format": fmt}}})
    strict = {"type": "object", "properties": {"p": {"type": "string", "format": "password"}}, "required": ["p"],
              "additionalProperties": False}
    assert strict_problem(strict).startswith('`format` "password" (at /properties/p) is not held by the grammar')


def test_a_ref_with_annotations_beside_it_compiles(tok):
    compiled = compile_grammar(tok, "json", {"$defs": {"s": {"enum": ["x", "y"]}}, "$ref": "#/$defs/s",
                                             "description": "one of two", "title": "S"})
    assert accepts(tok, compiled, '"x"') and not accepts(tok, compiled, '"z"')


def test_a_grammar_that_matches_nothing_is_refused_and_a_step_without_tokens_is_an_error(tok):
    """`[^\\s\\S]` gave a 424 NaN with sampling and a 200 "" (not matching it) greedy."""
    with pytest.raises(GrammarError, match=r"^the regex '\[\^\\\\s\\\\S\]' matches no text$"):
        compile_grammar(tok, "regex", r"[^\s\S]")
    m = matcher(compile_grammar(tok, "json", {"type": "string", "pattern": r"^[^\s\S]$"}))  # `"` first, then nothing
    assert m.accept_string('"')
    with pytest.raises(GrammarError, match="^the grammar allows no token here$"):
        mask_logits(m, torch.zeros(len(tok)))
    m = matcher(compile_grammar(tok, "regex", "ab"))
    assert m.accept_string("ab") and not m.is_terminated()  # only the end is left: the stop token is allowed
    logits = torch.zeros(len(tok))
    mask_logits(m, logits)
    assert torch.nonzero(logits == 0).flatten().tolist() == [tok.eos_token_id]


def test_a_regex_matching_nothing_is_a_422_on_the_server(lm):
    with running(create_app(*lm, ServeSettings(max_input_tokens=32, max_total_tokens=64))) as url:
        for sample in (True, False):
            r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {
                "max_new_tokens": 4, "do_sample": sample, "grammar": {"type": "regex", "value": "[^\\s\\S]"}}}, timeout=120)
            assert r.status_code == 422 and "matches no text" in r.json()["error"], r.text


@pytest.mark.parametrize("schema, message", [
    ({"type": []}, "`type` [] (at the root) is not a JSON Schema type or a non-empty list of them"),
    ({"properties": {"a": {"type": ["string", "text"]}}}, '`type` ["string", "text"] (at /properties/a) is not a JSON'),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, "`exclusiveMinimum` (at the root) is a boolean (draft 4)"),
    ({"type": "object", "properties": {"a": False, "b": {"type": "integer"}}},
     "a `false` schema (at /properties/a: the property may not be present) is not supported"),
])
def test_schemas_at_the_edges_are_refused_naming_the_keyword(tok, schema, message):
    """`{"type": []}` (invalid) was any value; a draft-4 boolean bound was "Value must be a number"; a property
    `false` was "Schema 'false' cannot accept any value"."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, "json", schema)
    assert str(e.value).startswith(message), str(e.value)


STRICT_OK = {"type": "object", "properties": {"a": {"type": ["string", "null"]}, "b": {"$ref": "#/$defs/b"}},
             "required": ["a", "b"], "additionalProperties": False,
             "$defs": {"b": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {}, "additionalProperties": False}]}}}


@pytest.mark.parametrize("schema, message", [
    ({"type": "object"}, "strict mode needs `additionalProperties: false` on every object (at the root)"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     "strict mode needs every property in `required` (at the root: 'a' is not)"),
    ({**STRICT_OK, "$defs": {"b": {"type": "object", "properties": {"c": {}}, "required": ["c"]}}},
     "strict mode needs `additionalProperties: false` on every object (at /$defs/b)"),
    ({"enum": ["yes", "no"]}, 'strict mode needs an object at the root (`"type": "object"`, not an `anyOf`)'),
    ({"type": "object", "anyOf": [STRICT_OK]}, "strict mode needs an object at the root"),
    ({**STRICT_OK, "properties": {"a": {"type": "string", "maxLength": 3}, "b": {}}},
     "`maxLength` (at /properties/a) is not supported in strict mode"),
    ({**STRICT_OK, "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}, "b": {}}},
     "`oneOf` (at /properties/a) is not supported in strict mode"),
    ({**STRICT_OK, "properties": {"a": {"type": "array", "uniqueItems": True}, "b": {}}},
     "`uniqueItems` (at /properties/a) is not supported in strict mode"),
])
def test_strict_schemas_keep_to_openais_strict_mode(schema, message):
    assert grammar.strict_problem(STRICT_OK) is None
    assert grammar.strict_problem(schema).startswith(message), grammar.strict_problem(schema)


def closed(props: dict) -> dict:
    """A strict object of these properties."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def nested(levels: int) -> dict:
    """`levels` objects, each the only property of the one around it."""
    schema = closed({})
    for _ in range(levels - 1):
        schema = closed({"a": schema})
    return schema


DEEP = "/properties/a" * 10


@pytest.mark.parametrize("schema, message", [
    (nested(11), f"strict mode allows at most 10 levels of nested objects (at {DEEP} is level 11)"),
    (closed({"a": {"type": "array", "items": nested(10)}}),
     f"strict mode allows at most 10 levels of nested objects (at /properties/a/items{DEEP[13:]} is level 11)"),
    ({**closed({"x": {"$ref": "#/$defs/d"}}), "$defs": {"d": nested(11)}},
     f"strict mode allows at most 10 levels of nested objects (at /$defs/d{DEEP} is level 11)"),
    (closed({f"p{i}": {"type": "integer"} for i in range(5001)}),
     "strict mode allows at most 5000 object properties in a schema (passed at the root)"),
    (closed({"a": {"enum": list(range(500))}, "b": {"enum": list(range(501))}}),
     "strict mode allows at most 1000 `enum` values in a schema (passed at /properties/"),
    ({**closed({"x": {"$ref": "#/$defs/" + "d" * 120_001}}), "$defs": {"d" * 120_001: {"type": "integer"}}},
     "strict mode allows at most 120000 characters of property names, definition names and `enum`/`const` values in "
     "a schema (passed at the root)"),
    (closed({"a": {"enum": [f"{i:03d}" + "x" * 57 for i in range(251)]}}),
     "strict mode allows at most 15000 characters in an `enum` of more than 250 strings (at /properties/a: 15060)"),
], ids=["nesting", "nesting-in-items", "nesting-in-defs", "properties", "enum-values", "characters", "large-enum"])
def test_strict_schemas_keep_to_openais_limits(schema, message):
    """OpenAI's documented limits on a strict schema (structured outputs, "Supported schemas") were not checked: 11
    levels of objects, a definition name of 120001 characters passed. Within them, a schema passes: 10 levels, from
    a definition too (a reference is not followed), 250 strings of 60 characters, 1000 enum values."""
    assert grammar.strict_problem(schema).startswith(message), grammar.strict_problem(schema)
    assert grammar.strict_problem(nested(10)) is None
    assert grammar.strict_problem({**closed({"x": {"$ref": "#/$defs/d"}, "y": nested(9)}), "$defs": {"d": nested(10)}}) is None
    assert grammar.strict_problem(closed({"a": {"enum": [f"{i:03d}" + "x" * 57 for i in range(250)]}})) is None
    assert grammar.strict_problem(closed({"a": {"enum": list(range(500))}, "b": {"enum": list(range(500))}})) is None


def test_strict_true_refuses_what_openais_strict_mode_refuses_on_the_server(lm):
    """`strict: true` took any schema the grammar holds (OpenAI answers a 400 for these); now a 422 naming the rule
    for response_format, TGI's json_schema grammar and a strict tool; without `strict` the same schema is served."""
    openai = pytest.importorskip("openai")
    open_ = {"type": "object", "properties": {"a": {"type": "integer"}}}
    with running(create_app(*lm, ServeSettings(max_input_tokens=32, max_total_tokens=64))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        for strict in (True, False):
            spec = {"name": "s", "strict": strict, "schema": open_}
            if strict:
                with pytest.raises(openai.UnprocessableEntityError) as e:
                    client.chat.completions.create(**ask, response_format={"type": "json_schema", "json_schema": spec})
                assert "`response_format`: strict mode needs `additionalProperties: false` on every object" in e.value.message
                with pytest.raises(openai.UnprocessableEntityError) as e:
                    client.chat.completions.create(**ask, tools=[{"type": "function", "function": {
                        "name": "f", "strict": True, "parameters": {**open_, "additionalProperties": False}}}])
                assert "`tools[0].function.parameters`: strict mode needs every property in `required`" in e.value.message
            else:
                client.chat.completions.create(**ask, response_format={"type": "json_schema", "json_schema": spec})
            r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {
                "max_new_tokens": 2, "grammar": {"type": "json_schema", "value": spec}}}, timeout=120)
            assert r.status_code == (422 if strict else 200), r.text
        ok = {"name": "s", "strict": True, "schema": STRICT_OK}
        client.chat.completions.create(**ask, response_format={"type": "json_schema", "json_schema": ok})
        for strict in (True, False):  # OpenAI's limits (11 levels of objects) and its rule for the name
            for spec in ({"name": "deep", "schema": nested(11)}, {"name": "a name", "schema": STRICT_OK}):
                fmt = {"type": "json_schema", "json_schema": {**spec, "strict": strict}}
                if not strict:
                    client.chat.completions.create(**ask, response_format=fmt)
                    continue
                with pytest.raises(openai.UnprocessableEntityError) as e:
                    client.chat.completions.create(**ask, response_format=fmt)
                assert e.value.message.endswith(
                    "`response_format.json_schema`: strict mode needs a `name` of 1 to 64 letters, digits, `_` or `-`. "
                    "Given: 'a name'" if spec["name"] == "a name" else
                    f"`response_format`: strict mode allows at most 10 levels of nested objects (at {DEEP} is level 11)"), e.value.message
            r = httpx.post(f"{url}/generate", json={"inputs": "x", "parameters": {
                "max_new_tokens": 2, "grammar": {"type": "json_schema", "value": {"name": "d", "strict": strict, "schema": nested(11)}}}}, timeout=120)
            assert r.status_code == (422 if strict else 200), r.text


@pytest.mark.parametrize("kind, value, message", [
    ("json", {"type": "string", "pattern": "^(?!admin)[a-z]+$"},
     "the JSON schema has a `pattern` that uses a lookahead (`(?=`, `(?!`), which the grammar would ignore (at the root)"),
    ("regex", "(?=x)[a-z]+", "the regex uses a lookahead"),
])
def test_a_lookahead_is_refused(tok, kind, value, message):
    """xgrammar ignored a lookahead (a warning on the server's stderr): `^(?!admin)[a-z]+$` took "admin". In a class
    or after an escaped parenthesis, `(?=` is no lookahead and compiles."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, kind, value)
    assert str(e.value).startswith(message), str(e.value)
    assert accepts(tok, compile_grammar(tok, "json", {"type": "string", "pattern": "^[(?!]\\(?=$"}), '"?(="')


@pytest.mark.parametrize("kind, value", [("json", {"type": "string", "pattern": "^\\x{41}$"}), ("regex", "a[\\x{41}]")])
def test_a_braced_x_escape_is_refused(tok, kind, value):
    """xgrammar reads `\\x{41}` as the letter x 41 times (in a class: x, {, 4, 1, }), not "A" as whoever wrote it
    meant (ECMAScript has no such escape; its braced one is `\\u{41}`): a 422 that names it, not a grammar that
    holds text to another pattern."""
    with pytest.raises(GrammarError) as e:
        compile_grammar(tok, kind, value)
    assert "writes `\\x{...}`, which the grammar reads as the letter x and a repetition count" in str(e.value)
    assert accepts(tok, compile_grammar(tok, "json", {"type": "string", "pattern": "^\\u{41}\\x42$"}), '"AB"')


def test_a_format_whose_rewrite_finds_nothing_to_rewrite_is_refused(monkeypatch):
    """The format rewrites match xgrammar 0.2.9's rules: on a version whose rules they no longer find, the format is
    refused (fail closed), not held by xgrammar's looser rule."""
    from hqtflow.runtime import grammar

    monkeypatch.setattr(grammar, "_exact_names", lambda ebnf: ebnf)
    grammar.held_formats.cache_clear()
    try:
        held = grammar.held_formats()
        assert "email" not in held and "hostname" not in held and {"date", "time", "ipv4"} <= set(held)
        assert grammar.format_problem({"type": "string", "format": "email"}, "at the root").startswith(
            '`format` "email" (at the root) is not held by the grammar')
    finally:
        grammar.held_formats.cache_clear()
