"""Constrained decoding with xgrammar (a maintained grammar engine): TGI's `grammar` ({"type": "json"|"regex"}),
OpenAI's `response_format` ({"type": "json_object"|"json_schema"}) and a tool call's schema (runtime/tools.py)
compile to a grammar once per tokenizer and schema; each request gets its own matcher, which masks the logits
before sampling and accepts each chosen token. A JSON schema using what xgrammar would not enforce is refused.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import torch

from hqtflow.errors import non_finite


class GrammarError(ValueError):
    pass


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's log prefix: time, source file and line
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")  # a regex's counted repetition


def available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed or broken
        return False
    return True


# the threads grammars compile on (one compile may take seconds of a core): their own, so compiles never take the
# threads that tokenize (anyio's shared pool) and never more than these cores; 1 on a machine of up to 7 cores
COMPILE_WORKERS = max(1, min(2, (os.cpu_count() or 1) // 4))
compile_pool = ThreadPoolExecutor(max_workers=COMPILE_WORKERS, thread_name_prefix="hqtflow-grammar")

CACHE_BYTES = 256 << 20  # compiled grammars kept per tokenizer, by size: one may take hundreds of MB


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer, vocab_size: int):
    """The compiler for a tokenizer and the model's logits width (`vocab_size`): a model's lm_head often has more
    rows than its tokenizer has tokens (Qwen2.5: 151936 for 151665); the ids past the tokenizer are never allowed."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_BYTES)


def prepare(tokenizer, vocab_size: int) -> None:
    """What a server's first grammar would wait for, done at its start (on the grammar's thread): importing xgrammar
    and reading the tokenizer's vocabulary (~1.4 s of a core for SmolLM2's 49152 tokens), then JSON mode's grammar
    (an open object: ~20 ms). Nothing without xgrammar."""
    if available():
        _compile_json(_compiler(tokenizer, vocab_size), '{"type": "object"}')


def _compile(tokenizer, kind: str, value: str, vocab_size: int):
    """Compiled once per schema or regex while it stays in the compiler's cache (xgrammar's, bounded in bytes)."""
    c = _compiler(tokenizer, vocab_size)
    try:
        if kind == "json_object":  # OpenAI's JSON mode: an object, never an array or a bare value
            kind, value = "json", '{"type": "object"}'
        if kind == "json":
            return _compile_json(c, value)
        if kind == "regex":
            return c.compile_regex(value)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError on a bad schema or regex
        raise GrammarError(f"{kind} grammar does not compile: {xgrammar_message(e)}") from None
    raise GrammarError(f"unknown grammar type {kind!r}")


# xgrammar 0.2.9's rule for one character of a string with minLength/maxLength: it lets raw control characters
# (TAB, \x01, ...: invalid JSON) through and allows no escape; replaced by JSON's string character
_BOUNDED_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.M)
_JSON_CHAR = r'(([^\0-\x1f\"\\\ud800-\udfff]) | ("\\" (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'
# xgrammar's classes of a string's characters (any other string character; json-pointer's "anything from DEL up")
# take the UTF-16 surrogates U+D800-DFFF, whose 3 UTF-8 bytes (ED A0 80 ...) are not UTF-8: the text got three
# U+FFFD for one character. Both are rewritten without them. (`\0` is never inside a quoted literal of the EBNF: a
# JSON literal's NUL is written `\u0000`.)
_SURROGATE_FREE = {r'[^\0-\x1f\"\\': r'[^\0-\x1f\"\\\ud800-\udfff',
                   r'[\x7f-\U0010ffff]': r'[\x7f-\ud7ff\ue000-\U0010ffff]'}


# xgrammar's date (format date, date-time's first part): 4 digits, a month 01-12 and a day 01-31 whatever the month
# (2021-02-31, 2021-04-31); replaced by a rule that takes each month's days, February's 29th in leap years only
_DATE = re.compile(r'(\w+)\{4, 4\} "-" (\w+) "-" (\w+)')
_DIGIT, _MONTH = '(([0-9]))', '(("0" [1-9]) | ("1" [0-2]))'
_DAY = '(("0" [1-9]) | ([1-2] [0-9]) | ("3" [01]))'
_EXACT_DATE = r'''
hqtflow_date ::= (hqtflow_year "-" hqtflow_month_day) | (hqtflow_leap_year "-02-29")
hqtflow_month_day ::= (hqtflow_month31 "-" hqtflow_day31) | (hqtflow_month30 "-" hqtflow_day30) | ("02-" hqtflow_day28)
hqtflow_day31 ::= hqtflow_day30 | "31"
hqtflow_day30 ::= hqtflow_day28 | "29" | "30"
hqtflow_month31 ::= ("0" [13578]) | ("1" [02])
hqtflow_month30 ::= ("0" [469]) | "11"
hqtflow_day28 ::= ("0" [1-9]) | ("1" [0-9]) | ("2" [0-8])
hqtflow_year ::= [0-9] [0-9] [0-9] [0-9]
hqtflow_leap_year ::= ([0-9] [0-9] (("0" [48]) | ([2468] [048]) | ([13579] [26]))) | ((([02468] [048]) | ([13579] [26])) "00")
'''


def _exact_dates(ebnf: str) -> str:
    """xgrammar's dates (_DATE, its year, month and day rules as xgrammar 0.2.9 writes them) as hqtflow_date."""
    rules = dict(re.findall(r"^(\w+) ::= (.*)$", ebnf, re.M))
    exact = (_DIGIT, _MONTH, _DAY)
    out = _DATE.sub(lambda m: "hqtflow_date" if tuple(rules.get(r) for r in m.groups()) == exact else m[0], ebnf)
    return out + _EXACT_DATE if out != ebnf else out


