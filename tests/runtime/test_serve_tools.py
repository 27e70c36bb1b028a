"""Tool calling on /v1/chat/completions through the official clients (openai, huggingface_hub, text-generation) on a
real uvicorn server over a tiny random Llama (the grammar holds its replies to a call), and the reading of tool
replies and their stream deltas as pure functions."""

import json

import httpx
import pytest
from jinja2 import Template

from conftest import client_lib, running
from hqtflow.runtime import tools
from hqtflow.runtime.openai_prompts import chat_messages
from hqtflow.runtime.schemas import ApiError, ChatRequest, parse
from hqtflow.runtime.server import ServeSettings, create_app

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]  # enums only: a random model's call is short and complete
ARGS = {"get_weather": {"city", "unit"}, "get_time": {"zone"}}


@pytest.fixture(scope="module")
def lm(lm_long):
    """Prompts with tools pass the tiny Llama's 256-token context: its weights with a longer one."""
    return lm_long


@pytest.fixture(scope="module")
def url(lm):
    app = create_app(*lm, ServeSettings(model_id="tiny", max_input_tokens=1000, max_total_tokens=1100, max_batch_size=8))
    with running(app) as base:
        yield base


def check_call(name: str, arguments: str) -> dict:
    """A call of one of TOOLS whose arguments are JSON holding to its schema (only the named parameters)."""
    args = json.loads(arguments)
    assert name in ARGS and set(args) == ARGS[name], (name, arguments)
    return args


