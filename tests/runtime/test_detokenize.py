"""The engine's incremental detokenization (TGI's and vLLM's window of the last tokens) gives, token by token, the
text that decoding every generated token at once gives: byte-level BPE (GPT-2, Llama 3, SmolLM2) and SentencePiece-
style Metaspace tokenizers, multi-byte characters split across tokens, special tokens in between."""

import random
from types import SimpleNamespace

import pytest

from hqtflow.runtime.engine import Engine, Request, SamplingParams, fast_decode

TEXTS = ["The café's crème brûlée costs 5 € — naïve “quotes”.", "日本語のテキストと emoji 🎉🚀 mixed in.",
         "  leading spaces,\ttabs and\nnew lines  ", "Zürich, Kraków, São Paulo; ½ ≤ ¾ ≥ π."]


def _metaspace(lines, size=800):
    """A SentencePiece-style BPE (Metaspace: '▁' for spaces, stripped before the first word on decode)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=size, special_tokens=["<unk>", "</s>", *alphabet]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers(tokenizer_dir, data_dir):
    from transformers import AutoTokenizer

    lines = (data_dir / "wikitext2_valid.txt").read_text().splitlines()[:2000] + TEXTS
    return {"byte-level": AutoTokenizer.from_pretrained(tokenizer_dir), "metaspace": _metaspace(lines)}


def _stream(tok, ids, prompt=None):
    """(pieces, final text) as the engine emits them for generated `ids` (after `prompt`, as Engine.submit opens the
    text at its last token; without one, the answer's text alone)."""
    eng = SimpleNamespace(tok=tok, _decode=fast_decode(tok))
    req = Request(prompt or [0], SamplingParams(), lambda ev: None)
    if prompt:
        req.open_text(eng._decode)
    pieces = []
    for i, t in enumerate(ids):
        if t not in tok.all_special_ids:
            req.visible.append(t)
        pieces.append(Engine._new_text(eng, req, final=i == len(ids) - 1))
        req.text += pieces[-1]
    return pieces, req.text


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_streamed_text_is_the_whole_decode(tokenizers, data_dir, kind):
    tok = tokenizers[kind]
    lines = [l for l in (data_dir / "wikitext2_test.txt").read_text().splitlines() if len(l) > 40][:40] + TEXTS
    rng = random.Random(0)
    for line in lines:
        ids = tok(line, add_special_tokens=False)["input_ids"]
        if rng.random() < 0.5:  # an EOS in the middle: no text, and no break in the text around it
            ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)
        pieces, text = _stream(tok, ids)
        assert text == tok.decode([t for t in ids if t not in tok.all_special_ids]), line
        assert "\ufffd" not in "".join(pieces)  # multi-byte characters come whole, never as replacement characters


def _whole(tok, ids):
    """The reference: decode every visible token at each step, emit what the text grew by (quadratic)."""
    visible, text, pieces = [], "", []
    for i, t in enumerate(ids):
        if t not in tok.all_special_ids:
            visible.append(t)
        full = tok.decode(visible)
        pieces.append("" if full.endswith("\ufffd") and i < len(ids) - 1 else full[len(text):])
        text += pieces[-1]
    return pieces, text


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_random_tokens_stream_what_whole_decodes_stream(tokenizers, kind):
    """Arbitrary token sequences (a sampled model's output), broken UTF-8 included: the same pieces as decoding the
    whole text at every token. (With broken UTF-8 neither is the final whole decode: HF's byte fallback turns every
    byte of an invalid group into U+FFFD, so a later byte can change the text of earlier, already streamed ones.)"""
    tok = tokenizers[kind]
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert _stream(tok, ids) == _whole(tok, ids)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_fast_decode_is_the_tokenizers_decode(tokenizers, kind):
    """The engine decodes through the Rust tokenizer directly where transformers' decode does nothing more: the
    same text for any ids (special tokens included, as the engine decodes them); with clean-up, transformers'."""
    tok = tokenizers[kind]
    decode = fast_decode(tok)
    assert decode != tok.decode  # a plain fast tokenizer: the direct path
    rng = random.Random(2)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert decode(ids) == tok.decode(ids)
    saved, tok.clean_up_tokenization_spaces = tok.clean_up_tokenization_spaces, True
    try:
        assert fast_decode(tok) == tok.decode
    finally:
        tok.clean_up_tokenization_spaces = saved


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_an_answer_keeps_its_first_space_after_the_prompt(tokenizers, kind):
    """Decoded after the prompt's last token (TGI's prefix offset), an answer keeps the first space a SentencePiece
    decoder strips from the start of a text, and its tokens' texts join to it, after a special token too; a prompt
    ending inside a character leaves the answer's text as decoded alone."""
    tok = tokenizers[kind]
    answer = tok(" to Paris, naïve 🎉", add_special_tokens=False)["input_ids"]
    for prompt in (tok("The capital is", add_special_tokens=False)["input_ids"], [tok.eos_token_id]):
        pieces, text = _stream(tok, answer, prompt)
        assert text == "".join(pieces) == " to Paris, naïve 🎉", (prompt, pieces)
    half = [next(i for i in range(len(tok)) if "\ufffd" in tok.decode([i]))]  # a byte of a multi-byte character
    assert _stream(tok, answer, half)[1] == tok.decode(answer)


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
def test_logprob_token_texts_join_to_the_answer(tokenizers, kind):
    """The OpenAI routes' token texts (runtime/openai_text.token_texts) keep a SentencePiece token's leading space,
    so an answer's tokens join to its text; a byte-level token's is its decode alone."""
    from hqtflow.runtime.openai_text import token_texts

    tok = tokenizers[kind]
    text = token_texts(tok)
    answer = tok(" to Paris, in France", add_special_tokens=False)["input_ids"]  # (a part of a character: U+FFFD)
    assert "".join(map(text, answer)) == " to Paris, in France"
    assert all(text(t) == tok.decode([t]) for t in answer) == (kind == "byte-level")


def test_echo_gives_a_text_prompt_back_as_sent(data_dir, lm):
    """`echo` on /v1/completions returns a text prompt as the client sent it: decoding its tokens would add a
    SentencePiece tokenizer's BOS (`<s>`) or drop its leading space; a token prompt is decoded."""
    import httpx

    from conftest import running
    from hqtflow.runtime.server import ServeSettings, create_app

    lines = (data_dir / "wikitext2_valid.txt").read_text().splitlines()[:500]
    tok = _metaspace(lines, size=len(lm[1]))  # within the tiny model's vocabulary
    app = create_app(lm[0], tok, ServeSettings(model_id="sp", max_input_tokens=48, max_total_tokens=96, max_batch_size=4))
    prompt = " The capital is"
    ids = tok(prompt)["input_ids"]
    assert tok.decode(ids) != prompt
    with running(app) as url:
        for body, want in (({"prompt": prompt}, prompt), ({"prompt": [prompt, "Paris"]}, prompt), ({"prompt": ids}, tok.decode(ids))):
            r = httpx.post(f"{url}/v1/completions", json={**body, "echo": True, "max_tokens": 0, "logprobs": 0}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