# xgrammar's second of a time (format time, date-time's last part): 00-59 or 60 at any minute (12:00:60Z), where RFC
# 3339 takes a leap second only at the last minute of a UTC day (23:59:60Z, 01:29:60+01:30); replaced by 00-59
_SECOND = re.compile(r'^(\w+) ::= \(\(\[0-5\] \[0-9\]\) \| \("6" "0"\)\)$', re.M)
# xgrammar's octet of an IPv4 address (format ipv4; an ipv6's dotted tail): 1-3 digits, a leading zero allowed
# (01.2.3.4 is no address); the rule, as xgrammar 0.2.9 writes each, with the helper rules it names
_OCTET = re.compile(r'^(\w+) ::= \(\("2" "5" \[0-5\]\) \| \("2" \[0-4\] \[0-9\]\) \| \((\w+) (\w+) \[0-9\]\)\)$', re.M)
_OCTET_HELPERS = ('("" | ([0-1]))', '("" | ([0-9]))')
_DOTTED_OCTET = re.compile(r'^(\w+) ::= \(\("2" "5" \[0-5\]\) \| \((\w+)\{0, 1\} \[0-9\]\)\)$', re.M)
_DOTTED_HELPER = re.compile(r'\(\("2" \[0-4\]\) \| \((\w+)\{0, 1\} \[0-9\]\)\)')
_EXACT_OCTET = '(("25" [0-5]) | ("2" [0-4] [0-9]) | ("1" [0-9] [0-9]) | ([1-9] [0-9]) | ([0-9]))'


def _exact_formats(ebnf: str) -> str:
    """xgrammar's second of a time (_SECOND) without the leap second, its IPv4 octets (_OCTET, _DOTTED_OCTET)
    without a leading zero."""
    ebnf = _SECOND.sub(lambda m: f"{m[1]} ::= (([0-5] [0-9]))", ebnf)
    rules = dict(re.findall(r"^(\w+) ::= (.*)$", ebnf, re.M))

    def octet(m):
        return f"{m[1]} ::= {_EXACT_OCTET}" if (rules.get(m[2]), rules.get(m[3])) == _OCTET_HELPERS else m[0]

    def dotted(m):
        helper = _DOTTED_HELPER.fullmatch(rules.get(m[2], ""))
        return f"{m[1]} ::= {_EXACT_OCTET}" if helper and rules.get(helper[1]) == '(("1"))' else m[0]

    return _DOTTED_OCTET.sub(dotted, _OCTET.sub(octet, ebnf))


# xgrammar's email and hostname (the rules as 0.2.9 writes them): labels of any length (64 characters, `xn--a`, `ab--c`:
# no hostname), a local part of any length, quoted local parts. Replaced by hqtflow_email and hqtflow_hostname,
# narrower than RFC 5321/1123 and never looser (jsonschema_rs's checks; for email, the email-validator that pydantic's
# EmailStr runs too). A hostname: 1-4 ASCII labels of 1-63 letters, digits and hyphens, none first or last nor at
# both the 3rd and 4th place (no `xn--` label), the 4th of at most 61 (253 characters in all). An email: a local part
# of 1-64 dot-atom characters, no dot first, last or twice in a row; a domain of 1-3 such labels of at most 46
# characters and a top-level label of 1-46 letters, not a special-use name (_SPECIAL_USE): 254 characters in all.
_EMAIL = re.compile(r'^(\w+) ::= \(\((\w+) "@" \[A-Za-z0-9\] (\w+) (\w+)\)\)$', re.M)
_EMAIL_DOMAIN = (r'("" | ([\-A-Za-z0-9]* [A-Za-z0-9]))', r'("" | ("." [A-Za-z0-9] [\-A-Za-z0-9]* [A-Za-z0-9] {}))')
_HOSTNAME = re.compile(r'^(\w+) ::= \(\(\[a-z0-9\] (\w+) (\w+)\)\)$', re.M)
_HOSTNAME_LABEL = r'("" | ([a-z0-9\-]* [a-z0-9]))'
_ATOM = r"[a-zA-Z0-9_!#$%&\'*+/=\?^`{|}~\-]"
_SPECIAL_USE = ("arpa", "invalid", "local", "localhost", "onion", "test")  # email-validator's, any case
_TLD_CHARS = 46


def _label(most: int) -> str:
    """A label of 1 to `most` characters (most >= 5), no hyphen first or last nor at both the 3rd and 4th place."""
    a, m = "[A-Za-z0-9]", "[A-Za-z0-9\\-]"
    return (f"({a}) | ({a} {a}) | ({a} {m} {a}) | ({a} {m} {m} {a}) | "
            f'({a} {m} (({a} {m}) | ("-" {a})) {m}{{0, {most - 5}}} {a})')


def _top_label() -> str:
    """Rules hqtflow_tld...: 1 to _TLD_CHARS letters, any case, but no word of _SPECIAL_USE (one rule per prefix of
    them: the letters that leave the prefixes go on freely)."""
    prefixes = sorted({w[:i] for w in _SPECIAL_USE for i in range(len(w) + 1)})
    rules = []
    for p in prefixes:
        nexts = sorted({w[len(p)] for w in _SPECIAL_USE if w.startswith(p) and len(w) > len(p)})
        others = "".join(c + c.upper() for c in "abcdefghijklmnopqrstuvwxyz" if c not in nexts)
        free = _TLD_CHARS - len(p) - 1
        alts = ([] if p in _SPECIAL_USE or not p else ['""'])
        alts.append(f"([{others}]" + (f" [A-Za-z]{{0, {free}}})" if free else ")"))
        alts += [f"([{c}{c.upper()}] hqtflow_tld_{p + c})" for c in nexts]
        rules.append(f"hqtflow_tld_{p} ::= {' | '.join(alts)}")
    return "\n".join(rules)


# the local part: one atom character, then hqtflow_local_63: up to 63 more, a dot only between two atom characters
_EXACT_EMAIL = f"""
hqtflow_email ::= {_ATOM} hqtflow_local_63 "@" hqtflow_label46 "." ("" | (hqtflow_label46 "." ("" | (hqtflow_label46 ".")))) hqtflow_tld_
hqtflow_hostname ::= hqtflow_label63 ("" | ("." hqtflow_label63 ("" | ("." hqtflow_label63 ("" | ("." hqtflow_label61))))))
hqtflow_label63 ::= {_label(63)}
hqtflow_label61 ::= {_label(61)}
hqtflow_label46 ::= {_label(46)}
{_top_label()}
hqtflow_local_0 ::= ""
hqtflow_local_1 ::= "" | ({_ATOM})
""" + "".join(f'hqtflow_local_{k} ::= "" | ({_ATOM} hqtflow_local_{k - 1}) | ("." {_ATOM} hqtflow_local_{k - 2})\n'
              for k in range(2, 64))


