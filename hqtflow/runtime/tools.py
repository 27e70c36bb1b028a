"""Tool calling on /v1/chat/completions, as TGI does it: the tools go into the prompt (to the chat template when it
takes `tools`, else as JSON after the last message), a JSON grammar holds the reply to one call
{"name": ..., "arguments": {...}} of an offered tool, and the reply becomes OpenAI's `tool_calls`. With
`tool_choice` "auto" the model may pick TGI's `no_tool` pseudo-tool and answer in text instead.

Pure functions of the request's values; the route does the I/O."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from hqtflow.runtime.grammar import (MAX_SCHEMA_DEPTH, SUBSCHEMA_LISTS, SUBSCHEMA_MAPS, SUBSCHEMA_ONE, TOOLS_SCALE,
                                     depth, schema_problem, size_problem, strict_problem)
from hqtflow.runtime.schemas import invalid

NO_TOOL = "no_tool"
NO_TOOL_SPEC = {"type": "function", "function": {
    "name": NO_TOOL, "description": "Open-ended response with no specific tool selected",
    "parameters": {"type": "object", "properties": {"content": {"type": "string", "description": "The response"}},
                   "required": ["content"], "additionalProperties": False}}}
DEFAULT_PROMPT = ('Given the functions available, please respond with a JSON for a function call with its proper '
                  'arguments that best answers the given prompt. Respond in the format {"name": function name, '
                  '"arguments": dictionary of argument name and its value}. Do not use variables.')
# the start of a call as the grammar writes it, up to the arguments' value; group 1: the name as a JSON string
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
CLOSING = " \t\n\r}"  # what may still close the arguments and the call: held back while streaming

ROOT_NOT_OBJECT = ("const", "enum", "anyOf", "oneOf", "allOf", "$ref")  # at the root, they may make the arguments no object
ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolPlan:
    offered: list[dict]  # the tools the prompt shows (with `no_tool` under "auto")
    given: list[int | None]  # each offered tool's index in the request's `tools` (None: `no_tool`)
    schema: dict  # the reply's JSON schema: one call of an offered tool
    prompt: str  # the tool prompt appended to the last message

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.offered]


def plan(tools: list | None, tool_choice, tool_prompt: str | None) -> ToolPlan | None:
    """What a request's tools (schemas.ToolSpec) and tool_choice ("none", "auto", "required", a tool's name, or
    schemas.NamedToolChoice) ask of the reply; None when no tool may be called."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("`tool_choice` needs `tools`")
        if tool_prompt is not None:
            raise invalid("`tool_prompt` needs `tools`")
        return None
    specs = [t.model_dump(exclude_none=True) for t in tools]
    names, seen = [t["function"]["name"] for t in specs], set()
    for i, (name, t) in enumerate(zip(names, specs)):
        if name == NO_TOOL or name in seen:
            raise invalid(f"`tools[{i}].function.name` {name!r} is {'reserved' if name == NO_TOOL else 'given twice'}")
        seen.add(name)
        params, strict = t["function"].get("parameters"), t["function"].get("strict")
        if problem := parameters_problem(params) or (strict and params is not None and strict_problem(params)):
            raise invalid(f"`tools[{i}].function.parameters`: {problem}")
    if tool_choice == "none" and tool_prompt is not None:
        raise invalid('`tool_prompt` is not used with `tool_choice` "none" (no tool is offered)')
    choice = "auto" if tool_choice is None else tool_choice if isinstance(tool_choice, str) else tool_choice.function.name
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        given = [*range(len(specs)), *[None] * (choice == "auto")]
    elif choice in seen:
        given = [names.index(choice)]
    else:
        raise invalid(f"`tool_choice` names {choice!r:.80}, which is not one of `tools`")
    offered = [NO_TOOL_SPEC if i is None else specs[i] for i in given]
    calls = [call_schema(t["function"], f"#/$defs/tool{i}") for i, t in enumerate(offered)]
    schema = {"$defs": {f"tool{i}": params for i, (_, params) in enumerate(calls)}}
    schema |= calls[0][0] if len(calls) == 1 else {"anyOf": [call for call, _ in calls]}
    if too_large := size_problem(schema, TOOLS_SCALE):  # before anything is compiled
        raise invalid(f"`tools`: together, the tools' schemas have {too_large}")
    return ToolPlan(offered, given, schema, DEFAULT_PROMPT if tool_prompt is None else tool_prompt)


