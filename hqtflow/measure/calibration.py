"""Plain-text calibration sources: .txt files chunked into max-length windows, .jsonl records by field."""

from __future__ import annotations

import json
from itertools import groupby
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from hqtflow.errors import CalibrationError, not_a_file


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S], all ones (text windows are never padded)


def read_texts(path: Path, text_field: str) -> list[str]:
    """A .jsonl file (any case) gives one text per record (its `text_field`); a .json file is refused (JSON lines go in
    .jsonl); any other file is one plain text. A UTF-8 byte order mark is dropped."""
    path = Path(path)
    if not path.is_file():  # (/dev/zero would be read until memory runs out, a pipe until its writer closes it)
        raise CalibrationError(f"Calibration file {path} {not_a_file(path)}; give a .txt or .jsonl file.")
    suffix = path.suffix.lower()
    if suffix == ".json":
        raise CalibrationError(f"Calibration file {path} is a .json file; give JSON records one a line as .jsonl, or "
                               "plain text as .txt.")
    try:
        content = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise CalibrationError(f"Calibration file {path} is not UTF-8 text.") from None
    except OSError as e:
        raise CalibrationError(f"Cannot read the calibration file {path} ({e.strerror}).") from None
    if not content.strip():
        raise CalibrationError(f"Calibration file {path} is empty.")
    if suffix != ".jsonl":
        return [content]
    texts = []
    for lineno, line in enumerate(content.split("\n"), 1):  # JSON Lines' separator only: splitlines() also cuts at
        # U+2028, U+2029, U+0085 ..., which JSON strings may hold unescaped (json.dumps(ensure_ascii=False) writes them)
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):
            raise CalibrationError(f"{path} line {lineno} is not valid JSON.") from None
        if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
            if isinstance(rec, dict) and text_field in rec:
                raise CalibrationError(f"{path} line {lineno}: field {text_field!r} is not a string.")
            fields = ", ".join(rec) if isinstance(rec, dict) else "none"
            raise CalibrationError(
                f"{path} line {lineno} has no text field {text_field!r} (fields: {fields}); pick one with --text-field."
            )
        if _has_lone_surrogate(rec[text_field]):
            raise CalibrationError(f"{path} line {lineno}: field {text_field!r} holds a lone UTF-16 surrogate (a "
                                   "\\ud800-\\udfff escape not paired), which is no text a tokenizer takes.")
        texts.append(rec[text_field])
    if not any(t.strip() for t in texts):
        raise CalibrationError(f"{path} has no text: every record's {text_field!r} is empty or whitespace.")
    return texts


def _has_lone_surrogate(text: str) -> bool:
    """Whether `text` holds a code point JSON's `\\ud800`-`\\udfff` escapes give when not paired (not encodable)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def first_tokens(text: str, tokenizer, needed: int | None) -> list[int]:
    """The first `needed` tokens of `text` (all where None or fewer), as the whole text's tokenization gives them,
    tokenizing not much more of it than that takes: a prefix's tokens agree with the whole text's except near the
    cut, so prefixes of doubling length are tokenized until two of them agree past `needed` tokens."""
    size, previous = max(8 * (needed or 0), 4096), None
    while needed is not None and size < len(text):
        ids = tokenizer.encode(text[:size], add_special_tokens=False)
        if previous is not None:
            agree = next((i for i, (a, b) in enumerate(zip(previous, ids)) if a != b), min(len(previous), len(ids)))
            if agree > needed:
                return ids[:needed]
        previous, size = ids, size * 2
    return tokenizer.encode(text, add_special_tokens=False)


def token_chunks(texts: list[str], tokenizer, max_length: int, limit: int | None) -> list[list[int]]:
    """Tokenize each text and cut it into windows of at most `max_length` tokens; keep the first `limit`."""
    chunks: list[list[int]] = []
    for text in texts:
        needed = None if limit is None else (limit - len(chunks)) * max_length
        ids = first_tokens(text, tokenizer, needed)
        for start in range(0, len(ids), max_length):
            chunk = ids[start:start + max_length]
            if chunk:
                chunks.append(chunk)
            if limit is not None and len(chunks) >= limit:
                return chunks
    return chunks


def batches(chunks: list[list[int]], batch_size: int) -> Iterator[Batch]:
    """Batches of windows of one length, never padded, longest first (stably sorted): the statistics are the same at
    any batch size, as padding a row would change the bf16 rounding of its batch. A .txt's windows are all
    `max_length` long but its last; a .jsonl's records batch with those of their length."""
    for _, same in groupby(sorted(chunks, key=len, reverse=True), key=len):
        same = list(same)
        for start in range(0, len(same), batch_size):
            ids = torch.tensor(same[start:start + batch_size], dtype=torch.long)
            yield Batch(ids, torch.ones_like(ids))