def _exact_names(ebnf: str) -> str:
    """xgrammar's email (_EMAIL) and hostname (_HOSTNAME) rules, recognised with their helper rules, as hqtflow's."""
    rules = dict(re.findall(r"^(\w+) ::= (.*)$", ebnf, re.M))

    def email(m):
        held = (rules.get(m[3]), rules.get(m[4])) == (_EMAIL_DOMAIN[0], _EMAIL_DOMAIN[1].format(m[4]))
        return f"{m[1]} ::= hqtflow_email" if held else m[0]

    def hostname(m):
        label = re.fullmatch(r'\("" \| \("\." \[a-z0-9\] (\w+) (\w+)\)\)', rules.get(m[3], ""))
        held = (label and label[2] == m[3] and rules.get(m[2]) == _HOSTNAME_LABEL
                and rules.get(label[1]) == _HOSTNAME_LABEL)
        return f"{m[1]} ::= hqtflow_hostname" if held else m[0]

    out = _HOSTNAME.sub(hostname, _EMAIL.sub(email, ebnf))
    return out + _EXACT_EMAIL if out != ebnf else out


def _compile_json(c, schema: str):
    """A JSON schema's grammar, through xgrammar's EBNF with its string characters rewritten: no surrogate
    (_SURROGATE_FREE), a length-bounded string's character rule replaced (_BOUNDED_CHAR), so a bounded string
    is always valid JSON (escapes count as one), dates held to their month's days (_exact_dates), times and IPv4
    octets to RFC 3339's and RFC 791's forms (_exact_formats), email and hostname to hqtflow's (_exact_names).
    Compiled once per EBNF text (the compiler's cache)."""
    return c.compile_grammar(_rewritten(_xgrammar_ebnf(schema)))


def _xgrammar_ebnf(schema: str) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=False))


def _rewritten(ebnf: str) -> str:
    """_compile_json's rewrites of xgrammar's EBNF."""
    for loose, strict in _SURROGATE_FREE.items():
        ebnf = ebnf.replace(loose, strict)
    ebnf = _exact_dates(_BOUNDED_CHAR.sub(lambda m: f"{m[1]} ::= {_JSON_CHAR}", ebnf))
    return _exact_names(_exact_formats(ebnf))


def _format_rewrites():  # the formats hqtflow's rewrites hold, each with the rewrites it needs
    return {"date": (_exact_dates,), "date-time": (_exact_dates, _exact_formats), "time": (_exact_formats,),
            "ipv4": (_exact_formats,), "ipv6": (_exact_formats,), "email": (_exact_names,), "hostname": (_exact_names,)}


@functools.cache
def held_formats() -> tuple[str, ...]:
    """EXACT_FORMATS less any a rewrite it needs finds nothing to rewrite for in this xgrammar's EBNF (they match
    xgrammar 0.2.9's rules; another version's would be held loosely, silently): those are refused instead."""
    needs = _format_rewrites()

    def held(fmt):
        ebnf = _xgrammar_ebnf(json.dumps({"type": "string", "format": fmt}))
        return all(fn(ebnf) != ebnf for fn in needs.get(fmt, ()))

    return tuple(f for f in EXACT_FORMATS if held(f))


def xgrammar_message(e: Exception) -> str:
    """xgrammar's error, without the time and source location its log prefix adds ("[09:45:41]
    /project/cpp/regex_converter.cc:94: "): what the client wrote wrong, not how the server was built."""
    return _LOG_PREFIX.sub("", str(e).splitlines()[0] if str(e) else type(e).__name__)[:200]


MAX_SCHEMA_DEPTH = 64
# a JSON schema's size: compiling costs ~10 ms and ~11 KB per object property, ~33 ms and ~45 KB per `anyOf` branch
# (a 1000-branch `anyOf` took 48 s), on the server's shared cores; enum values: OpenAI's limit for structured output
MAX_SUBSCHEMAS = 512
MAX_ENUM_VALUES = 1000
# What drives xgrammar's compile beyond that (measured on a 49152-token vocabulary, 2 shared cores; each bound keeps
# its worst case near 1-2 s): a string literal's length (an enum of 2 strings of 7500 characters took 8.7 s, 10 of
# 1500 1.3 s, 30 of 500 0.4 s); the property names of an object open to other properties (no `additionalProperties:
# false`), whose every character is a state of the "any other key" rule (~13 ms each: 256 characters took 3.4 s);
# a regex's counted repetition ({m,n}: `.{0,100}` took 1.6 s, `[^"]{1,300}` 5.8 s) and its length
MAX_LITERAL_CHARS = 500  # one enum/const string or property name
MAX_LITERALS_CHARS = 15_000  # every enum/const value and property name together (OpenAI's limit)
MAX_OPEN_KEY_CHARS = 512  # the property names of objects open to other properties, together (a pydantic model's
# schema is open: ~50 fields; at most ~7 s, on the grammar's own thread)
MAX_REGEX_CHARS = 2_000  # a regex or `pattern`
MAX_REGEX_REPEAT = 128  # a regex's counted repetitions, nested ones multiplied (`(a{0,10}){0,20}`: 200)
TOOLS_SCALE = 4  # a request's tools together (each within the limits above): their one call schema, 4x the limits


