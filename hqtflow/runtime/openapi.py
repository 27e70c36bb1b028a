"""The OpenAPI document the server publishes at /openapi.json: FastAPI's routes, plus what the routes read and answer
themselves (they parse their JSON bodies with schemas.py to give TGI's and OpenAI's errors), so that generated
clients and schema-driven testers (schemathesis) see the API as it is: request bodies, streams, errors."""

from __future__ import annotations

import copy

from hqtflow.runtime.schemas import MAX_BEST_OF, ChatRequest, CompletionRequest, TgiRequest, TokenizeRequest

TGI_ERROR = {"type": "object", "required": ["error", "error_type"],
             "properties": {"error": {"type": "string"}, "error_type": {"type": "string"}}}
OPENAI_ERROR = {"type": "object", "required": ["error", "error_type"], "properties": {"error_type": {"type": "string"}, "error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}

SSE = {"text/event-stream": {}}  # `data:` events, each a JSON object
OBJECT, ARRAY = {"type": "object"}, {"type": "array", "items": {"type": "object"}}
GENERATED = {**OBJECT, "required": ["generated_text"]}
COMPLETION = {**OBJECT, "required": ["id", "object", "created", "model", "choices", "usage"]}

# The grammars as the validators read them (one branch per type; whether a regex or schema compiles, no schema says)
_NONEMPTY = [{"type": "object", "minProperties": 1}, {"type": "string", "minLength": 1}]
_JSON_TEXT = {"type": "string", "minLength": 1, "contentMediaType": "application/json"}  # a JSON schema as a string
_JSON_SCHEMA = {"type": "object", "required": ["schema"], "additionalProperties": False, "properties": {
    "name": {"type": ["string", "null"]}, "description": {"type": ["string", "null"]},
    "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}
_TGI_JSON_SCHEMA = {**_JSON_SCHEMA, "properties": {**_JSON_SCHEMA["properties"], "schema": _NONEMPTY[0]}}


def _branch(kind: str, required: tuple = (), **properties) -> dict:
    return {"type": "object", "required": ["type", *required], "additionalProperties": False,
            "properties": {"type": {"const": kind}, **properties}}


GRAMMAR = {"description": "TGI's grammar", "anyOf": [
    _branch("json", ("value",), value={"anyOf": [_NONEMPTY[0], _JSON_TEXT]}), _branch("regex", ("value",), value=_NONEMPTY[1]),
    _branch("json_schema", ("value",), value=_TGI_JSON_SCHEMA)]}
RESPONSE_FORMAT = {"description": "OpenAI's response_format, or TGI's grammar types", "anyOf": [
    _branch("text", json_schema={"type": "null"}, value={"type": "null"}),
    _branch("json_object", json_schema={"type": "null"}, value={"anyOf": [_NONEMPTY[0], _JSON_TEXT, {"type": "null"}]}),
    _branch("json", ("value",), json_schema={"type": "null"}, value={"anyOf": [_NONEMPTY[0], _JSON_TEXT]}),
    _branch("regex", ("value",), json_schema={"type": "null"}, value=_NONEMPTY[1]),
    _branch("json_schema", ("json_schema",), json_schema=_JSON_SCHEMA, value={"type": "null"}),
    _branch("json_schema", ("value",), json_schema={"type": "null"}, value=_JSON_SCHEMA)]}


def _given(name: str, schema: dict) -> dict:
    return {"properties": {name: schema}, "required": [name]}


_NOT_ONE = {"type": "number", "not": {"const": 1}}


def _best_of_vs_n(at_least: bool) -> dict:
    """`best_of` >= `n` (or <= `n`), spelled out for n up to MAX_BEST_OF (JSON Schema cannot compare two fields)."""
    def given(k: int) -> dict:
        return {"properties": {"n": {"const": k}}, "required": ["n"]} if k > 1 else {"properties": {"n": {"enum": [1, None]}}}
    bound = "minimum" if at_least else "maximum"
    return {"anyOf": [{"properties": {"best_of": {"type": "null"}}},
                      *({**given(k), "properties": {**given(k)["properties"], "best_of": {bound: k}}} for k in range(1, MAX_BEST_OF + 1))]}

# The validators' rules between fields, as JSON Schema conditions: (model, if, then)
RULES = [
    ("TgiParameters", _given("best_of", {"type": "integer", "minimum": 2}), {  # TGI: best_of needs sampling, no seed
        "properties": {"seed": {"type": "null"}},
        "anyOf": [_given("do_sample", {"const": True}), _given("temperature", _NOT_ONE), _given("top_p", _NOT_ONE),
                  _given("typical_p", _NOT_ONE), _given("top_k", {"type": "integer"})]}),
    ("CompletionRequest", _given("stream_options", {"type": "object"}), _given("stream", {"const": True})),
    ("CompletionRequest", {}, _best_of_vs_n(at_least=True)),  # (no `if`: always)
    ("CompletionRequest", _given("stream", {"const": True}), _best_of_vs_n(at_least=False)),  # streams: best_of == n
    ("ChatRequest", _given("stream_options", {"type": "object"}), _given("stream", {"const": True})),
    ("ChatRequest", _given("top_logprobs", {"type": "integer"}), _given("logprobs", {"const": True})),
]

# path -> (request model, the 200's content, what the 200 is)
BODY_ROUTES = {
    "/": (TgiRequest, {"application/json": {"schema": {"type": "array", "items": GENERATED}}, **SSE},
          "a list of one result; with `stream`, TGI's token events"),
    "/generate": (TgiRequest, {"application/json": {"schema": GENERATED}}, "the generated text (with `details`)"),
    "/generate_stream": (TgiRequest, SSE, "TGI's token events"),
    "/tokenize": (TokenizeRequest, {"application/json": {"schema": ARRAY}}, "the tokens with their offsets"),
    "/v1/completions": (CompletionRequest, {"application/json": {"schema": COMPLETION}, **SSE},
                        "a completion; with `stream`, its chunks"),
    "/v1/chat/completions": (ChatRequest, {"application/json": {"schema": COMPLETION}, **SSE},
                             "a chat completion; with `stream`, its chunks"),
}
BODY_ERRORS = {413: "a body over --payload-limit bytes", 415: "not a UTF-8 JSON body", 422: "a parameter is invalid or not supported (named)",
               424: "generation failed", 429: "the server is at --max-concurrent-requests"}


def publish(spec: dict, *, vocab: int, max_input_tokens: int, max_total_tokens: int, max_stop_sequences: int,
            max_best_of: int, max_top_n_tokens: int, max_client_batch_size: int, payload_limit: int, api_key: bool) -> dict:
    """FastAPI's spec of the app (`get_openapi`) completed in place: bodies, streams, errors, this server's limits
    (token ids, stop sequences, lengths: a prompt's length in tokens is checked too, which no schema can say)."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, (model, content, what) in BODY_ROUTES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
        spec["paths"][path]["post"].update(
            requestBody={"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            responses={"200": {"description": what, "content": content},
                       **{str(code): error(path, why) for code, why in {
                           **BODY_ERRORS, 413: f"a body over {payload_limit} bytes (--payload-limit)"}.items()}})
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}
    stops = {"type": "array", "maxItems": max_stop_sequences, "items": text}
    params = schemas["TgiParameters"]["properties"]
    params.update(truncate={**params["truncate"], "maximum": max_input_tokens}, stop={"anyOf": [stops, {"type": "null"}]})
    for name in ("TgiRequest", "TokenizeRequest"):
        schemas[name]["properties"]["inputs"].update(minLength=1)
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatRequest"]["properties"]
    batch = {"type": "array", "minItems": 1, "maxItems": max_client_batch_size}  # --max-client-batch-size prompts
    completion["prompt"] = {"anyOf": [text, {**batch, "items": text}, ids, {**batch, "items": ids}]}
    for props in (completion, chat):
        props["stop"] = {"anyOf": [text, stops, {"type": "null"}]}
    for field, most in ((params["best_of"], max_best_of), (params["top_n_tokens"], max_top_n_tokens),
                        (completion["best_of"], max_best_of), (completion["n"], max_best_of), (chat["n"], max_best_of)):
        (field if "maximum" in field else field["anyOf"][0])["maximum"] = most  # this server's --max-best-of, ...
    for budget in (completion["max_tokens"], chat["max_tokens"], chat["max_completion_tokens"]):
        budget["maximum"] = max_total_tokens - 1
    for budget in (params["max_new_tokens"], completion["max_tokens"], chat["max_tokens"], chat["max_completion_tokens"]):
        budget.pop("default", None)  # the server's default is as many as fit: a tester sending null waits for them all
        budget["examples"] = [1]
    schemas.update(Grammar=GRAMMAR, ResponseFormat=RESPONSE_FORMAT)
    schemas.pop("JsonSchema", None)
    for name, if_, then in RULES:
        schemas[name].setdefault("allOf", []).append({"if": if_, "then": then} if if_ else then)
    # /tokenize reads the parameters' truncate and stop only: its copy has no generation budget
    schemas["TokenizeParameters"] = tokenize = {**copy.deepcopy(schemas["TgiParameters"]), "title": "TokenizeParameters"}
    tokenize["properties"]["grammar"] = {"anyOf": [{  # read for its shape only: nothing is compiled
        "type": "object", "required": ["type", "value"], "additionalProperties": False,
        "properties": {"type": {"enum": ["json", "regex", "json_schema"]}, "value": {"type": ["string", "object"]}}},
        {"type": "null"}]}
    schemas["TokenizeRequest"]["properties"]["parameters"] = {"anyOf": [
        {"$ref": "#/components/schemas/TokenizeParameters"}, {"type": "null"}]}
    params["max_new_tokens"]["maximum"] = max_total_tokens - 1
    # /generate and /generate_stream: TGI's request without `stream` (only POST / switches on it)
    schemas["TgiGenerateRequest"] = {**schemas["TgiRequest"], "title": "TgiGenerateRequest", "properties": {
        **schemas["TgiRequest"]["properties"], "stream": {"type": "null", "description": "only POST / streams on request"}}}
    for path in ("/generate", "/generate_stream"):
        paths_body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        paths_body["$ref"] = "#/components/schemas/TgiGenerateRequest"

    paths = spec["paths"]
    paths["/health"]["get"]["responses"] = {"200": {"description": "ready (no body)"},
                                            "503": error("/health", "warming up, or the engine has stopped")}
    paths["/metrics"]["get"]["responses"] = {"200": {"description": "Prometheus metrics (TGI's names)",
                                                     "content": {"text/plain": {"schema": {"type": "string"}}}}}
    paths["/v1/models/{model}"]["get"]["responses"] = {
        "200": {"description": "the served model", "content": {"application/json": {"schema": OBJECT}}},
        "404": error("/v1/", "no such model")}
    for item in paths.values():  # every GET route answers HEAD too (as TGI's): the same answer, without its body
        if "head" in item:
            item["head"] = {**item["get"], "operationId": item["get"]["operationId"] + "_head"}
    for path, item in paths.items():
        for op in item.values():
            if api_key and path not in ("/health", "/metrics"):
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = error(path, "missing or wrong API key")
            if path in BODY_ROUTES:
                op["responses"]["500"] = error(path, "a server bug (the traceback is in the server's log)")
    if api_key:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    return spec


def error(path: str, why: str) -> dict:
    """A response of the API family's error body: OpenAI's under /v1/, TGI's elsewhere."""
    schema = OPENAI_ERROR if path.startswith("/v1/") else TGI_ERROR
    return {"description": why, "content": {"application/json": {"schema": schema}}}