def test_openai_tool_calls_plain_streamed_and_answered(url):
    """tool_choice "required" and a named tool give a call (finish_reason "tool_calls", content null, arguments a
    JSON string within the tool's schema); the stream helper joins its deltas into the same call; the call and a
    tool result fed back as the next turn's history are accepted."""
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    ask = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0)
    out = client.chat.completions.create(**ask, tool_choice="required").choices[0]
    (call,) = out.message.tool_calls
    assert (out.finish_reason, out.message.content, call.type) == ("tool_calls", None, "function")
    assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates take only such ids back
    check_call(call.function.name, call.function.arguments)
    named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    with client.chat.completions.stream(**ask, tool_choice="required") as s:
        for _ in s:
            pass
        streamed = s.get_final_completion().choices[0]
    (joined,) = streamed.message.tool_calls
    assert (joined.function.name, joined.function.arguments) == (call.function.name, call.function.arguments)
    assert streamed.finish_reason == "tool_calls" and len(joined.id) == 9
    history = MESSAGES + [out.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"}]
    again = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason in ("length", "stop")
    # the stream helper's message appended as it is (the SDK sends its calls' `index` back): the next turn of the
    # same message written as a plain dict
    result = {"role": "tool", "tool_call_id": joined.id, "content": "18 degrees"}
    plain = {"role": "assistant", "tool_calls": [{"id": joined.id, "type": "function", "function": {
        "name": joined.function.name, "arguments": joined.function.arguments}}]}
    turns = [client.chat.completions.create(model="tiny", messages=MESSAGES + [m, result], tools=TOOLS, tool_choice="none",
                                            max_tokens=3, temperature=0).choices[0].message.content
             for m in (streamed.message, plain)]
    assert turns[0] == turns[1], turns


def test_openai_parse_helper_reads_pydantic_tools(url):
    """openai's `pydantic_function_tool` (strict, nested models as `$defs` references) and its `parse` helper: the call's
    arguments come back as the model (the references are rebased where the grammar puts the tool's schema)."""
    openai = client_lib("openai")
    from typing import Literal

    from pydantic import BaseModel

    class Place(BaseModel):
        city: Literal["Paris", "Rome"]

    class Trip(BaseModel):
        to: Place
        days: Literal[1, 2]

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.parse(model="tiny", messages=MESSAGES, tools=[openai.pydantic_function_tool(Trip)],
                                      tool_choice="required", max_tokens=120, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "Trip" and isinstance(call.function.parsed_arguments, Trip), call
    # the parsed message appended as it is (the SDK sends `parsed` and `parsed_arguments` back): a next turn, as OpenAI
    history = [*MESSAGES, r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = client.chat.completions.create(model="tiny", messages=history, tools=[openai.pydantic_function_tool(Trip)],
                                           tool_choice="none", max_tokens=3)
    assert again.choices[0].finish_reason in ("length", "stop")


def test_auto_calls_a_tool_or_answers(url):
    """With tool_choice "auto" (the default with tools) every sampled reply is a call of a given tool or a text
    answer (the `no_tool` pseudo-tool's content), never `no_tool` itself; streamed and plain agree. Seeds 0-5 give
    both kinds of reply here."""
    kinds = set()
    openai = client_lib("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    for seed in range(6):
        ask = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed)
        plain = client.chat.completions.create(**ask).choices[0]
        with client.chat.completions.stream(**ask) as s:
            for _ in s:
                pass
            streamed = s.current_completion_snapshot.choices[0]
        for c in (plain, streamed):
            if c.message.tool_calls and c.finish_reason == "length":  # a call cut short
                assert c.message.tool_calls[0].function.name in ARGS
            elif c.message.tool_calls:
                check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)
                assert c.finish_reason == "tool_calls" and c.message.content is None
            else:
                assert isinstance(c.message.content, str) and "no_tool" not in c.message.content, c
            kinds.add(bool(c.message.tool_calls))
        assert streamed.message.content == plain.message.content
        assert [t.function.arguments for t in streamed.message.tool_calls or []] == \
            [t.function.arguments for t in plain.message.tool_calls or []]
    assert kinds == {True, False}, kinds


def test_huggingface_hub_and_text_generation_clients_call_tools(url, monkeypatch):
    """huggingface_hub's chat_completion reads the calls, plain and streamed; TGI's own text_generation client reads
    them plain (it sends a tool's bare name as tool_choice, as TGI takes it). Its stream parser (0.7) wants one tool
    call object per delta, not OpenAI's list, so it cannot read a streamed call; openai and huggingface_hub can."""
    hub = client_lib("huggingface_hub")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # the tests run offline; the server is on loopback
    client = hub.InferenceClient(base_url=url, timeout=120)
    out = client.chat_completion(MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    (call,) = out.choices[0].message.tool_calls
    check_call(call.function.name, call.function.arguments)
    parts = [ch.choices[0].delta.tool_calls for ch in client.chat_completion(
        MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0, stream=True) if ch.choices]
    parts = [p[0] for p in parts if p]
    assert parts[0].function.name == call.function.name
    assert "".join(p.function.arguments for p in parts) == call.function.arguments
    tg = client_lib("text_generation")
    tgc = tg.Client(url, timeout=120)
    msg = [tg.types.Message(role="user", content=MESSAGES[0]["content"])]
    chat = tgc.chat(msg, tools=[tg.types.Tool(**t) for t in TOOLS], tool_choice="get_time", max_tokens=60, temperature=0.01,
                    seed=1)
    (tg_call,) = chat.choices[0].message.tool_calls
    assert tg_call["function"]["name"] == "get_time" and set(json.loads(tg_call["function"]["arguments"])) == {"zone"}


def test_a_reply_cut_short_says_length(url):
    """max_tokens that ends a reply mid-call: finish_reason "length", and the call's wrapper never comes back as text:
    the call with its arguments so far (OpenAI's clients then get arguments that do not parse), the one tool a name
    cut short can still be (always so for a named tool_choice), or empty content while it could be either; the
    stream's deltas join into the same message."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    for n in (1, 2, 9):
        for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            ask = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=n, temperature=0)
            (c,) = client.chat.completions.create(**ask).choices
            assert c.finish_reason == "length", c
            if c.message.tool_calls:
                (call,) = c.message.tool_calls
                assert c.message.content is None and call.function.name in ARGS
                assert choice == "required" or call.function.name == "get_time"
                assert not call.function.arguments.startswith('{"name"')
            else:
                assert choice == "required" and c.message.content == "", c
            chunks = list(client.chat.completions.create(**ask, stream=True))
            streamed = [ch.choices[0].delta for ch in chunks if ch.choices]
            assert "".join(d.content or "" for d in streamed) == (c.message.content or "")
            calls = [t for d in streamed for t in d.tool_calls or []]
            assert [t.function.name for t in calls if t.id] == [t.function.name for t in c.message.tool_calls or []]
            assert "".join(t.function.arguments or "" for t in calls) == "".join(
                t.function.arguments for t in c.message.tool_calls or [])
            assert chunks[-1].choices[0].finish_reason == "length"


def test_a_reply_cut_before_its_name_is_read_by_the_names_offered():
    """Cut before the name was complete: the one offered tool that name can still be (arguments not begun), else
    an empty text answer; `no_tool` (tool_choice "auto") is an answer in text, not a call."""
    names = ["get_weather", "get_time", "no_tool"]
    for text, offered, want in [('{"name": "get_t', names, ("get_time", "")), ('{"name": "get_', names, (None, "")),
                                ('{"name": "n', names, (None, "")), ("", ["get_time"], ("get_time", "")),
                                ('{"na', ["get_time"], ("get_time", "")), ('{"name": "x', ["get_time"], (None, "")),
                                ('{"name": "get\\u00', names, (None, "")), ('{"name": "get\\', ["get_time"], ("get_time", ""))]:
        r = tools.read_reply(text, final=True, names=offered)
        assert (r.name, r.text, r.complete) == (*want, False), (text, r)
        s = tools.ToolStream(offered)
        parts = [d for n in range(len(text) + 1) for d in s.deltas(text[:n], final=n == len(text))]
        assert [d["tool_calls"][0]["function"]["name"] for d in parts if "tool_calls" in d] == ([want[0]] if want[0] else [])
        assert "".join(d.get("content", "") for d in parts) == ""


def fn(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


DEEP: dict = {}
for _ in range(70):
    DEEP = {"type": "object", "properties": {"x": DEEP}}

BAD = [
    ({"tool_choice": "required"}, "`tool_choice` needs `tools`"),
    ({"tool_prompt": "Use a tool"}, "`tool_prompt` needs `tools`"),
    ({"tools": TOOLS, "tool_choice": "get_date"}, "`tool_choice` names 'get_date'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"nam": "x"}}}, "`tool_choice.function.name` is required"),
    ({"tools": TOOLS, "tool_choice": 7}, "`tool_choice`: must be"),
    ({"tools": [WEATHER, WEATHER]}, "`tools[1].function.name` 'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"name": "no_tool"}}]}, "`tools[0].function.name` 'no_tool' is reserved"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "a b"}}]}, "`tools[1].function.name`"),
    ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "`tools[0].type`"),
    ({"tools": [{"type": "function", "function": {"name": "a", "returns": {}}}]}, "`tools[0].function.returns`"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}]}, '`tools[0].function.parameters`: `type` "nonsense" (at /properties/x) is not a JSON Schema type'),
    ({"tools": [WEATHER, fn("b", {"properties": {"x": {"type": "nonsense"}}})], "tool_choice": "b"},
     '`tools[1].function.parameters`: `type` "nonsense" (at /properties/x) is not a JSON Schema type'),
    ({"tools": [fn("b", {"properties": {"a": {}}, "required": [["a"]]})]}, "`required` (at the root) names"),
    ({"tools": [fn("b", {"properties": {"a": {"anyOf": [{}]}, "b": {"$ref": "#/properties/a/anyOf/\u00b2"}}})]},
     "does not resolve"),
    ({"tools": [fn(f"t{i}", {}) for i in range(129)]}, "`tools`: List should have at most 128 items"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}", "id": "z"}}]}]},
     "`messages[0].tool_calls[0].function.id` is not supported"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/Missing"}}}}}]}, "`$ref` '#/$defs/Missing' (at /properties/x) does not resolve"),
    ({"tools": [{"type": "function", "function": {"name": "a", "parameters": DEEP}}]}, "`tools[0].function.parameters`: nests deeper"),
    ({"tools": [WEATHER, fn("b", {"type": "string"})]}, "`tools[1].function.parameters`: must be an object schema"),
    ({"tools": [fn("b", {"anyOf": [{"type": "object"}, {"type": "string"}]})]}, "a root `anyOf` may make"),
    ({"tools": [fn("b", {"properties": {"n": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}})]},
     "`allOf` of more than one schema (at /properties/n) is not enforced"),
    ({"tools": [fn("b", {"properties": {"n": {"not": {"type": "string"}}}})]}, "`not` (at /properties/n) is not enforced"),
    ({"tools": [fn("b", {"properties": {"n": {"$ref": "http://example.com/s.json"}}})]}, "only references within the schema"),
    ({"tools": [fn("b", {"properties": {"x": {}}, "required": ["x", "ghost"]})]}, "names 'ghost', which is not one of its"),
    ({"tools": [fn("b", {"properties": {"n": {"type": "integer", "multipleOf": 7, "minimum": 1}}})]}, "`multipleOf` (at /properties/n)"),
    ({"tools": [fn("b", {"patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False})]},
     "`patternProperties` (at the root)"),
    ({"tools": TOOLS, "stop": ["}"]}, "`stop` cannot be combined with `tools`"),
    ({"tools": TOOLS, "tool_choice": "none", "tool_prompt": "Use tools"}, "`tool_prompt` is not used with `tool_choice` \"none\""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "array", "contains": {}}}}},
     "`response_format`: `contains` (at the root) is not enforced"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "`response_format` cannot be combined with `tools`"),
    ({"functions": [{"name": "a"}]}, "`functions` is not supported"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "`messages[0].tool_calls` is not supported"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "`messages[0].tool_call_id` is not supported"),
    ({"messages": [{"role": "tool", "tool_call_id": "1"}]}, "`messages[0].content`"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]},
     "`messages[1].tool_call_id` must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]},
     "`messages[1]`: a tool message must follow an assistant message with `tool_calls`"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "42"}]}, "`messages[2].tool_call_id` 'c2' names no earlier tool call"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "`messages[0].tool_calls[0].function.arguments` is not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}]},
     "`messages[0].tool_calls[0]` must be"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                            "arguments": '{"x": "\\ud800"}'}}]}]},
     "`messages[0].tool_calls[0].function.arguments` holds a lone UTF-16 surrogate"),  # (a 500 before)
    ({"tools": [fn("b", {"properties": {"n": {"anyOf": []}}})]}, "`anyOf` (at /properties/n) is an empty list"),
    ({"tools": [fn("b", {"properties": {"n": {"type": "array", "maxItems": float("inf")}}})]},
     "holds a NaN or infinity (at properties.n.maxItems)"),
    ({"tools": [fn("b", {"properties": {"n": {"type": "integer", "minimum": 1e308}}})]},
     "`minimum` 1e+308 (at /properties/n) is beyond the 64-bit integers"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]}, "`messages[0].function_call`"),
]


def test_bad_tool_requests_are_named(url):
    """Each malformed tool request is one 422 whose message names the field, in OpenAI's error body."""
    for body, name in BAD:
        r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps({"messages": MESSAGES, "max_tokens": 2, **body}),
                       headers={"content-type": "application/json"}, timeout=60)  # (json.dumps writes Infinity)
        assert r.status_code == 422 and name in r.json()["error"]["message"], (body, r.status_code, r.text)


def test_tool_replies_read_back_and_streamed():
    """A reply as the grammar writes it, fed a character at a time: the stream's deltas join into the plain reply
    (name once, then the arguments; `no_tool`'s content decoded, escapes and a surrogate pair included, a lone
    surrogate as U+FFFD, which UTF-8 can carry); a reply cut short reads as text (name incomplete) or as a call that
    did not complete."""
    cases = [('{"name": "get_time", "arguments": {"zone": "}cet}"}}', "get_time", '{"zone": "}cet}"}', True),
             ('{"name": "no_tool", "arguments": {"content": "a \\"b\\" \\\\ \\ud83d\\ude00 \\u00e9}"}}', None, 'a "b" \\ 😀 é}', True),
             ('{"name": "get_t', None, '{"name": "get_t', False),
             ('{"name": "get_time", "arguments": {"zo', "get_time", '{"zo', False),
             ('{"name": "no_tool", "arguments": {"content": "half \\ud83d', None, "half ", False),
             ('{"name": "no_tool", "arguments": {"content": "lone \\ud800 \\udc00"}}', None, "lone \ufffd \ufffd", True)]
    for text, name, final, complete in cases:
        r = tools.read_reply(text, final=True)
        assert (r.name, r.text, r.complete) == (name, final, complete), (text, r)
        s, parts = tools.ToolStream(None), []
        for n in range(1, len(text) + 1):
            parts += s.deltas(text[:n], final=n == len(text))
        calls = [d["tool_calls"][0] for d in parts if "tool_calls" in d]
        assert "".join(d.get("content", "") for d in parts) == (final if name is None else "")
        assert "".join(c["function"]["arguments"] for c in calls) == (final if name is not None else "")
        assert [c["function"].get("name") for c in calls if c.get("id")] == ([name] if name else [])
        assert all(set(c) == {"index", "function"} for c in calls[1:])  # later deltas: the arguments only
        assert s.finish_reason("length") == ("tool_calls" if name and complete else "length")


TOOL_TEMPLATE = ("{% if tools %}[tools]{{ tools | tojson }}\n{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.id }}]{{ c.function.name }}{{ c.function.arguments | tojson }}"
                 "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}<assistant>")


def test_tools_reach_the_prompt_both_ways():
    """A template that renders `tools` gets the offered tools and the history's calls (arguments parsed) and call ids;
    for one that does not, the tools are written after the last message (TGI's way) and a history's calls go into
    the assistant's content as the model writes them."""
    req = parse(ChatRequest, json.dumps({"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]}).encode())
    plan = tools.plan(req.tools, req.tool_choice, req.tool_prompt)
    assert [t["function"]["name"] for t in plan.offered] == ["get_weather", "no_tool"]
    assert tools.renders(TOOL_TEMPLATE, "tools") and tools.renders(TOOL_TEMPLATE, "tool_calls")
    assert not tools.renders("{{ messages }}", "tools") and not tools.renders(None, "tools")
    rendered = Template(TOOL_TEMPLATE).render(messages=tools.with_tools(chat_messages(req.messages, True), plan, True),
                                              tools=plan.offered)
    assert rendered.startswith("[tools]") and '"no_tool"' in rendered
    assert '[call call_9]get_weather{"city": "Rome"}' in rendered and "<tool>sunny\n---\n" + tools.DEFAULT_PROMPT in rendered
    plain = tools.with_tools(chat_messages(req.messages, False), plan, False)
    assert plain[1] == {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Rome"}}'}
    assert plain[2]["content"] == "sunny\n---\n" + json.dumps(plan.offered) + "\n" + tools.DEFAULT_PROMPT
    with pytest.raises(ApiError, match="needs `tools`"):
        tools.plan(None, "auto", None)
    assert tools.plan(req.tools, "none", None) is None


@pytest.mark.slow
def test_smollm2_calls_the_named_tool(smollm2):
    """The real SmolLM2 asked for the weather in Rome with a free-text city parameter calls get_weather with Rome."""
    openai = client_lib("openai")
    from hqtflow import models

    app = create_app(models.load_model(smollm2, "bf16"), models.load_tokenizer(smollm2), ServeSettings(model_id="smollm2"))
    weather = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
    with running(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What's the weather in Rome?"}],
                                           tools=[weather], tool_choice="required", max_tokens=40, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}, call


def test_arguments_schema_rebases_references_and_closes_objects():
    """A tool's parameters placed in the call's grammar: references in schema positions are rebased, a `$ref` inside
    const/enum data is left as it is, and objects that list properties are closed unless they say otherwise."""
    params = {"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
              "properties": {"p": {"$ref": "#/$defs/P"}, "k": {"const": {"$ref": "#/x"}}, "e": {"enum": [{"$ref": "#"}]},
                             "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
                             "kids": {"type": "array", "items": {"$ref": "#"}}}}
    out = tools.arguments_schema(params, "#/$defs/tool3")
    assert out["properties"]["p"] == {"$ref": "#/$defs/tool3/$defs/P"} and out["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool3"}
    assert out["properties"]["k"] == {"const": {"$ref": "#/x"}} and out["properties"]["e"] == {"enum": [{"$ref": "#"}]}
    assert out["additionalProperties"] is False and out["$defs"]["P"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert tools.parameters_problem(params) is None


def test_a_ref_in_const_data_comes_back_as_given(url):
    """The grammar writes a const that holds a `$ref` object verbatim (it is data, not a reference)."""
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "tool_choice": "required",
            "tools": [fn("k", {"properties": {"k": {"const": {"$ref": "#/x"}}}, "required": ["k"]})]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert json.loads(r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"k": {"$ref": "#/x"}}, r


def test_a_tool_use_template_gets_the_tools(lm):
    """A tokenizer with named templates ({"default", "tool_use"}): a request with tools is rendered by `tool_use`
    (given the offered tools and the history's calls), one without by `default` (counted in usage.prompt_tokens)."""
    import copy

    model, tok = lm
    tok = copy.deepcopy(tok)
    tok.chat_template = {"default": tok.chat_template, "tool_use": TOOL_TEMPLATE}
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "noon"}]
    app = create_app(model, tok, ServeSettings(model_id="tiny", max_input_tokens=1000, max_total_tokens=1100))
    with running(app) as base:
        body = {"messages": history, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0}
        used = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["usage"]["prompt_tokens"]
        plain = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}, timeout=60).json()
    plan = tools.plan(parse(ChatRequest, json.dumps(body).encode()).tools, "required", None)
    rendered = tok.apply_chat_template(tools.with_tools(chat_messages(history, True), plan, True), tools=plan.offered,
                                       chat_template="tool_use", tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("[tools]") and "[call abcdefghi]get_time" in rendered and "[for abcdefghi]" in rendered
    assert used == len(tok(rendered, add_special_tokens=False)["input_ids"])
    default = tok.apply_chat_template(MESSAGES, chat_template="default", tokenize=False, add_generation_prompt=True)
    assert plain["usage"]["prompt_tokens"] == len(tok(default, add_special_tokens=False)["input_ids"])


def test_many_tools_within_the_size_limits():
    """Each tool's `parameters` has the size limits of a schema; the tools together (one call schema, every tool
    under `$defs`) have 4x those, checked before anything is compiled: 40 tools of 15 parameters (~700 subschemas
    together) are an ordinary agent request; 128 tools of 30 parameters are refused, naming `tools`."""
    def request(n_tools, n_params):
        spec = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string"} for j in range(n_params)}}}} for i in range(n_tools)]
        return parse(ChatRequest, json.dumps({"messages": [{"role": "user", "content": "hi"}], "tools": spec}).encode())

    req = request(40, 15)
    assert tools.plan(req.tools, req.tool_choice, req.tool_prompt) is not None
    req = request(128, 30)
    with pytest.raises(ApiError, match="`tools`: together, the tools' schemas have more than 2048 subschemas"):
        tools.plan(req.tools, req.tool_choice, req.tool_prompt)