def repeat_size(regex: str) -> int:
    """The states a regex's counted repetitions ({n}, {m,}, {m,n}) unroll into in xgrammar: each counts its largest
    count, times what the repetitions inside its group count. A scan, not a parser: escapes and classes are skipped."""
    groups, inner, i = [0], 0, 0  # the count inside each open group; inside the last atom (0: a plain atom)
    while i < len(regex):
        ch, step = regex[i], 1
        if ch == "\\":  # one escape; \u{200} is one code point to xgrammar, but \x{41} is x repeated 41 times
            step, inner = len(m[0]) if regex.startswith("\\u{", i) and (m := _ESCAPE.match(regex, i)) else 2, 0
        elif ch == "[":  # a class, up to its closing bracket (a "]" first in it is a literal)
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            j += regex[j:j + 1] == "]"
            while j < len(regex) and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            step, inner = j + 1 - i, 0
        elif ch == "(":
            groups.append(0)
        elif ch == ")" and len(groups) > 1:
            inner = groups.pop()
            groups[-1] += inner
        elif ch == "{" and (m := _COUNT.match(regex, i)):
            count = max(int(m[1]), int(m[2] or 0))
            groups[-1] += inner * (count - 1) if inner else count  # a group's own count was added at its ")"
            step = m.end() - i
        else:
            inner = 0
        i += step
    return sum(groups)


def braced_x(regex: str) -> bool:
    """Whether a regex has a `\\x{` escape (not after an escaped backslash): not ECMAScript's (which has `\\u{...}`
    with the u flag), and xgrammar 0.2.9 reads it as the letter x then a count (`\\x{41}` is x, 41 times)."""
    i = 0
    while i < len(regex):
        if regex.startswith("\\x{", i):
            return True
        i += 2 if regex[i] == "\\" else 1
    return False


def lookahead(regex: str) -> bool:
    """Whether a regex has a lookahead (`(?=`, `(?!`) outside a class: xgrammar 0.2.9 ignores it (a warning on
    stderr), so `^(?!admin)[a-z]+$` took "admin". A scan, as repeat_size's: escapes and classes are skipped."""
    i = 0
    while i < len(regex):
        if regex[i] == "\\":
            i += 2
        elif regex[i] == "[":
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            j += regex[j:j + 1] == "]"
            while j < len(regex) and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i = j + 1
        elif regex.startswith(("(?=", "(?!"), i):
            return True
        else:
            i += 1
    return False


def regex_problem(regex: str) -> str | None:
    """Why a regex cannot be held to or is too costly to compile (None: neither): a lookahead, a `\\x{` escape
    (braced_x), a code point no UTF-8 text holds (unheld_atom), longer than MAX_REGEX_CHARS, or a counted repetition
    beyond MAX_REGEX_REPEAT."""
    if lookahead(regex):
        return "uses a lookahead (`(?=`, `(?!`), which the grammar would ignore"
    if braced_x(regex):
        return ("writes `\\x{...}`, which the grammar reads as the letter x and a repetition count, not a code point "
                "(write `\\u{...}` or `\\xHH`)")
    if problem := unheld_atom(regex):
        return problem
    if len(regex) > MAX_REGEX_CHARS:
        return f"is longer than {MAX_REGEX_CHARS} characters"
    if repeat_size(regex) > MAX_REGEX_REPEAT:
        return f"repeats more than {MAX_REGEX_REPEAT} times (counted repetitions such as {{0,{MAX_REGEX_REPEAT + 1}}}, nested ones multiplied)"
    return None