def parameters_problem(params) -> str | None:
    """Why a function's `parameters` cannot be held to (None: it can): not an object schema (the arguments are a JSON
    object), deeper than the grammar takes beside the call around it, or what the grammar would not enforce."""
    if params is None:
        return None
    if params.get("type", "object") != "object":
        return f"must be an object schema ({{\"type\": \"object\", \"properties\": ...}}). Given type: {params['type']!r:.40}"
    if root := next((k for k in ROOT_NOT_OBJECT if k in params), None):
        return f"must be an object schema: a root `{root}` may make the arguments something else"
    if depth(params) > MAX_SCHEMA_DEPTH - 2:  # the call around the arguments adds two levels
        return f"nests deeper than {MAX_SCHEMA_DEPTH - 2} levels"
    return schema_problem(arguments_schema(params, "#"))  # as compiled: objects closed to their properties


def one_call_schema(tool: dict) -> dict:
    """The reply's schema were `tool` the only one offered (to find which tool's schema does not compile)."""
    call, params = call_schema(tool["function"], "#/$defs/tool0")
    return {"$defs": {"tool0": params}, **call}


def call_schema(function: dict, at: str) -> tuple[dict, dict]:
    """One call of `function`: its name, then its arguments, whose schema (the function's parameters; none: no
    arguments, `{}`) is put at `at`."""
    call = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": {"$ref": at}},
            "required": ["name", "arguments"], "additionalProperties": False}
    params = function.get("parameters")
    return call, arguments_schema({"type": "object", "properties": {}} if params is None else {"type": "object", **params}, at)


def arguments_schema(schema, at: str):
    """A copy of a function's parameters schema placed at `at`: its local references rebased there, and each object
    that lists `properties` closed to them unless it says `additionalProperties` (a model would otherwise add keys of
    its own). Only schema positions are touched: the values of const, enum, default and examples are data."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("$ref"), str):
        out["$ref"] = at + out["$ref"][1:]
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for k in SUBSCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: arguments_schema(v, at) for name, v in out[k].items()}
    for k in SUBSCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = arguments_schema(out[k], at)
    for k in SUBSCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [arguments_schema(v, at) for v in out[k]]
    return out


def renders(template: str | None, name: str) -> bool:
    """Whether a chat template's text uses the variable or field `name` (`tools`, `tool_calls`)."""
    return isinstance(template, str) and re.search(rf"\b{name}\b", template) is not None


def with_tools(messages: list[dict], p: ToolPlan, template_takes_tools: bool) -> list[dict]:
    """The messages with TGI's tool prompt after the last one's content: the tools as JSON first unless the template
    renders them."""
    shown = "" if template_takes_tools else json.dumps(p.offered, ensure_ascii=False) + "\n"
    last = messages[-1]
    return [*messages[:-1], {**last, "content": f"{last.get('content') or ''}\n---\n{shown}{p.prompt}"}]


def call_text(name: str, arguments) -> str:
    """A call written as the grammar has the model write it (for an assistant message's `tool_calls` in a template
    that does not render them)."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


@dataclass
class Reply:
    """A generated tool reply read back: a call (`name`, and `text` its arguments' JSON) or a text answer (`name`
    None, `text` the `no_tool` content, or when cut before the tool's name was complete, `cut_short`'s reading)."""
    name: str | None = None
    text: str = ""
    complete: bool = False  # the reply ended where the grammar ends it


def read_reply(text: str, final: bool, content: StringReader | None = None, names: list[str] | None = None) -> Reply | None:
    """The reply so far. `final`: the whole reply. Not final (streaming): None until the name is complete, then only
    what more text cannot change: the arguments without what may still close them, the content decoded so far
    (`content`: the reader that decoded its earlier part, so each call decodes only what is new). `names`: the
    offered tools' names, which read a reply cut before its name was complete (`cut_short`)."""
    head = HEAD.match(text)
    if head is None:
        return cut_short(text, names) if final else None
    name, rest = json.loads(head.group(1)), text[head.end():]
    if name == NO_TOOL:
        opening = re.match(r'\{\s*"content"\s*:\s*"', rest)
        if opening is None:
            return Reply(text="")
        value, end = (content or StringReader()).read(rest[opening.end():])
        complete = end is not None and re.fullmatch(r"\s*}\s*}\s*", rest[opening.end() + end:]) is not None
        return Reply(text=value, complete=complete)
    if not final:
        return Reply(name, rest.rstrip(CLOSING))
    try:
        end = json.JSONDecoder().raw_decode(rest)[1]
    except ValueError:
        return Reply(name, rest)
    return Reply(name, rest[:end], re.fullmatch(r"\s*}\s*", rest[end:]) is not None)


