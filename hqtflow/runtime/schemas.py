"""Request models (pydantic) for the TGI and OpenAI routes, and their translation to engine SamplingParams.

Every field of TGI's `GenerateParameters` and of OpenAI's completions/chat requests is declared: implemented, or
refused with a 422 that names it. Unknown fields are a 422 naming them too (extra="forbid"); null is "not given".
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError, ValidationInfo,
                      WithJsonSchema, model_validator)
from pydantic_core import PydanticCustomError

MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens
MAX_BEST_OF = 4
MAX_TOOLS = 128  # OpenAI's limit on a request's tools
TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name (and a strict json_schema's)


class ApiError(Exception):
    def __init__(self, status: int, message: str, error_type: str = "validation"):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type


def invalid(message: str) -> ApiError:
    return ApiError(422, f"Input validation error: {message}")


def openai_error(message: str, error_type: str, status: int) -> dict:
    """OpenAI's error body ({"error": {message, type, param, code}}; `param`: the first parameter the message
    names), which the openai client turns into its exception's message, param and code (a 429 as OpenAI's rate
    limit: type "requests", code "rate_limit_exceeded"; a failed generation, 424, a server error); and TGI's
    `error_type`, as TGI's own /v1 routes give, which text-generation's client maps to its ValidationError,
    OverloadedError, ..."""
    named = re.search(r"`([A-Za-z_][\w.\[\]]*)`", message) if status == 422 else None  # a failure's text names no parameter
    kind = "server_error" if status >= 500 or status == 424 else \
        {401: "authentication_error", 429: "requests"}.get(status, "invalid_request_error")
    code = "rate_limit_exceeded" if status == 429 else error_type
    return {"error": {"message": message, "type": kind, "param": named.group(1) if named else None, "code": code},
            "error_type": error_type}  # TGI's key beside OpenAI's object: TGI's clients raise their typed error


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request body larger than {limit} bytes (--payload-limit)")


async def read_body(request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes (--payload-limit) while it streams in
    (a chunked body has no content-length to check first)."""
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:  # gone during its upload: a cancelled request, not a server error
        raise ApiError(499, "Client closed the request", "cancelled") from None
    return b"".join(chunks)


def server_bounds(max_best_of: int, max_top_n_tokens: int) -> dict:
    """A server's own bounds on the fields its flags limit (--max-best-of, --max-top-n-tokens), for `parse`: they
    replace the fields' widest ones (MAX_BEST_OF, MAX_TOP_N_TOKENS), so a refusal quotes the limit in force."""
    return {"best_of": {"maximum": max_best_of}, "n": {"maximum": max_best_of}, "top_n_tokens": {"maximum": max_top_n_tokens}}


def parse(model: type[BaseModel], raw: bytes, bounds: dict | None = None) -> BaseModel:
    """Validate a JSON body, with the server's `bounds` (server_bounds) on the fields it limits; the first problem
    becomes TGI's 422 naming the field."""
    try:
        body = model.model_validate_json(raw, context={"bounds": bounds or {}})
    except ValidationError as e:
        raise _named(e) from None
    if twice := duplicate_key(raw):  # the parser keeps the last; TGI's (serde) refuses, and a client meant one of them
        raise invalid(f"duplicate field `{twice}`")
    return body


def duplicate_key(raw: bytes) -> str | None:
    """The first key given twice in one object of a (valid) JSON body, else None."""
    seen: list[str] = []

    def pairs(items):
        keys = [k for k, _ in items]
        if len(set(keys)) < len(keys) and not seen:
            seen.append(next(k for i, k in enumerate(keys) if k in keys[:i]))
        return None  # the objects themselves are not kept

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):  # (what pydantic's parser took, Python's takes too: not expected)
        return None
    return seen[0] if seen else None


def parse_part(model: type[BaseModel], value: dict, where: str) -> BaseModel:
    """Validate a part of a parsed body (a grammar's value); its problems are named from `where`."""
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise _named(e, where) from None