def depth(value) -> int:
    """How deep dicts and lists nest in a parsed JSON value (iterative: no recursion limit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


# keywords whose values are subschemas: a map of them, one (`items` as an object), or a list (`items` as a tuple,
# draft 4); the values of const, enum, default and examples are data
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains", "propertyNames", "not", "if", "then",
                 "else", "unevaluatedItems", "unevaluatedProperties")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# what xgrammar compiles but does not hold the output to (probed with its matcher on 0.2.9): refused rather than
# silently not enforced (multipleOf is held alone but not beside minimum; patternProperties lets a key repeat)
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
              "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$recursiveRef",
              "multipleOf", "patternProperties")
TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# what a `$ref` may have beside it: xgrammar follows the reference alone (2020-12 applies the siblings too)
REF_SIBLINGS = ("$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description", "default",
                "examples", "deprecated", "readOnly", "writeOnly")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def subschemas(schema):
    """(path, schema object) for a JSON schema and every schema within it (iterative: no recursion limit)."""
    todo = [("", schema)]
    while todo:
        path, s = todo.pop()
        if not isinstance(s, dict):
            continue
        yield path, s
        todo += [(p, v) for p, _, v in _children(path, s)]


def _children(path: str, s: dict) -> list[tuple[str, str, object]]:
    """(path, keyword, schema) for each schema directly within schema object `s`."""
    return [*((f"{path}/{k}/{n}", k, v) for k in SUBSCHEMA_MAPS if isinstance(s.get(k), dict) for n, v in s[k].items()),
            *((f"{path}/{k}", k, s[k]) for k in SUBSCHEMA_ONE if isinstance(s.get(k), dict)),
            *((f"{path}/{k}/{i}", k, v) for k in SUBSCHEMA_LISTS if isinstance(s.get(k), list) for i, v in enumerate(s[k]))]


def size_problem(schema, scale: int = 1) -> str | None:
    """Why a JSON schema is too large to compile on the server's shared cores (None: it is not): more than `scale`
    x MAX_SUBSCHEMAS subschemas or MAX_ENUM_VALUES enum values, or literals or patterns beyond their bounds
    (literal_problem)."""
    count = enums = 0
    for _, s in subschemas(schema):
        count += 1
        enums += len(s["enum"]) if isinstance(s.get("enum"), list) else 0
        if count > scale * MAX_SUBSCHEMAS:
            return f"more than {scale * MAX_SUBSCHEMAS} subschemas (properties, items, `anyOf` branches ...)"
        if enums > scale * MAX_ENUM_VALUES:
            return f"more than {scale * MAX_ENUM_VALUES} `enum` values"
    return literal_problem(schema, scale)


def literal_problem(schema, scale: int = 1) -> str | None:
    """Why a JSON schema's string literals or patterns would take too long to compile (None: they would not): an
    enum/const string or property name over MAX_LITERAL_CHARS, all of them together over `scale` x
    MAX_LITERALS_CHARS, the property names of objects open to other properties over `scale` x MAX_OPEN_KEY_CHARS,
    or a `pattern` regex_problem names."""
    total = open_keys = 0
    for path, s in subschemas(schema):
        where = f"at {path}" if path else "at the root"
        values = [*(s["enum"] if isinstance(s.get("enum"), list) else ()), *([s["const"]] if "const" in s else ())]
        names = list(s["properties"]) if isinstance(s.get("properties"), dict) else []
        for kind, v in [*(("`enum`/`const` string", v) for v in values), *(("property name", n) for n in names)]:
            if isinstance(v, str) and len(v) > MAX_LITERAL_CHARS:
                return f"a {kind} of more than {MAX_LITERAL_CHARS} characters ({where})"
            total += len(v) if isinstance(v, str) else len(json.dumps(v))
        if total > scale * MAX_LITERALS_CHARS:
            return f"more than {scale * MAX_LITERALS_CHARS} characters of `enum`/`const` values and property names"
        if s.get("additionalProperties") is not False:
            open_keys += sum(map(len, names))
            if open_keys > scale * MAX_OPEN_KEY_CHARS:
                return (f"more than {scale * MAX_OPEN_KEY_CHARS} characters of property names in objects open to other "
                        f"properties (give those objects `additionalProperties: false`)")
        if isinstance(s.get("pattern"), str) and (problem := regex_problem(s["pattern"])):
            return f"a `pattern` that {problem} ({where})"
    return None


# The string formats the grammar holds exactly, or narrower (probed against jsonschema_rs's format checks, xgrammar
# 0.2.9, with hqtflow's rewrites: a date's days, no leap second in a time, no leading zero in an IPv4 octet, email and
# hostname as _EXACT_EMAIL writes them). Any other `format` is refused: those xgrammar ignores (`idn-email`, `iri`,
# `regex`, OpenAPI's `password`, `int32`, ...).
SPEC_FORMATS = ("date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4",
                "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
                "relative-json-pointer", "regex")  # JSON Schema 2020-12's format vocabulary
EXACT_FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
                 "uri-template", "uuid", "json-pointer", "relative-json-pointer")


def format_problem(s: dict, where: str, strict: bool = False) -> str | None:
    """Why the grammar would not hold a schema object's `format` (None: it would, or there is none): a format of JSON
    Schema's (or, `strict`, as OpenAI's strict mode, any format) not among EXACT_FORMATS, on a schema that may not be
    a string, or beside what xgrammar drops for it (a `pattern`, length bounds, an `enum` or `const`, which it takes
    instead). A format JSON Schema does not define is an annotation, as validators take it: a plain string."""
    if "format" not in s:
        return None
    fmt = s["format"]
    held = held_formats()
    if not isinstance(fmt, str) or (fmt not in held and (strict or fmt in SPEC_FORMATS)):
        return f"`format` {json.dumps(fmt)[:80]} ({where}) is not held by the grammar (it holds {', '.join(held)})"
    if fmt not in held:  # not JSON Schema's (binary, password, int32): an annotation validators ignore
        return None
    if s.get("type") != "string" and not (isinstance(s.get("type"), list) and "string" in s["type"]):
        return f'`format` ({where}) needs `"type": "string"` beside it: the grammar holds a format on strings only'
    if bad := next((k for k in ("pattern", "minLength", "maxLength", "enum", "const") if k in s), None):
        return f"`{bad}` beside `format` ({where}) is not enforced by the grammar"
    return None


def schema_problem(schema, scale: int = 1) -> str | None:
    """Why the grammar would not hold output to a JSON schema (None: it would): the keywords above, `allOf` of more
    than one schema, a reference outside the schema or that does not
    resolve in it, `required` names that are not among the `properties`; or why it is too large (size_problem)."""
    if too_large := size_problem(schema, scale):
        return f"the JSON schema has {too_large}"
    if (key := non_finite(schema)) is not None:
        return f"the JSON schema holds a NaN or infinity (at {key}), which JSON does not have"
    for path, s in subschemas(schema):
        where = f"at {path}" if path else "at the root"
        if empty := next((k for k in ("anyOf", "oneOf", "allOf") if s.get(k) == []), None):
            return f"`{empty}` ({where}) is an empty list; JSON Schema needs at least one schema in it"
        integer = s.get("type") == "integer" or isinstance(s.get("type"), list) and "integer" in s["type"]
        if integer and (bound := next((k for k in BOUNDS if _number(s.get(k)) and abs(s[k]) >= 2**63), None)):
            return f"`{bound}` {s[bound]!r} ({where}) is beyond the 64-bit integers the grammar counts in"
        if bad := next((k for k in UNENFORCED if k in s), None):
            return f"`{bad}` ({where}) is not enforced by the grammar"
        if "type" in s and not (s["type"] in TYPES or isinstance(s["type"], list) and s["type"] and all(t in TYPES for t in s["type"])):
            return f"`type` {json.dumps(s['type'])[:80]} ({where}) is not a JSON Schema type or a non-empty list of them"
        if bad := next((k for k in ("exclusiveMinimum", "exclusiveMaximum") if isinstance(s.get(k), bool)), None):
            return f"`{bad}` ({where}) is a boolean (draft 4): give the bound itself as `{bad}`, as 2020-12 does"
        if false := next((f"/{k}/{n}" for k in SUBSCHEMA_MAPS if isinstance(s.get(k), dict) for n, v in s[k].items() if v is False), None):
            return f"a `false` schema (at {path}{false}: the property may not be present) is not supported by the grammar"
        if isinstance(s.get("$ref"), str) and (extra := next((k for k in s if k not in REF_SIBLINGS), None)):
            return f"`{extra}` beside `$ref` ({where}) is not enforced by the grammar (it follows the reference alone)"
        if problem := format_problem(s, where):
            return problem
        if "pattern" in s and (bound := next((k for k in ("minLength", "maxLength") if k in s), None)):
            return f"`{bound}` beside `pattern` ({where}) is not enforced by the grammar"  # (xgrammar drops them)
        if isinstance(s.get("pattern"), str) and (char := unsafe_literal(s["pattern"])):
            return (f"`pattern` {s['pattern'][:80]!r} ({where}) names {char!r}, a quote, backslash or control character, "
                    f"which the grammar would write unescaped into the JSON string (not JSON)")
        if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
            return f"`allOf` of more than one schema ({where}) is not enforced by the grammar"
        ref = s.get("$ref")
        if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            return f"`$ref` {ref[:80]!r} ({where}): only references within the schema (\"#/...\") are supported"
        if isinstance(ref, str) and not resolves(schema, ref):
            return f"`$ref` {ref[:80]!r} ({where}) does not resolve in the schema"
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        if isinstance(s.get("required"), list) and (ghost := [r for r in s["required"] if not isinstance(r, str) or r not in props]):
            return f"`required` ({where}) names {str(ghost[0])[:80]!r}, which is not one of its `properties`"
    return None


# OpenAI's strict structured outputs (`strict: true`): a subset of what the grammar holds to, refused beyond it, so a
# schema a strict request passes here passes there too: the keywords its rules name as unsupported, and its rules
OPENAI_NOT_STRICT = ("allOf", "oneOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                     "patternProperties", "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties",
                     "unevaluatedItems", "contains", "minContains", "maxContains", "uniqueItems", "prefixItems",
                     "minLength", "maxLength")


# OpenAI's limits on a strict schema (its structured outputs guide, "Supported schemas")
STRICT_MAX_PROPERTIES = 5000  # object properties, all objects together
STRICT_MAX_NESTING = 10  # objects within objects
STRICT_MAX_CHARS = 120_000  # property names, definition names, enum and const values together
STRICT_MAX_ENUM_VALUES = 1000  # all enums together
STRICT_LARGE_ENUM, STRICT_LARGE_ENUM_CHARS = 250, 15_000  # one string enum of more than 250 values: its characters


def _is_object(s: dict) -> bool:
    types = s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]
    return "object" in types or "properties" in s


def strict_problem(schema) -> str | None:
    """Why a JSON schema breaks OpenAI's strict mode (None: it does not), in one walk: its root not an object (or an
    `anyOf`), a keyword of OPENAI_NOT_STRICT, a format strict mode does not list, an object without
    `additionalProperties: false` or with a property missing from `required`, or beyond one of OpenAI's limits: more
    than STRICT_MAX_NESTING levels of objects (an object in another's properties, items, `anyOf` branches, ... is a
    level deeper; a definition in `$defs` counts from 1, and references are not followed: a recursive schema is
    allowed), more than STRICT_MAX_PROPERTIES properties, STRICT_MAX_ENUM_VALUES enum values, STRICT_MAX_CHARS
    characters of property names, definition names and enum/const values, or STRICT_LARGE_ENUM_CHARS in a string enum
    of more than STRICT_LARGE_ENUM values. Beside these, the grammar's own bounds (schema_problem) hold, tighter than
    some of OpenAI's."""
    if not isinstance(schema, dict) or schema.get("type") != "object" or "anyOf" in schema:
        return 'strict mode needs an object at the root (`"type": "object"`, not an `anyOf`)'
    props = enums = chars = 0
    todo = [("", schema, 0)]
    while todo:
        path, s, above = todo.pop()
        if not isinstance(s, dict):
            continue
        where = f"at {path}" if path else "at the root"
        if problem := _strict_rule_problem(s, where):
            return problem
        level = above + _is_object(s)
        if level > STRICT_MAX_NESTING:
            return f"strict mode allows at most {STRICT_MAX_NESTING} levels of nested objects ({where} is level {level})"
        names = list(s["properties"]) if isinstance(s.get("properties"), dict) else []
        defs = [n for k in ("$defs", "definitions") if isinstance(s.get(k), dict) for n in s[k]]
        values = [*(s["enum"] if isinstance(s.get("enum"), list) else ()), *([s["const"]] if "const" in s else ())]
        enum_chars = sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in values)
        props, enums = props + len(names), enums + (len(s["enum"]) if isinstance(s.get("enum"), list) else 0)
        chars += sum(map(len, names + defs)) + enum_chars
        if props > STRICT_MAX_PROPERTIES:
            return f"strict mode allows at most {STRICT_MAX_PROPERTIES} object properties in a schema (passed {where})"
        if enums > STRICT_MAX_ENUM_VALUES:
            return f"strict mode allows at most {STRICT_MAX_ENUM_VALUES} `enum` values in a schema (passed {where})"
        if chars > STRICT_MAX_CHARS:
            return (f"strict mode allows at most {STRICT_MAX_CHARS} characters of property names, definition names and "
                    f"`enum`/`const` values in a schema (passed {where})")
        strings = [v for v in (s["enum"] if isinstance(s.get("enum"), list) else ()) if isinstance(v, str)]
        if len(strings) > STRICT_LARGE_ENUM and sum(map(len, strings)) > STRICT_LARGE_ENUM_CHARS:
            return (f"strict mode allows at most {STRICT_LARGE_ENUM_CHARS} characters in an `enum` of more than "
                    f"{STRICT_LARGE_ENUM} strings ({where}: {sum(map(len, strings))})")
        todo += [(p, v, 0 if k in ("$defs", "definitions") else level) for p, k, v in _children(path, s)]
    return None