PARTIAL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)')


def cut_short(text: str, names: list[str] | None) -> Reply:
    """A reply that ended (max_tokens) before the grammar had written the whole tool name. The wrapper's text is never
    the answer: a call of the one offered tool the name's start can still be, with its arguments not begun (as
    OpenAI's cut-short call: finish_reason "length"); else an empty text answer, nothing of it written yet."""
    if names is None:
        return Reply(text=text)
    m = PARTIAL_NAME.match(text)
    start = ""
    if m:
        try:
            start = json.loads('"' + re.sub(r"\\(u[0-9a-fA-F]{0,3})?$", "", m.group(1)) + '"')
        except ValueError:
            start = ""
    can_be = [n for n in names if n.startswith(start)]
    return Reply(can_be[0], "") if len(can_be) == 1 and can_be[0] != NO_TOOL else Reply(text="")


STRING_BODY = re.compile(r'(?:[^"\\]+|\\u[0-9a-fA-F]{4}|\\[^u])*')  # a JSON string's text up to a half-written escape


class StringReader:
    """A JSON string's value read as its text grows: each `read` decodes only the text the last one left."""

    def __init__(self):
        self.raw, self.value, self.end = 0, "", None  # text decoded, its value, where the closing quote ends

    def read(self, s: str) -> tuple[str, int | None]:
        """(value so far, end of the closing quote or None while open) of the string whose text (after the opening
        quote) `s` is. While open, a half-written escape or the first half of a surrogate pair waits for the rest;
        a lone surrogate becomes U+FFFD (it cannot be sent as UTF-8)."""
        if self.end is not None:
            return self.value, self.end
        tail = s[self.raw:]
        cut = STRING_BODY.match(tail).end()
        closed = cut < len(tail) and tail[cut] == '"'
        value = json.loads('"' + tail[:cut] + '"', strict=False)
        if not closed and value and "\ud800" <= value[-1] <= "\udbff":  # its low half may come next: a 6-char escape
            value, cut = value[:-1], cut - 6
        self.value += re.sub("[\ud800-\udfff]", "\ufffd", value)
        self.raw += cut
        if closed:
            self.end = self.raw + 1
        return self.value, self.end


def new_call_id() -> str:
    """A tool call's id: 9 letters or digits (OpenAI's ids have no set form; Mistral's chat templates require this one)."""
    return "".join(secrets.choice(ID_CHARS) for _ in range(9))


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolStream:
    """One choice's tool reply as stream deltas, which OpenAI's clients join into the non-streamed message: the
    call's id, type and name once the name is complete, then its arguments as they come (index and arguments only,
    as OpenAI sends them); or the `no_tool` content as it is decoded."""

    def __init__(self, names: list[str] | None):
        self.call_id, self.named, self.sent, self.reply, self.content = new_call_id(), False, "", None, StringReader()
        self.names = names  # the offered tools' names (None: a cut-short reply reads as its text)

    def deltas(self, visible: str, final: bool) -> list[dict]:
        r = self.reply = read_reply(visible, final, self.content, self.names)
        if r is None:
            return []
        out = []
        if r.name is not None and not self.named:
            self.named = True
            out.append({"tool_calls": [{"index": 0, **tool_call(self.call_id, r.name, "")}]})
        new, self.sent = r.text[len(self.sent):], r.text
        if new and r.name is not None:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
        elif new:
            out.append({"content": new})
        return out

    def finish_reason(self, reason: str) -> str:
        return finish_reason(self.reply, reason)


def finish_reason(reply: Reply, reason: str) -> str:
    """OpenAI's "tool_calls" for a call the grammar ended; else the engine's reason."""
    return "tool_calls" if reply.name is not None and reply.complete else reason