def _named(e: ValidationError, where: str = "") -> ApiError:
    """The first problem of a validation as TGI's 422, naming the field (under `where`)."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        if "number out of range" in err["msg"]:  # valid JSON: a number of thousands of digits
            return invalid("the body holds a number with more digits than can be read")
        deep = "recursion limit" in err["msg"]  # valid JSON, nested past the parser's limit
        return invalid("the body nests too deeply" if deep else "the body is not valid JSON")
    if err["type"] == "model_type" and not err["loc"]:
        return invalid("the body must be a JSON object")
    field = ""
    for x in [where] * bool(where) + [x for x in err["loc"] if not _union_tag(str(x))]:
        field += f"[{x}]" if isinstance(x, int) else f".{x}" if field else str(x)
    if err["type"] == "extra_forbidden":
        return invalid(f"`{field}` is not a supported parameter")
    if err["type"] == "missing":
        return invalid(f"`{field}` is required")
    if err["type"] == "refused":
        return invalid(f"`{'.'.join(filter(None, (field, err['ctx']['name'])))}` is not supported: {err['ctx']['why']}")
    msg = err["msg"].removeprefix("Value error, ")
    return invalid(msg if msg.startswith("`") else f"`{field or 'body'}`: {msg}")


def _union_tag(part: str) -> bool:
    """pydantic's name for a member of a Union in an error location (`str`, `list[int]`, ...), not a field."""
    return part in ("str", "int", "float", "bool", "dict", "list") or part.startswith(("list[", "dict["))


def _integral(v):
    """JSON Schema's integers include 2.0: taken as 2 (any other float stays a float, refused by the strict int)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Int = Annotated[int, BeforeValidator(_integral)]  # an integer field: strict (no "2", no true), but 2.0 is 2
def _u64(v):
    """A seed: a u64, as TGI's (checked here: pydantic words a bound this large as a float, 18446744073709552000)."""
    v = _integral(v)
    if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < 2**64:
        raise ValueError(f"Input should be >= 0 and <= {2**64 - 1} (a u64)")
    return v


Seed = Annotated[int, BeforeValidator(_u64),  # a u64, as TGI's
                 WithJsonSchema({"type": "integer", "minimum": 0, "maximum": 2**64 - 1})]


def _openai_seed(v):
    """OpenAI's seed, an int64 (negative seeds too: clients derive them from hashes), or a u64 as TGI's: taken
    modulo 2**64, the sampler's range (int64 seeds map one to one)."""
    v = _integral(v)
    if isinstance(v, int) and not isinstance(v, bool):
        if not -(2**63) <= v < 2**64:
            raise ValueError(f"Input should be >= {-(2**63)} (an int64) and <= {2**64 - 1} (a u64)")
        return v % 2**64
    return v


