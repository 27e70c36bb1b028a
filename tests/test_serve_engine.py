"""The continuous-batching engine: greedy equals model.generate, batching does not change any request's text."""

import threading

import pytest
import torch

from hqtflow.runtime.engine import Engine, SamplingParams

PROMPTS = ["The tower is", "In 1990 the band released their second album , which",
           "A", "The game was played on a cold day in the north of the country and"]


@pytest.fixture(scope="module")
def lm(tiny_llama):
    from hqtflow import models

    model, tok = models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama)
    return model, tok


@pytest.fixture(scope="module")
def engine(lm):
    eng = Engine(*lm, max_batch_size=4).start()
    yield eng
    eng.stop()


def ids(tok, text):
    return tok(text)["input_ids"]


def text_of(events):
    assert events[-1].finish_reason, events[-1]
    return events[-1].generated_text


def test_greedy_equals_generate(lm, engine):
    model, tok = lm
    x = tok(PROMPTS[1], return_tensors="pt")
    with torch.inference_mode():
        ref = model.generate(**x, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)[0, x["input_ids"].shape[1]:]
    events = engine.generate(ids(tok, PROMPTS[1]), SamplingParams(max_new_tokens=12))
    got = [e.token.id for e in events]
    assert got == ref.tolist()[:len(got)]
    assert text_of(events) == tok.decode(got, skip_special_tokens=True)
    assert "".join(e.token.text for e in events if not e.token.special) == text_of(events)
    assert all(e.token.logprob <= 0 for e in events)


def test_concurrent_requests_match_alone(lm, engine):
    _, tok = lm
    lengths = [10, 4, 16, 7]
    alone = [text_of(engine.generate(ids(tok, p), SamplingParams(max_new_tokens=n))) for p, n in zip(PROMPTS, lengths)]
    results = [None] * len(PROMPTS)

    def one(i):
        results[i] = text_of(engine.generate(ids(tok, PROMPTS[i]), SamplingParams(max_new_tokens=lengths[i])))

    sizes = []
    engine.on_step = lambda kind, b, dt, shape: sizes.append(b)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    engine.on_step = None
    assert results == alone
    assert max(sizes) > 1  # they really shared decode steps


def test_seed_stop_and_penalty(lm, engine):
    _, tok = lm
    x = ids(tok, PROMPTS[0])
    sampled = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=50, top_p=0.95, seed=7)
    a, b = engine.generate(x, sampled), engine.generate(x, sampled)
    assert text_of(a) == text_of(b) and a[-1].finish_reason == "length"
    other = engine.generate(x, SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.9, seed=8))
    assert [e.token.id for e in other] != [e.token.id for e in a]
    greedy = text_of(engine.generate(x, SamplingParams(max_new_tokens=16)))
    stop = greedy[len(greedy) // 2: len(greedy) // 2 + 2]
    stopped = engine.generate(x, SamplingParams(max_new_tokens=16, stop=(stop,)))
    assert stopped[-1].finish_reason == "stop_sequence"
    assert text_of(stopped) == greedy[:greedy.find(stop)]
    penalised = text_of(engine.generate(x, SamplingParams(max_new_tokens=16, repetition_penalty=0.05)))  # < 1 favours seen tokens
    assert penalised != greedy


def test_eos_and_buckets(lm):
    model, tok = lm
    eng = Engine(model, tok, max_batch_size=4, batch_bucket=4, pad_to_multiple=16)
    shapes = []
    eng.on_step = lambda kind, b, dt, shape: shapes.append((kind, shape))
    eng.start()
    try:
        plain = Engine(model, tok).start()
        try:
            ref = text_of(plain.generate(ids(tok, PROMPTS[2]), SamplingParams(max_new_tokens=6)))
        finally:
            plain.stop()
        assert text_of(eng.generate(ids(tok, PROMPTS[2]), SamplingParams(max_new_tokens=6))) == ref
        assert ("prefill", (1, 16)) in shapes and ("decode", (1, 4)) in shapes  # (sequences, tokens padded)
    finally:
        eng.stop()
    eng = Engine(model, tok).start()
    try:
        greedy = eng.generate(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=8))
        eng.eos = {greedy[3].token.id}  # pretend the 4th token is EOS
        stopped = eng.generate(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=8))
    finally:
        eng.stop()
    first = next(i for i, e in enumerate(greedy) if e.token.id == greedy[3].token.id)
    assert stopped[-1].finish_reason == "eos_token" and len(stopped) == first + 1
    assert text_of(stopped) == tok.decode([e.token.id for e in greedy[:first]])


