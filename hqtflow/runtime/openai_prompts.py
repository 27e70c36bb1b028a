"""The prompts of OpenAI's routes: /v1/completions' (strings, token ids, batches; what `echo` gives back) and
/v1/chat/completions' messages checked and put through the model's chat template (with runtime/tools.py's tools)."""

from __future__ import annotations

import json

from hqtflow.runtime import tools
from hqtflow.runtime.api import Ctx
from hqtflow.runtime.schemas import ROLES, ChatRequest, CompletionRequest, invalid


def prompts_of(ctx: Ctx, req: CompletionRequest) -> list[list[int]]:
    """/v1/completions' prompts tokenized: a string, token ids, or a batch of either."""
    p = req.prompt
    if isinstance(p, str):
        return [ctx.encode(p, "prompt")]
    if not p:
        raise invalid("`prompt` cannot be empty")
    if all(isinstance(x, int) for x in p):
        return [ctx.check_ids(p)]
    if all(isinstance(x, str) for x in p):
        return [ctx.encode(x, "prompt") for x in p]
    return [ctx.check_ids(x) for x in p]


def echoed_prompts(tok, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What `echo` gives back: a text prompt as the client sent it (not its tokens decoded, which would add a
    BOS such as `<s>` or drop a SentencePiece tokenizer's leading space), a token prompt decoded."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if all(isinstance(x, str) for x in p):
        return list(p)
    return [tok.decode(ids) for ids in prompts]


MESSAGE_REFUSED = {"name": "participant names are not passed to the chat template",
                   "function_call": "the deprecated function calling is not implemented: use `tools`",
                   "refusal": "refusals are not modelled", "audio": "audio is not supported"}
MESSAGE_FIELDS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}  # beside role and content
# what the openai SDK's helpers put into an assistant message it returns, sent back when the message is appended to
# the history (`.parse()`: `parsed`, a function's `parsed_arguments`; `.stream()`: a call's `index`): the SDK's own
# copies of the content, the arguments and the call's place, ignored (OpenAI's chat completions take them)
SDK_COPIES = {"message": ("parsed",), "call": ("index",), "function": ("parsed_arguments",)}


def chat_messages(messages: list[dict], renders_calls: bool, renders_developer: bool = True) -> list[dict]:
    """The messages for the chat template: roles checked (OpenAI's `developer` given as `system` to a template that
    does not name it, as llama.cpp does: templates drop or refuse a role they do not know), content as a string
    (OpenAI's text parts joined), an assistant's tool calls and a tool result's call id passed on to a template that
    renders `tool_calls` (else the calls are written into the content as the model writes them); any other message
    field is a 422 naming it (given as null, it is not given)."""
    out, call_ids, called = [], set(), False  # the ids of the assistant's tool calls so far
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"`messages[{i}]` must be an object with `role` and `content`")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"`messages[{i}].role` must be one of {', '.join(ROLES)}. Given: {role!r}")
        allowed = ("role", "content", *MESSAGE_FIELDS.get(role, ()), *(SDK_COPIES["message"] * (role == "assistant")))
        for key, value in m.items():
            if key not in allowed and value is not None:
                why = MESSAGE_REFUSED.get(key, "it is not a field of a chat message")
                if key in ("tool_calls", "tool_call_id"):
                    why = f"only {'an assistant' if key == 'tool_calls' else 'a tool'} message has it"
                raise invalid(f"`messages[{i}].{key}` is not supported: {why}")
        content = message_text(m.get("content"), i, optional=role == "assistant")
        calls = message_calls(m.get("tool_calls"), i) if role == "assistant" else []
        if role == "assistant" and m.get("content") is None and not calls:  # OpenAI's contract (a dropped reply)
            raise invalid(f"`messages[{i}]`: an assistant message must have `content` or `tool_calls`")
        role = "system" if role == "developer" and not renders_developer else role
        if role == "tool":  # OpenAI's contract: the result of a call the assistant made, named by its id
            if not isinstance(m.get("tool_call_id"), str):
                raise invalid(f"`messages[{i}].tool_call_id` must be a string: a tool message answers a tool call by "
                              "its id")
            if not called:
                raise invalid(f"`messages[{i}]`: a tool message must follow an assistant message with `tool_calls`")
            if call_ids and m["tool_call_id"] not in call_ids:
                raise invalid(f"`messages[{i}].tool_call_id` {m['tool_call_id']!r} names no earlier tool call")
        called = called or bool(calls)
        call_ids.update(c["id"] for c in calls if isinstance(c.get("id"), str))
        if not renders_calls:
            content = "\n".join([content] * bool(content) + [tools.call_text(c["function"]["name"], c["function"]["arguments"])
                                                             for c in calls])
            out.append({"role": role, "content": content})
            continue
        extra = {"tool_calls": calls} if calls else {"tool_call_id": m["tool_call_id"]} if m.get("tool_call_id") is not None else {}
        out.append({"role": role, "content": content, **extra})
    return out