def _strict_rule_problem(s: dict, where: str) -> str | None:
    """Which of strict mode's rules one schema object breaks (None: none): a keyword it does not support, a format
    it does not list, or an object without `additionalProperties: false` or with a property missing from `required`."""
    if bad := next((k for k in OPENAI_NOT_STRICT if k in s), None):
        return f"`{bad}` ({where}) is not supported in strict mode"
    if problem := format_problem(s, where, strict=True):  # strict mode takes its listed formats only
        return problem
    if not _is_object(s):
        return None
    if s.get("additionalProperties") is not False:
        return f"strict mode needs `additionalProperties: false` on every object ({where})"
    props, required = s.get("properties") or {}, s.get("required") or []
    if missing := next((n for n in props if n not in required), None):
        return f"strict mode needs every property in `required` ({where}: {missing[:80]!r} is not)"
    return None


_ESCAPE = re.compile(r"\\(?:c.|u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", re.S)  # `\x{` refused
_CONTROL_ESCAPES = set('\\"tnrfvae0c')  # \\, \", \t ... \0 and \cX


def unsafe_literal(pattern: str) -> str | None:
    """The first character a `pattern` names that JSON must escape (`"`, `\\`, a control character), outside a
    negated class; None if there is none. xgrammar (0.2.9) matches a `pattern` against the raw text between the
    quotes: `.`, shorthands, ranges and negated classes leave those characters out, but a literal one (`a"b`, `\\\\`,
    `\\t`, `[\\n]`) would be written as is."""
    i, negated = 0, None  # None: outside a class
    while i < len(pattern):
        if negated is None and pattern[i] == "[":
            negated = pattern[i + 1:i + 2] == "^"
            i += 1 + negated
            i += pattern[i:i + 1] == "]"  # a "]" first in a class is a literal
            continue
        if negated is not None and pattern[i] == "]":
            negated, i = None, i + 1
            continue
        token = m[0] if pattern[i] == "\\" and (m := _ESCAPE.match(pattern, i)) else pattern[i]
        if not negated and _unsafe(token):
            return token
        i += len(token)
    return None