def test_batched_prefill_and_prefill_bucket(lm):
    """Requests waiting together are prefilled in one forward (up to max_prefill_tokens prompt tokens), a step with
    prefill padded to a multiple of PAD_SEQUENCE_TO_MULTIPLE_OF x PREFILL_BATCH_BUCKET_SIZE tokens; every
    request's greedy text is the one it gets alone."""
    model, tok = lm
    plain = Engine(model, tok).start()
    try:
        refs = [text_of(plain.generate(ids(tok, p), SamplingParams(max_new_tokens=6))) for p in PROMPTS]
    finally:
        plain.stop()
    eng = Engine(model, tok, max_batch_size=4, prefill_bucket=4, pad_to_multiple=8)
    shapes = []
    eng.on_step = lambda kind, b, dt, shape: shapes.append((kind, shape))
    results = [None] * len(PROMPTS)
    done = threading.Event()

    def emit_for(i):
        def emit(ev):
            if ev.finish_reason or ev.error:
                results[i] = ev
                if all(results):
                    done.set()
        return emit

    for i, p in enumerate(PROMPTS):  # queued before the engine starts: one step sees all four waiting
        eng.submit(ids(tok, p), SamplingParams(max_new_tokens=6), emit_for(i))
    eng.start()
    try:
        assert done.wait(60)
    finally:
        eng.stop()
    assert [r.generated_text for r in results] == refs
    prefills = [shape for kind, shape in shapes if kind == "prefill"]
    total = sum(len(ids(tok, p)) for p in PROMPTS)
    assert prefills == [(4, total + (-total % 32))], prefills  # one forward: 4 sequences, padded to a multiple of 8 x 4

    eng = Engine(model, tok, max_batch_size=4, prefill_bucket=4, max_prefill_tokens=40)
    shapes = []
    eng.on_step = lambda kind, b, dt, shape: shapes.append((kind, shape))
    for i, p in enumerate(PROMPTS[:2]):
        eng.submit(ids(tok, p), SamplingParams(max_new_tokens=2), lambda ev: None)
    eng.start()
    try:
        assert text_of(eng.generate(ids(tok, PROMPTS[2]), SamplingParams(max_new_tokens=2)))
    finally:
        eng.stop()
    prefills = [shape for kind, shape in shapes if kind == "prefill"]
    # prompt tokens <= 40 per step, plus one token per decoding sequence, padded to a multiple of 4
    assert all(n % 4 == 0 and n <= 40 + b + 3 for b, n in prefills) and prefills[0][0] >= 2, prefills


def test_warpers_and_processors_match_their_definitions():
    """typical_p is transformers' TypicalLogitsWarper; TGI's frequency penalty, OpenAI's presence/frequency
    penalties and TGI's watermark follow their documented formulas."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    from hqtflow.runtime.engine import Request, _warp

    torch.manual_seed(0)
    x = torch.randn(64) * 3
    for mass in (0.2, 0.5, 0.9):
        ours = _warp(x.clone(), SamplingParams(typical_p=mass))
        ref = TypicalLogitsWarper(mass)(None, x.clone()[None])[0]
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), mass
    eng = Engine.__new__(Engine)
    req = Request([1, 2, 2], SamplingParams(tgi_frequency_penalty=0.5), None, generated=[3, 2])
    out = eng._process(req, torch.zeros(8))
    assert out[2] == pytest.approx(-0.5 * 3 / 5) and out[1] == pytest.approx(-0.5 / 5) and out[0] == 0
    req = Request([1], SamplingParams(presence_penalty=0.25, frequency_penalty=0.5), None, generated=[3, 3, 4])
    out = eng._process(req, torch.zeros(8))
    assert out[3] == pytest.approx(-1.25) and out[4] == pytest.approx(-0.75) and out[1] == 0  # generated tokens only
    req = Request([5], SamplingParams(watermark=True), None)
    out = eng._process(req, torch.zeros(8))
    green = torch.randperm(8, generator=torch.Generator().manual_seed(15485863 * 5))[:4]
    assert set(out.nonzero()[:, 0].tolist()) == set(green.tolist()) and out.max() == 2.0