def message_text(content, i: int, optional: bool) -> str:
    """A message's content as one string: OpenAI's text parts joined with newlines; null (an assistant's) is empty."""
    if isinstance(content, str):
        return content
    if content is None and optional:
        return ""
    if not isinstance(content, list) or not content:  # OpenAI's spec: at least one part
        raise invalid(f"`messages[{i}].content` must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"`messages[{i}].content[{j}]`: only text parts are supported. Given: {kind!r}")
        extra = next((k for k, v in part.items() if k not in ("type", "text") and v is not None), None)
        if extra is not None:
            raise invalid(f"`messages[{i}].content[{j}].{extra}` is not supported: a text part has type and text")
        parts.append(part["text"])
    return "\n".join(parts)


def message_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool calls as chat templates take them: {"id"?, "type": "function", "function":
    {"name", "arguments": the parsed arguments}} (OpenAI sends the arguments as a JSON string)."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise invalid(f"`messages[{i}].tool_calls` must be a list of tool calls")
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": a JSON string}}'
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        c = {k: v for k, v in c.items() if v is not None and k not in SDK_COPIES["call"]} if isinstance(c, dict) else c
        f = c.get("function") if isinstance(c, dict) else None  # (null: not given)
        f = {k: v for k, v in f.items() if v is not None and k not in SDK_COPIES["function"]} if isinstance(f, dict) else f
        if not isinstance(f, dict) or c.get("type", "function") != "function" or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments"), str) or not isinstance(c.get("id", ""), str):
            raise invalid(f"`{where}` must be {shape}")
        if extra := next((k for k in c if k not in ("id", "type", "function")), None):
            raise invalid(f"`{where}.{extra}` is not supported: a tool call has id, type and function")
        if extra := next((k for k in f if k not in ("name", "arguments")), None):
            raise invalid(f"`{where}.function.{extra}` is not supported: a tool call's function has name and arguments")
        try:
            arguments = json.loads(f["arguments"])
        except RecursionError:
            raise invalid(f"`{where}.function.arguments` nests too deeply") from None
        except ValueError:
            raise invalid(f"`{where}.function.arguments` is not valid JSON") from None
        try:  # an escaped lone surrogate ("\\ud800") is valid JSON, but no UTF-8 text (the prompt) can hold it
            json.dumps(arguments, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise invalid(f"`{where}.function.arguments` holds a lone UTF-16 surrogate (U+D800-DFFF), which no UTF-8 "
                          "text holds") from None
        out.append({**({"id": c["id"]} if "id" in c else {}), "type": "function",
                    "function": {"name": f["name"], "arguments": arguments}})
    return out


def chat_prompt(ctx: Ctx, req: ChatRequest, plan: tools.ToolPlan | None) -> list[int]:
    """The request's messages (and tools) through the chat template, tokenized."""
    try:
        template = ctx.tok.get_chat_template(tools=plan.offered if plan else None)  # (a model may have a tool_use one)
    except Exception:  # noqa: BLE001 - no template: apply_chat_template below says so
        template = None
    renders_tools = tools.renders(template, "tools")
    messages = chat_messages(req.messages, tools.renders(template, "tool_calls"), tools.renders(template, "developer"))
    if plan is not None:
        messages = tools.with_tools(messages, plan, renders_tools)
    try:
        prompt = ctx.tok.apply_chat_template(messages, tools=plan.offered if plan and renders_tools else None,
                                             tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - no or broken template
        raise invalid(f"`messages`: cannot apply the chat template: {e}") from None
    if not prompt:  # the messages were checked non-empty: the template dropped them
        raise invalid("`messages`: the chat template rendered no text from these messages")
    return ctx.encode(prompt, "messages", add_special_tokens=False)