def _unsafe(token: str) -> bool:
    if len(token) == 1:
        return token == '"' or token < " "
    if token[1] in "xu" and len(token) > 2:
        code = int(token[2:].strip("{}"), 16)
        return code < 0x20 or code in (0x22, 0x5C)
    return token[1] in _CONTROL_ESCAPES


_NAMED_CODES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "a": 7, "e": 27, "0": 0, "b": 8}  # `\b` in a class
# xgrammar's shorthands (probed on 0.2.9): \d and \w ASCII, \s ECMAScript's white space; as code point ranges
_SHORTHANDS = {"\\d": [(0x30, 0x39)], "\\w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
               "\\s": [(0x9, 0xD), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                       (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]}
_UTF8_LENGTHS = ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, 0x10FFFF))  # code points of 1, 2, 3, 4 bytes


def _atom(regex: str, i: int) -> str:
    """The character or escape (`\\u00e9`, `\\u{e9}`, `\\x41`, `\\w`, ...) that starts at `i`."""
    return m[0] if regex[i] == "\\" and (m := _ESCAPE.match(regex, i)) else regex[i]


def _code(atom: str) -> int | None:
    """The code point an atom names (None: a shorthand such as `\\w`)."""
    if len(atom) == 1:
        return ord(atom)
    if atom[1] in "xu" and len(atom) > 2:
        return int(atom[2:].strip("{}"), 16)
    if atom[1] == "c" and len(atom) == 3:
        return ord(atom[2]) % 32
    if atom.lower() in _SHORTHANDS:
        return None
    return _NAMED_CODES.get(atom[1], ord(atom[1]))