OpenAISeed = Annotated[int, BeforeValidator(_openai_seed),
                       WithJsonSchema({"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1})]


RANGE = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def bounded(default=None, **bounds) -> Any:
    """A number field with a range, given as JSON Schema's keywords (minimum, exclusiveMinimum, maximum,
    exclusiveMaximum): published
    so in /openapi.json, and checked by `Strict` from the same keywords (`out_of_range`)."""
    assert bounds and set(bounds) <= set(RANGE), bounds
    return Field(default, json_schema_extra=bounds)


def out_of_range(name: str, v, bounds: dict) -> str | None:
    """None if `v` is within `bounds`, else the refusal in TGI's words ("`top_k` must be strictly positive",
    "`top_p` must be > 0.0 and < 1.0. Given: 1.5")."""
    lo_open, hi_open = "exclusiveMinimum" in bounds, "exclusiveMaximum" in bounds
    lo, hi = bounds.get("exclusiveMinimum", bounds.get("minimum")), bounds.get("exclusiveMaximum", bounds.get("maximum"))
    if (lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or (v < hi if hi_open else v <= hi)):
        return None
    if lo == 0 and lo_open and hi is None:
        return f"`{name}` must be strictly positive"
    parts = ([f"{'>' if lo_open else '>='} {lo}"] if lo is not None else []) + ([f"{'<' if hi_open else '<='} {hi}"] if hi is not None else [])
    return f"`{name}` must be {' and '.join(parts)}. Given: {v}"


NOT_GIVEN = [None, False, [], {}]  # what a refused field may be: not given


def _published(schema: dict, model: type) -> None:
    """The JSON schema of a Strict model as the server reads it: a property that is not required may be null (not
    given), and so may an unknown one; a REFUSED one may only be not given."""
    if schema.get("additionalProperties") is False:  # an unknown field given as null is a field not given
        schema["additionalProperties"] = {"type": "null"}
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        doc = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
        if name not in required and {"type": "null"} not in prop.get("anyOf", ()):
            prop = {"anyOf": [prop, {"type": "null"}]}
        if name in model.REFUSED:
            prop = {"allOf": [prop], "enum": NOT_GIVEN, "description": f"not supported: {model.REFUSED[name]}"}
        schema["properties"][name] = {**doc, **prop}


class Strict(BaseModel):
    """Unknown fields are refused; REFUSED names declared fields refused when given (not null/false/empty); a
    field given as null is a field not given (its default); NaN and Infinity are refused (no range check sees them)."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=_published)
    REFUSED: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _refused(self):
        for name, why in self.REFUSED.items():
            if getattr(self, name) not in NOT_GIVEN:  # its own type, so the message names the field's whole path
                raise PydanticCustomError("refused", "`{name}` is not supported: {why}", {"name": name, "why": why})
        return self

    @model_validator(mode="after")
    def _ranges(self, info: ValidationInfo):
        """Every `bounded` field within its published range (the server's own bounds, given to `parse`, first)."""
        for name, field in type(self).model_fields.items():
            bounds = {k: v for k, v in (field.json_schema_extra or {}).items() if k in RANGE} \
                if isinstance(field.json_schema_extra, dict) else {}
            if bounds:
                bounds.update(server_limits(info).get(name, {}))
            value = getattr(self, name)
            if bounds and value is not None and (problem := out_of_range(name, value, bounds)):
                raise ValueError(problem)
        return self


def server_limits(info: ValidationInfo) -> dict:
    """The server's bounds `parse` gives the validators ({} when there are none)."""
    return (info.context or {}).get("bounds") or {}


Stop = Union[str, list[str], None]


MAX_STOP_CHARS = 1000  # a stop sequence's length: the engine's search for it costs its length per token


def stop_list(stop: Stop, limit: int) -> tuple[str, ...]:
    """The request's stop sequences, at most `limit` (`--max-stop-sequences`), none empty or over MAX_STOP_CHARS."""
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(stop):
        raise invalid("`stop` sequences cannot be empty")
    if len(stop) > limit:
        raise invalid(f"`stop` supports up to {limit} stop sequences. Given: {len(stop)}")
    if (longest := max(map(len, stop), default=0)) > MAX_STOP_CHARS:
        raise invalid(f"`stop` sequences must be at most {MAX_STOP_CHARS} characters. Given: {longest}")
    return tuple(stop)


# ---- TGI ---------------------------------------------------------------------------------------------------

class Grammar(Strict):
    """TGI's grammar: "json" (value: a JSON schema), "regex" (a regex), "json_schema" (value: {"name", "schema"})."""
    type: Literal["json", "regex", "json_schema"]
    value: Union[str, dict]


class TgiParameters(Strict):
    adapter_id: str | None = None
    best_of: Int | None = bounded(exclusiveMinimum=0, maximum=MAX_BEST_OF)  # TGI's words: "> 0 and <= N"
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = bounded(minimum=-2.0, maximum=2.0)
    grammar: Grammar | None = None
    max_new_tokens: Int | None = bounded(minimum=1)
    repetition_penalty: float | None = bounded(exclusiveMinimum=0)
    return_full_text: bool | None = False
    seed: Seed | None = None
    stop: list[str] | None = None
    temperature: float | None = bounded(exclusiveMinimum=0)
    top_k: Int | None = bounded(minimum=1)
    top_n_tokens: Int | None = bounded(minimum=0, maximum=MAX_TOP_N_TOKENS)
    top_p: float | None = bounded(exclusiveMinimum=0.0, exclusiveMaximum=1.0)  # TGI's: "> 0.0 and < 1.0"
    truncate: Int | None = bounded(minimum=1)  # and <= --max-input-tokens (published per server)
    typical_p: float | None = bounded(exclusiveMinimum=0.0, exclusiveMaximum=1.0)
    watermark: bool = False

    REFUSED: ClassVar[dict[str, str]] = {"adapter_id": "no LoRA adapters are loaded"}

    @model_validator(mode="after")
    def _best_of(self):
        if (self.best_of or 1) > 1:
            if self.seed is not None:
                raise ValueError("`seed` must not be set when `best_of` > 1")
            if not self.sampling:
                raise ValueError("you must use sampling when `best_of` is > 1")
        return self

    @property
    def sampling(self) -> bool:
        warpers = (self.temperature not in (None, 1.0) or self.top_k is not None or self.top_p not in (None, 1.0)
                   or self.typical_p not in (None, 1.0))
        return self.do_sample or warpers


class TgiRequest(Strict):
    inputs: str
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: bool = False


class TokenizeRequest(Strict):
    inputs: str
    parameters: TgiParameters | None = None


# ---- OpenAI ------------------------------------------------------------------------------------------------

class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    REFUSED: ClassVar[dict[str, str]] = {"continuous_usage_stats": "usage is reported once, in the last chunk"}


LOGIT_BIAS = {"minimum": -100, "maximum": 100}  # a bias's range


class OpenAICommon(Strict):
    model: str | None = None
    frequency_penalty: float | None = bounded(minimum=-2.0, maximum=2.0)
    presence_penalty: float | None = bounded(minimum=-2.0, maximum=2.0)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={  # token id -> bias
        "propertyNames": {"pattern": "^[0-9]{1,12}$"}, "additionalProperties": LOGIT_BIAS})
    n: Int = bounded(1, minimum=1, maximum=MAX_BEST_OF)
    seed: OpenAISeed | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = bounded(minimum=0.0, maximum=2.0)
    top_p: float | None = bounded(minimum=0, maximum=1)  # OpenAI's range: 0 keeps the most likely token only
    user: str | None = None  # an end-user id for abuse tracking: no effect on output

    @model_validator(mode="after")
    def _common(self):
        for k, v in (self.logit_bias or {}).items():
            # "²" or "٣" pass isdigit() but are not token ids; over 12 digits, no vocabulary's (and int() refuses 4301)
            if not (k.isascii() and k.isdigit() and len(k) <= 12):
                raise ValueError(f"`logit_bias` keys must be token ids. Given: {k[:20]!r}{'...' if len(k) > 20 else ''}")
            if problem := out_of_range("logit_bias", v, LOGIT_BIAS):
                raise ValueError(problem)
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed when `stream` is true")
        return self


class CompletionRequest(OpenAICommon):
    prompt: Union[str, list[str], list[Int], list[list[Int]]]
    best_of: Int | None = bounded(minimum=1, maximum=MAX_BEST_OF)  # and >= n
    echo: bool = False
    logprobs: Int | None = bounded(minimum=0, maximum=5)
    max_tokens: Int | None = bounded(minimum=0)  # 0: score the prompt only
    suffix: str | None = None

    REFUSED: ClassVar[dict[str, str]] = {"suffix": "no fill-in-the-middle model is served"}

    @model_validator(mode="after")
    def _completion(self, info: ValidationInfo):
        if self.best_of is not None and self.best_of < self.n:
            most = server_limits(info).get("best_of", {}).get("maximum", MAX_BEST_OF)
            raise ValueError(f"`best_of` must be >= `n` and <= {most}. Given: {self.best_of}")
        if self.stream and (self.best_of or self.n) > self.n:
            raise ValueError("`best_of` > `n` is not supported when streaming")
        return self


class JsonSchema(Strict):
    """OpenAI's response_format.json_schema; with `strict` true the schema must keep to OpenAI's strict mode
    (grammar.strict_problem) and a `name` given to OpenAI's rule for it: the grammar holds to any schema it takes."""
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _strict_name(self):
        if self.strict and self.name is not None and not re.fullmatch(TOOL_NAME, self.name):
            raise ValueError(f"strict mode needs a `name` of 1 to 64 letters, digits, `_` or `-`. Given: {self.name[:80]!r}")
        return self


class ResponseFormat(Strict):
    """OpenAI's `text`, `json_object` (any JSON) and `json_schema` (its schema in `json_schema`), or TGI's grammar
    types: `json` or `json_object` with a JSON schema (object or string) in `value` (huggingface_hub's
    `chat_completion` sends an OpenAI `json_schema` so), `regex` with a pattern in `value`, `json_schema` with
    `value` {name, schema}."""
    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchema | None = None
    value: Union[dict, str, None] = None

    @model_validator(mode="after")
    def _value(self):
        if self.type == "json_schema" and self.json_schema is None and isinstance(self.value, dict):
            self.json_schema, self.value = JsonSchema.model_validate(self.value), None
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"`response_format.json_schema` is not used with type {self.type!r}")
        wants = {"json": (dict, str), "json_object": (dict, str), "regex": str}.get(self.type)
        if self.type == "json_object" and self.value is None:  # OpenAI's: any JSON
            return self
        if wants is None and self.value is not None:
            raise ValueError(f"`response_format.value` is not used with type {self.type!r}")
        if wants is not None and (not isinstance(self.value, wants) or not self.value):
            what = "a regular expression" if self.type == "regex" else "a JSON schema"
            raise ValueError(f"`response_format.value` must be {what} for type {self.type!r}")
        return self


ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": {"type": "null"},
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_CALL = {"type": "object", "required": ["function"], "additionalProperties": {"type": "null"},
         "properties": {"id": {"type": ["string", "null"]}, "type": {"enum": ["function", None]}, "function": {
             "type": "object", "required": ["name", "arguments"], "additionalProperties": {"type": "null"},
             "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}
MESSAGE = {  # a chat message as openai_prompts.chat_messages reads it (other fields: null, i.e. not given)
    "description": "role and content (a string or text parts); an assistant's content may be null or left out "
                   "beside its tool calls (one of the two is given); a tool's result names the call it answers",
    "anyOf": [{"type": "object", "required": ["role", "content"], "additionalProperties": {"type": "null"},
               "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT}},
              {"type": "object", "required": ["role"], "additionalProperties": {"type": "null"},
               "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [*_CONTENT["anyOf"], {"type": "null"}]},
                              "tool_calls": {"anyOf": [{"type": "array", "items": _CALL}, {"type": "null"}]}},
               "anyOf": [{"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},  # one of them
                         {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
              {"type": "object", "required": ["role", "content"], "additionalProperties": {"type": "null"},
               "properties": {"role": {"const": "tool"}, "content": _CONTENT,
                              "tool_call_id": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}]}


class FunctionSpec(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema for the arguments object (none: no arguments)
    strict: bool | None = None  # true: `parameters` must keep to OpenAI's strict mode (grammar.strict_problem)


class ToolSpec(Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Annotated[  # "none", "auto", "required", a tool's name (TGI's), or OpenAI's {"type": "function", ...}
    Union[Annotated[str, Tag("str")], Annotated[NamedToolChoice, Tag("dict")]],
    Discriminator(lambda v: "str" if isinstance(v, str) else "dict" if isinstance(v, (dict, NamedToolChoice)) else None,
                  custom_error_type="tool_choice", custom_error_message=(
                      'must be "none", "auto", "required", a tool\'s name or {"type": "function", "function": {"name": ...}}'))]


class ChatRequest(OpenAICommon):
    messages: list[dict[str, Any]] = Field(json_schema_extra={"minItems": 1, "items": MESSAGE})  # checked by chat_messages
    logprobs: bool = False
    top_logprobs: Int | None = bounded(minimum=0, maximum=20)
    max_tokens: Int | None = bounded(minimum=1)
    max_completion_tokens: Int | None = bounded(minimum=1)
    response_format: ResponseFormat | None = None
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    tool_prompt: str | None = None  # TGI's: the instruction after the tools (runtime/tools.py has the default)
    parallel_tool_calls: bool | None = None  # allowed, not required: a choice makes one call
    functions: list[dict] | None = None
    function_call: Union[str, dict, None] = None
    store: bool = False  # false is what the server does: nothing is stored
    metadata: dict[str, str] | None = None  # tags of stored completions

    REFUSED: ClassVar[dict[str, str]] = {
        **{name: "the deprecated function calling is not implemented: use `tools`" for name in ("functions", "function_call")},
        "store": "completions are not stored", "metadata": "completions are not stored"}

    @model_validator(mode="after")
    def _chat(self):
        if not self.messages:
            raise ValueError("`messages` must be a non-empty list")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` set to true")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema_ is None):
            raise ValueError("`response_format.json_schema.schema` must be a JSON schema object")
        return self
