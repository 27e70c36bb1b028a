"""What OpenAI's answers say about the tokens: finish reasons, the text up to the stop sequence, a token's own text
and bytes, the completions and chat logprobs, usage and the fields every answer starts with (pure functions)."""

from __future__ import annotations

import functools
import time
import uuid
from typing import Callable

FINISH = {"length": "length", "eos_token": "stop", "stop_sequence": "stop"}


def final_text(ev) -> str:
    """A finished sequence's text as OpenAI returns it: up to (without) the stop sequence that ended it."""
    return ev.generated_text if ev.stop_at is None else ev.generated_text[:ev.stop_at]


def before_stop(tokens: list, stop_at: int | None) -> list:
    """The tokens that start before the stop sequence that ended the text (`stop_at`: its offset in the text; None:
    all): OpenAI leaves the stop sequence out of the text, and so out of the logprobs (a token that holds both text
    and the stop's start is kept)."""
    if stop_at is None:
        return tokens
    kept, at = [], 0
    for t in tokens:
        if at >= stop_at:
            break
        kept.append(t)
        at += len(t.text)
    return kept


def token_texts(tok) -> Callable[[int], str]:
    """A token's own text, as it reads inside a text: decoded after a plain letter, which is then cut off, so a
    SentencePiece token keeps the space its decoder strips from the start of a text ("▁to" is " to", as in the
    answer: a choice's tokens join to its text); a byte-level token's text is its decode alone either way."""
    anchor = tok.encode("a", add_special_tokens=False)[-1:]
    lead = tok.decode(anchor)

    @functools.lru_cache(maxsize=1 << 16)
    def text(tid: int) -> str:
        both = tok.decode(anchor + [tid])
        return both[len(lead):] if anchor and both.startswith(lead) else tok.decode([tid])

    return text


def token_bytes(tok, tid: int, text: str) -> bytes:
    """A token's own UTF-8 bytes (OpenAI's `bytes`): its text, or, for a token that holds part of a character (its
    text decodes to U+FFFD), the bytes behind its byte-level BPE symbols or its `<0xNN>` byte-fallback piece."""
    if "\ufffd" not in text:
        return text.encode()
    piece = tok.convert_ids_to_tokens(tid)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    symbols = _byte_symbols()
    return bytes(symbols[c] for c in piece) if all(c in symbols for c in piece) else text.encode()


@functools.cache
def _byte_symbols() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, symbol -> byte: printable bytes stand for themselves, the other 68 bytes
    for the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def token_name(tok, token_text: Callable[[int], str], tid: int) -> str:
    """A token as /v1/completions' logprobs name it: its text, or for a part of a character OpenAI's
    "bytes:\\xNN.." (the parts of different characters would all read U+FFFD, one key in `top_logprobs`)."""
    text = token_text(tid)
    if "\ufffd" not in text:
        return text
    raw = token_bytes(tok, tid, text)
    return text if raw == text.encode() else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def char_starts(chunks: list[bytes], first: int = 0) -> list[int]:
    """For each chunk of a UTF-8 byte stream from `first` on, the index of the character its first byte belongs to
    in the stream decoded with U+FFFD for what is not UTF-8 (as the answer's text is); an empty chunk: the next
    character's. (Each is the length of a decoded prefix, so a stream's chunks cost one decode each, not all.)"""
    total, out = b"".join(chunks), []
    p = sum(len(c) for c in chunks[:first])
    for c in chunks[first:]:
        out.append(len(total[:p + 1].decode("utf-8", "replace")) - (p < len(total)))
        p += len(c)
    return out


def completion_logprobs(tok, token_text: Callable[[int], str], ids: list[int], prompt: list | None, tokens: list,
                        offset: int, before: list = ()) -> dict:
    """/v1/completions' logprobs (`token_text`: a token_texts function): with `prompt` ((logprob, top) of each of
    the prompt's `ids`, echo) the prompt's tokens first, from offset 0; then the generated `tokens` (the engine's;
    `before`: those of the answer already sent), whose text starts at `offset` in the returned text. Each
    `text_offset` is the index of the character where the token's first byte is, so it indexes the returned text
    also where tokens hold parts of a character."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    name = functools.partial(token_name, tok, token_text)
    raw = lambda tid: token_bytes(tok, tid, token_text(tid))  # noqa: E731
    rows = []
    if prompt:
        rows += [(tid, lp, top, at) for tid, (lp, top), at in zip(ids, prompt, char_starts([raw(t) for t in ids]))]
    starts = char_starts([b"" if t.special else raw(t.id) for t in [*before, *tokens]], len(before))
    rows += [(t.id, t.logprob, t.top or [], offset + at) for t, at in zip(tokens, starts)]
    for tid, lp, top, at in rows:
        chosen = name(tid)
        out["tokens"].append(chosen)
        out["token_logprobs"].append(lp)
        if lp is None:
            out["top_logprobs"].append(None)
        else:
            d = {name(t): v for t, v in top}
            d.setdefault(chosen, lp)  # the chosen token is always listed (as vLLM does)
            out["top_logprobs"].append(d)
        out["text_offset"].append(at)
    return out


def chat_logprobs(tok, token_text: Callable[[int], str], tokens) -> dict:
    """/v1/chat/completions' logprobs of the generated tokens (`token_text`: token_texts(tok))."""
    def entry(tid, lp):
        text = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(token_bytes(tok, tid, text))}
    return {"content": [{**entry(t.id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in (t.top or [])]}
                        for t in tokens if not t.special]}  # the content's tokens: not the end-of-turn token


def head(served_name: str, chat: bool, stream: bool) -> dict:
    """The fields every answer and stream chunk starts with."""
    obj = "chat.completion" + (".chunk" if stream else "") if chat else "text_completion"
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": served_name, "system_fingerprint": "hqtflow"}


def usage(prompts, seqs) -> dict:
    """OpenAI's token counts of the prompts and the finished sequences."""
    p, c = sum(len(x) for x in prompts), sum(len(q.tokens) for q in seqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