def _shorthand(atom: str) -> list[tuple[int, int]]:
    """The code point ranges of a shorthand (`\\W`, `\\S`, `\\D`: the complement of `\\w`, `\\s`, `\\d`)."""
    ranges = _SHORTHANDS[atom.lower()]
    return _complement(ranges) if atom[1].isupper() else ranges


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, start = [], 0
    for lo, hi in sorted(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    return out + [(start, 0x10FFFF)] * (start <= 0x10FFFF)


def _class_items(regex: str, i: int) -> tuple[bool, list[tuple[str, str | None]], int]:
    """The class that starts at `i` (a "["): whether it is negated, its items (an atom, or a range's two ends) and
    where it ends. A "]" first in it is a literal, as for repeat_size; a shorthand is no range's end (`[\\w-z]`)."""
    j = i + 1 + (regex[i + 1:i + 2] == "^")
    negated, items, first = j > i + 1, [], True
    while j < len(regex) and (regex[j] != "]" or first):
        lo, first = _atom(regex, j), False
        j += len(lo)
        if regex[j:j + 1] == "-" and j + 1 < len(regex) and regex[j + 1] != "]":
            hi = _atom(regex, j + 1)
            if _code(lo) is not None and _code(hi) is not None:
                items.append((lo, hi))
                j += 1 + len(hi)
                continue
        items.append((lo, None))
    return negated, items, j + 1


def unheld_atom(regex: str) -> str | None:
    """Why the first atom or range of a regex that names code points no UTF-8 text holds cannot be held to: one
    naming only UTF-16 surrogates (U+D800-DFFF), not in a negated class, or any reaching beyond U+10FFFF (xgrammar
    then forces bytes that are not UTF-8); None if there is none."""
    def why(text: str, lo: int | None, hi: int | None, negated: bool) -> str | None:
        if lo is None:
            return None
        if hi is None:
            hi = lo
        if hi > 0x10FFFF:
            return f"names {text!r}, beyond U+10FFFF, the last Unicode code point"
        if not negated and 0xD800 <= lo and hi <= 0xDFFF:
            return f"names {text!r}, a UTF-16 surrogate (U+D800-DFFF), which no UTF-8 text holds"
        return None

    i = 0
    while i < len(regex):
        if regex[i] == "[":
            negated, items, i = _class_items(regex, i)
            for lo, hi in items:
                if problem := why(f"{lo}-{hi}" if hi else lo, _code(lo), _code(hi) if hi else None, negated):
                    return problem
            continue
        atom = _atom(regex, i)
        if problem := why(atom, _code(atom), None, False):
            return problem
        i += len(atom)
    return None


def utf8_classes(regex: str) -> str:
    """The regex with each of its classes, `.` and negated shorthands (`\\W`, `\\S`, `\\D`) written as code point
    ranges of one UTF-8 length each, without the UTF-16 surrogates. xgrammar 0.2.9 takes the bytes of surrogates
    (ED A0 80 ...: not UTF-8) for `.`, a negated class or shorthand, and a range across them, and overlong bytes
    (E0 9A 92, F0 8F BF BF: not UTF-8) for a range across two UTF-8 lengths (`[\\u0080-\\uffff]`, `.` in a `pattern`);
    `[^a]` becomes `(?:[\\u0000-\\u0060\\u0062-\\u007f]|[\\u0080-\\u07ff]|...)`. For a regex unheld_atom finds
    nothing in."""
    out, i = [], 0
    while i < len(regex):
        if regex[i] == "[":
            start = i
            negated, items, i = _class_items(regex, i)
            ranges = [r for lo, hi in items for r in
                      (_shorthand(lo) if _code(lo) is None else [(_code(lo), _code(hi) if hi else _code(lo))])]
            if i > len(regex) or any(lo > hi for lo, hi in ranges):  # unclosed, or `[z-a]`: xgrammar's error
                out.append(regex[start:])
                break
            out.append(_utf8_ranges(_complement(ranges) if negated else ranges) or regex[start:i])  # none: as given
            continue
        atom = _atom(regex, i)
        i += len(atom)
        out.append(_utf8_ranges([(0, 0x10FFFF)]) if atom == "." else
                   _utf8_ranges(_shorthand(atom)) if atom in ("\\W", "\\S", "\\D") else atom)
    return "".join(out)


def _utf8_ranges(ranges: list[tuple[int, int]]) -> str:
    """Code point ranges as a regex: one class per UTF-8 length (alternatives of a group when several), without
    the surrogates; "" when none is left."""
    keep = [(a, b) for lo, hi in ranges for a, b in ((lo, min(hi, 0xD7FF)), (max(lo, 0xE000), hi)) if a <= b]
    classes = []
    for first, last in _UTF8_LENGTHS:
        parts = sorted((max(lo, first), min(hi, last)) for lo, hi in keep if lo <= last and hi >= first)
        merged = []
        for lo, hi in parts:
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        if merged:
            classes.append("[" + "".join(_u(lo) + (f"-{_u(hi)}" if hi > lo else "") for lo, hi in merged) + "]")
    return classes[0] if len(classes) == 1 else f"(?:{'|'.join(classes)})" if classes else ""


def _u(code: int) -> str:
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\u{{{code:x}}}"


def _patterns_in_utf8(schema):
    """A copy of a JSON schema whose every `pattern` is utf8_classes'."""
    schema = copy.deepcopy(schema)
    for _, s in subschemas(schema):
        if isinstance(s.get("pattern"), str):
            s["pattern"] = utf8_classes(s["pattern"])
    return schema


def resolves(schema, ref: str) -> bool:
    """Whether a local reference ("#" or a JSON pointer "#/a/b") names a schema within `schema`."""
    node = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isascii() and part.isdigit() and int(part) < len(node):  # "²".isdigit()
            node = node[int(part)]
        else:
            return False
    return isinstance(node, (dict, bool))


def compile_grammar(tokenizer, kind: str, value=None, scale: int = 1, vocab_size: int | None = None):
    """kind: "json" (value: a JSON schema, dict or string), "regex" (value: a regex) or "json_object" (any JSON
    object). JSON is written on one line, with ", " and ": " between items (as OpenAI's structured output): a grammar
    that allows any whitespace lets a small model pad with newlines until `max_tokens` cuts the JSON short. scale: the
    size limits' multiple (TOOLS_SCALE for a request's tools together). vocab_size: the width of the model's logits
    (default: the tokenizer's length), which the grammar's masks must match."""
    if not available():
        raise GrammarError("constrained output needs xgrammar (`pip install xgrammar`)")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
                raise GrammarError("the json grammar's `value` is not valid JSON") from None
        if depth(value) > MAX_SCHEMA_DEPTH:  # compiling takes seconds from ~300 levels (a cheap way to burn CPU)
            raise GrammarError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if problem := schema_problem(value, scale):
            raise GrammarError(problem)
        # keys in the order given: the grammar writes properties in that order
        grammar_value = json.dumps(_patterns_in_utf8(value))
    elif kind == "regex" and isinstance(value, str):
        if problem := regex_problem(value):
            raise GrammarError(f"the regex {problem}")
        grammar_value = utf8_classes(value)
    else:
        grammar_value = value
    compiled = _compile(tokenizer, kind, grammar_value, vocab_size or len(tokenizer))
    if not _allowed(matcher(compiled), vocab_size or len(tokenizer)).any():  # (`[^\s\S]`: sampling got NaN)
        raise GrammarError(f"the regex {value[:80]!r} matches no text" if kind == "regex" else "the JSON schema accepts no value")
    return compiled


def matcher(compiled):
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


def bitmask(vocab_size: int) -> torch.Tensor:
    """A bitmask of the tokens allowed next (1 x ceil(vocab_size / 32) int32, on the CPU, where xgrammar fills it):
    one per request, refilled at each of its steps."""
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(1, vocab_size)


def _allowed(m, vocab_size: int) -> torch.Tensor:
    """The matcher's bitmask of the tokens allowed next."""
    mask = bitmask(vocab_size)
    m.fill_next_token_bitmask(mask)
    return mask


def mask_logits(m, logits: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Set the logits of tokens the grammar forbids next to -inf, in place (1-D), where the logits are: xgrammar's
    apply_token_bitmask_inplace (its CPU kernel; elsewhere its plain torch ops on the bitmask copied there, not its
    Triton kernel, compiled at its first call), no copy of the logits.
    `mask`: the request's bitmask (`bitmask`), refilled here (default: a new one). xgrammar's own failures (a C++
    check, with its time and source path) become one GrammarError sentence, and so does a step that allows no token
    (sampling would draw from NaN, greedy would pick id 0)."""
    import xgrammar as xgr

    mask = bitmask(logits.numel()) if mask is None else mask
    try:
        m.fill_next_token_bitmask(mask)
        if mask.any():
            xgr.apply_token_bitmask_inplace(logits[None], mask.to(logits.device, non_blocking=True),
                                            backend="cpu" if logits.is_cpu else "torch_native")
    except Exception:  # noqa: BLE001 - xgrammar's RuntimeError names its build, not the request
        raise GrammarError(f"the grammar could not mask the model's {logits.numel()} logits") from None
    if not mask.any():
        raise GrammarError("the grammar allows no token here")
