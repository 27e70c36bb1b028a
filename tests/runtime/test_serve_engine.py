"""The continuous-batching engine: greedy equals model.generate, batching does not change any request's text."""

import itertools
import math
import threading
import time

import pytest
import torch

from conftest import run_cli
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


def _concurrent_greedy_equals_recompute(model, tok) -> None:
    """Greedy tokens of two concurrent requests equal a full recompute of each (no cache), step by step."""
    prompts = [tok(p)["input_ids"] for p in ("The tower is", "A long way from home, the")]
    ref = []
    with torch.inference_mode():
        for ids in prompts:
            seq = list(ids)
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            ref.append(seq[len(ids):])
    eng = Engine(model, tok, max_batch_total_tokens=256).start()
    try:
        done = []
        threads = [threading.Thread(target=lambda i=i: done.append((i, eng.generate(prompts[i], SamplingParams(max_new_tokens=6)))))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        eng.stop()
    for i, events in sorted(done, key=lambda x: x[0]):
        assert [e.token.id for e in events] == ref[i]


def test_engine_on_a_model_whose_layers_drop_attention_kwargs(tiny_factory):
    """StableLM's decoder layers do not pass their keyword arguments on to attention: the engine's step plan still
    reaches it (it ran without the sequences' past: the first token right, every later one wrong)."""
    from hqtflow import models

    path = tiny_factory("stablelm")
    _concurrent_greedy_equals_recompute(models.load_model(path, "fp32"), models.load_tokenizer(path))


ENGINE_PATHS = {"whole": {}, "chunked": dict(max_prefill_tokens=5),  # chunks of 5 with a past
                "graph step": dict(cuda_graphs=(1, 2), capture=False)}  # CUDA graphs' fixed-shape step, run eagerly


def _equals_recompute(model, tok, ref, n: int) -> list[torch.Tensor]:
    """Two prompts (one longer than a window of 8, one shorter) greedily decoded together through every path of the
    engine (ENGINE_PATHS): each path's tokens and logprobs equal `ref`'s full recompute of the sequence. Returns the
    recompute's log-probabilities and the sequences, per prompt."""
    prompts = [tok(" ".join(["The tower is tall and the river is wide."] * 3))["input_ids"], tok("A way")["input_ids"]]
    assert len(prompts[0]) > 3 * 8 and len(prompts[1]) < 8
    outs = {name: run_all(Engine(model, tok, max_batch_total_tokens=256, **kw),
                          [(x, SamplingParams(max_new_tokens=n, ignore_eos=True)) for x in prompts])
            for name, kw in ENGINE_PATHS.items()}
    wants = []
    with torch.inference_mode():
        for i, x in enumerate(prompts):
            tokens = [e.token.id for e in outs["whole"][i]]
            seq = torch.tensor([x + tokens[:-1]])
            want = ref(seq, use_cache=False).logits[0, len(x) - 1:].log_softmax(-1)
            assert tokens == want.argmax(-1).tolist()
            for name, out in outs.items():
                assert [e.token.id for e in out[i]] == tokens, name
                torch.testing.assert_close(torch.tensor([e.token.logprob for e in out[i]]),
                                           want[torch.arange(n), tokens], rtol=1e-4, atol=1e-4)
            wants.append((want, seq, len(x)))
    return wants


def _log_probs(model, seq, prompt_length):
    with torch.inference_mode():
        return model(seq, use_cache=False).logits[0, prompt_length - 1:].log_softmax(-1)


@pytest.mark.parametrize("model_type, full", [("mistral", dict(sliding_window=None)),
                                               ("gemma3_text", dict(layer_types=["full_attention"] * 2))])
def test_sliding_window_models_equal_a_full_recompute(tiny_factory, model_type, full):
    """Sliding-window layers (window 8 here; Mistral: every layer, Gemma 3: a local and a global one) attend only
    their window in every path of the engine: a whole prefill, chunked prefill, decode through the CPU op beside a
    sequence shorter than the window, and the fixed-shape decode step of CUDA graphs. Tokens and logprobs equal
    transformers' full recompute with its sliding mask, which differs from the same weights without the window."""
    from hqtflow import models

    path = tiny_factory(model_type)
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    want, seq, length = _equals_recompute(model, tok, model, 12)[0]
    unwindowed = models.load_model(tiny_factory(model_type, **full), "fp32")
    assert (_log_probs(unwindowed, seq, length) - want).abs().max() > 1e-2  # the window matters for this prompt


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_soft_capping_and_sinks_equal_eager_attention(tiny_factory, model_type):
    """Gemma 2's soft-capped attention scores (a cap of 0.05 here) and gpt-oss's attention sinks (one logit per head,
    drawn large here), which SDPA does not compute, in every path of the engine, with sliding-window layers beside
    full ones: tokens and logprobs equal transformers' eager full recompute, which differs without them; the model
    run outside the engine (no step plan) equals eager too."""
    from hqtflow import models

    path = tiny_factory(model_type)
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    with torch.no_grad():
        for layer in model.model.layers:  # scores of a few units (random weights give ~0.01: a cap or sink changes little)
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
            if model_type == "gpt_oss":
                layer.self_attn.sinks.copy_(torch.randn(4, generator=torch.Generator().manual_seed(0)) * 3)
    ref = models.load_model(path, "fp32")
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("eager")
    want, seq, length = _equals_recompute(model, tok, ref, 10)[0]
    torch.testing.assert_close(_log_probs(model, seq, length), want, rtol=1e-4, atol=1e-4)  # outside the engine
    with torch.no_grad():
        for layer in ref.model.layers:  # without them, other numbers
            if model_type == "gemma2":
                layer.self_attn.attn_logit_softcapping = None
            else:
                layer.self_attn.sinks.fill_(-1e9)
    assert (_log_probs(ref, seq, length) - want).abs().max() > 1e-2


def test_mla_keys_and_values_of_two_widths(tiny_factory):
    """DeepSeek's multi-head latent attention hands attention keys 24 wide and values 16 wide (the engine sized
    its slots from config.head_dim, 8, and failed at the first step): slots of the wider, values zero-padded, in
    every path of the engine; tokens and logprobs equal transformers' eager full recompute."""
    from hqtflow import models

    path = tiny_factory("deepseek_v3")
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    ref = models.load_model(path, "fp32")
    ref.set_attn_implementation("eager")
    assert all(Engine(model, tok, max_batch_total_tokens=256, **kw).pool.keys[0].shape[-1] == 24 for kw in ENGINE_PATHS.values())
    _equals_recompute(model, tok, ref, 8)


def test_engine_refuses_attention_it_does_not_compute(tiny_factory):
    """Layers of another attention type (Llama 4's chunked) are refused when the engine is made, naming them, and
    attention sinks a module holds but does not pass to attention at the first step: not silently left out."""
    from hqtflow import models

    path = tiny_factory("mistral")
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    model.config.layer_types = ["chunked_attention", "full_attention"]  # Llama 4's: neither full nor sliding
    with pytest.raises(ValueError, match="no chunked_attention layers, which this mistral uses"):
        Engine(model, tok)
    model.config.layer_types = None
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    eng = Engine(model, tok).start()
    try:
        events = eng.generate(tok("A way")["input_ids"], SamplingParams(max_new_tokens=2))
        assert "has attention sinks but did not pass them" in str(events[-1].error), events[-1]
    finally:
        eng.stop()


def test_key_value_heads_as_transformers_groups_them(tiny_factory):
    """The KV cache holds the key/value heads transformers' attention hands it: GPT-NeoX ignores a stray
    `num_key_value_heads` in its config (the engine sized its cache from it and failed at the first step); a
    multi-query GPT-BigCode has one. Tokens and logprobs equal a full recompute in every path of the engine."""
    from hqtflow import models

    for model_type, kw, kv in [("gpt_neox", dict(num_key_value_heads=2), 4), ("gpt_bigcode", dict(multi_query=True), 1)]:
        path = tiny_factory(model_type, **kw)
        model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
        assert Engine(model, tok, max_batch_total_tokens=256).pool.keys[0].shape[-2] == kv, model_type
        _equals_recompute(model, tok, models.load_model(path, "fp32"), 6)


def test_engine_refuses_a_model_whose_attention_it_cannot_replace(tiny_factory):
    """Falcon's attention went around transformers' attention interface before transformers 5.25: transformers only
    logged that it could not switch it, and the engine ran the model without its KV cache (wrong tokens, no error).
    Refused where transformers cannot switch it; where it can (5.25 on), the engine's tokens are a recompute's."""
    from hqtflow import models
    from hqtflow.runtime import paged

    path = tiny_factory("falcon")
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    try:
        Engine(model, tok)
    except ValueError as e:
        assert "does not go through transformers' attention interface" in str(e), e
        assert model.config._attn_implementation != paged.NAME  # refused only where transformers did not switch
        return
    _concurrent_greedy_equals_recompute(model, tok)


def test_the_tokenizers_eos_ends_a_sequence_beside_the_generation_configs(lm):
    """A chat fine-tune's end-of-turn is often its tokenizer's eos_token while generation_config names the base
    model's: either ends the sequence."""
    model, tok = lm
    other = next(t for t in range(len(tok)) if t not in tok.all_special_ids)
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = other
    try:
        eng = Engine(model, tok, max_batch_total_tokens=256).start()
        try:
            for forced in (tok.eos_token_id, other):
                out = eng.generate(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=6, logit_bias={forced: 100.0}))
                assert [e.token.id for e in out] == [forced] and out[-1].finish_reason == "eos_token"
        finally:
            eng.stop()
    finally:
        model.generation_config.eos_token_id = saved


def test_logit_bias_on_every_token(lm, engine):
    """A bias on the whole vocabulary (one indexed add): -100 on every token but one, which greedy decoding then
    always picks; the same request without the bias does not."""
    _, tok = lm
    keep = tok("river")["input_ids"][-1]
    bias = {t: (0.0 if t == keep else -100.0) for t in range(len(tok))}
    out = engine.generate(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=6, logit_bias=bias, ignore_eos=True))
    assert [e.token.id for e in out] == [keep] * 6
    plain = engine.generate(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [e.token.id for e in plain] != [keep] * 6


def test_abort_ends_running_waiting_and_later_requests(lm):
    """`abort` (a server shutting down): running and waiting requests end with the reason as their error, their
    blocks freed; a request submitted afterwards ends the same way at once."""
    _, tok = lm
    eng = Engine(*lm, max_batch_size=1)  # one runs, one waits
    jobs = [(ids(tok, p), SamplingParams(max_new_tokens=500, ignore_eos=True)) for p in PROMPTS[:2]]
    reqs = [eng.submit(x, p, lambda ev: None) for x, p in jobs]
    eng.step()
    assert eng.active == [reqs[0]] and list(eng.pending) == [reqs[1]]
    events = [[] for _ in jobs]
    for r, out in zip(reqs, events):
        r.emit = out.append
    eng.start()
    try:
        eng.abort("the server is shutting down")
        later = eng.generate(ids(tok, PROMPTS[2]), SamplingParams(max_new_tokens=5))
        assert later[-1].error == "the server is shutting down"
        assert [out[-1].error for out in events] == ["the server is shutting down"] * 2
        assert not eng.active and not eng.pending and eng.pool.num_free == eng.pool.num_blocks
    finally:
        eng.stop()


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
    events = engine.generate(x, SamplingParams(max_new_tokens=16))
    greedy = text_of(events)
    ends = list(itertools.accumulate(len(e.token.text) for e in events))  # where each token's text ends
    # a stop sequence across a token boundary: the last character of token k and the first of token k + 1
    k, at = next((k, ends[k] - 1) for k in range(len(ends) // 2, len(ends) - 1) if ends[k - 1] < ends[k] < ends[k + 1]
                 and greedy.find(greedy[ends[k] - 1:ends[k] + 1]) == ends[k] - 1)
    stop = greedy[at:at + 2]
    stopped = engine.generate(x, SamplingParams(max_new_tokens=16, stop=(stop,)))
    assert stopped[-1].finish_reason == "stop_sequence" and stopped[-1].stop_at == at
    # ended by the token that completes it, whose text holds only its end; the text of every generated token, the
    # stop sequence included (TGI's generated_text; OpenAI cuts at stop_at)
    assert len(stopped) == k + 2 and text_of(stopped) == "".join(e.token.text for e in stopped) == greedy[:ends[k + 1]]
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


def test_processed_logprobs_are_of_the_distribution_sampled_from(lm, engine):
    """processed_logprobs (TGI's routes): the chosen token's logprob and the top-n are the log_softmax of the logits
    after the processors and warpers (TGI's NextTokenChooser), rebuilt here with transformers' warpers; tokens they
    rule out are not listed. Without it (OpenAI's routes), and for a request nothing processes, they stay the model's
    raw log_softmax. (Every logprob was the raw one: temperature 0.05 or top_k 1 did not change it.)"""
    from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    model, tok = lm
    prompt = ids(tok, PROMPTS[3])
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()[None]
    raw = torch.log_softmax(logits[0], -1)
    cases = [(dict(temperature=0.05, do_sample=True, seed=1), [TemperatureLogitsWarper(0.05)]),
             (dict(top_k=1, do_sample=True, seed=1), [TopKLogitsWarper(1)]),
             (dict(temperature=0.7, top_k=20, top_p=0.8, do_sample=True, seed=3),
              [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)]),
             (dict(repetition_penalty=3.0), [RepetitionPenaltyLogitsProcessor(3.0)]), (dict(), [])]
    for kw, warpers in cases:
        x = logits.clone()
        for w in warpers:
            x = w(torch.tensor([prompt]), x)
        want = torch.log_softmax(x[0], -1)
        first = {}
        for processed in (True, False):
            ev = engine.generate(prompt, SamplingParams(max_new_tokens=1, top_n=40, processed_logprobs=processed, **kw))[0]
            first[processed] = ev.token
            ref = want if processed else raw
            assert ev.token.logprob == pytest.approx(float(ref[ev.token.id]), abs=1e-4), (kw, processed)
            finite = int(torch.isfinite(ref).sum())
            assert len(ev.token.top) == min(40, finite), (kw, processed)  # ruled-out tokens are not listed
            assert [v for _, v in ev.token.top] == pytest.approx(ref.topk(min(40, finite)).values.tolist(), abs=1e-4)
        assert first[True].id == first[False].id, kw  # the same token either way (same seed)
    ev = engine.generate(prompt, SamplingParams(max_new_tokens=1, top_n=3, top_k=1, do_sample=True, seed=1, processed_logprobs=True))[0]
    assert ev.token.logprob == 0.0 and len(ev.token.top) == 1
    greedy = [engine.generate(prompt, SamplingParams(max_new_tokens=4, top_n=3, processed_logprobs=p)) for p in (True, False)]
    assert [(e.token.id, e.token.logprob, e.token.top) for e in greedy[0]] == [(e.token.id, e.token.logprob, e.token.top) for e in greedy[1]]


def test_tgi_top_n_lists_every_token_tied_with_the_nth(tiny_llama):
    """TGI's top_n_tokens is "fuzzy": every token whose logprob equals the n-th's is listed too (TGI's
    batch_top_tokens), so n=2 with the 2nd..5th tied lists 5; OpenAI's top_logprobs (top_n_ties off) lists exactly n.
    Ties made real: the tiny Llama's lm_head rows of the 3rd..5th likeliest tokens set to the 2nd's."""
    from hqtflow import models

    model, tok = models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama)
    prompt = ids(tok, PROMPTS[0])
    with torch.inference_mode():
        order = model(torch.tensor([prompt])).logits[0, -1].argsort(descending=True).tolist()
        head = model.get_output_embeddings().weight
        head[order[2:5]] = head[order[1]].clone()
    eng = Engine(model, tok, max_batch_total_tokens=256).start()
    try:
        tied = eng.generate(prompt, SamplingParams(max_new_tokens=1, top_n=2, processed_logprobs=True, top_n_ties=True))[0]
        exact = eng.generate(prompt, SamplingParams(max_new_tokens=1, top_n=2, processed_logprobs=True))[0]
        top1 = eng.generate(prompt, SamplingParams(max_new_tokens=1, top_n=1, top_n_ties=True))[0]
    finally:
        eng.stop()
    assert tied.token.top[0][0] == order[0] and sorted(i for i, _ in tied.token.top[1:]) == sorted(order[1:5])
    assert len({v for _, v in tied.token.top[1:]}) == 1 and tied.token.top[0][1] > tied.token.top[1][1]
    assert exact.token.top[0][0] == order[0] and len(exact.token.top) == 2
    assert [i for i, _ in top1.token.top] == [order[0]]  # nothing ties with the first: one


def test_tgi_top_n_ties_leave_out_ruled_out_tokens():
    """With fewer finite tokens than n (top_k's -inf), the fuzzy top-n lists the finite ones only, as TGI (its n-th
    -inf becomes the float minimum), not the whole -inf vocabulary."""
    from hqtflow.runtime.engine import _top_tokens

    lp = torch.tensor([-0.5, -1.0, -math.inf, -1.0, -math.inf, -3.0])
    assert [[i for i, _ in top] for top in _top_tokens([lp] * 3, [2, 2, 5], [True, False, True])] == [[0, 1, 3], [0, 1], [0, 1, 3, 5]]
    assert _top_tokens([torch.tensor([0.0, -math.inf, -math.inf])], [3], [True]) == [[(0, 0.0)]]


def _top_tokens_per_row(logprobs, n, ties):
    """engine._top_tokens as it was, row by row (3 host reads a row, 4 with ties): the reference of the batched one."""
    n = min(n, logprobs.numel())
    if ties:
        nth = float(logprobs.topk(n).values[-1])
        n = int((logprobs >= (nth if nth != -math.inf else torch.finfo(logprobs.dtype).min)).sum().clamp(min=1))
    t = logprobs.topk(n)
    return [(i, v) for i, v in zip(t.indices.tolist(), t.values.tolist()) if v != -math.inf]


def test_top_n_of_every_row_at_once_lists_what_the_per_row_function_listed():
    """Rows of random logprobs with many ties (a few dozen distinct values), some with fewer finite tokens than n,
    some flat (more ties than the first transfer holds): the same logprobs in the same order as the per-row function,
    the same tokens with ties, and exactly n the same tokens above the n-th, the n-th's ties by lowest id (topk's
    choice among equal values is arbitrary: it changes with k)."""
    from hqtflow.runtime.engine import _top_tokens

    g = torch.Generator().manual_seed(0)
    for vocab in (7, 512, 49152):
        rows = [torch.log_softmax((torch.randn(vocab, generator=g) * 3).round() / 2, -1) for _ in range(12)]
        rows[3][torch.randperm(vocab, generator=g)[: vocab - 2]] = -math.inf
        rows[5][torch.randperm(vocab, generator=g)[: vocab - 1]] = -math.inf
        rows[7] = torch.full((vocab,), -math.log(vocab))
        rows[8] = torch.full((vocab,), -math.inf)
        ns = [1 + (r * 7) % 20 for r in range(12)]
        for ties in (True, False):
            for x, n, got in zip(rows, ns, _top_tokens(rows, ns, [ties] * 12)):
                ref = _top_tokens_per_row(x, n, ties)
                assert [v for _, v in got] == [v for _, v in ref] and got == sorted(got, key=lambda p: (-p[1], p[0]))
                if ties or not ref:
                    assert sorted(got) == sorted(ref)
                    continue
                last = ref[-1][1]
                assert {p for p in got if p[1] != last} == {p for p in ref if p[1] != last}
                lowest = torch.nonzero(x == last).flatten().tolist()[: sum(v == last for _, v in got)]
                assert [i for i, v in got if v == last] == lowest


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the reads of tensor values into Python (each a host sync on a GPU)."""
    READS = ("tolist", "item", "__float__", "__int__", "__bool__", "__index__")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def test_a_steps_top_n_tokens_cost_one_host_read_for_all_rows(lm):
    """TGI's top_n_tokens (with ties) of 4 greedy rows: the step's sampling reads its picks once and the top-n of
    every row once (it read each row's n-th, its count of ties and its top-n: 4 reads a row)."""
    from hqtflow.runtime.engine import Request

    eng = Engine(*lm, max_batch_total_tokens=64)
    reqs = [Request([1, 2], SamplingParams(top_n=n, top_n_ties=True), lambda ev: None) for n in (1, 2, 5, 5)]
    logits = (torch.randn(4, eng.model.config.vocab_size, generator=torch.Generator().manual_seed(0)) * 4).round()
    with HostReads() as reads:
        out = eng._sample(reqs, logits)
    assert reads.count == 2 and [len(top) >= n for (_, _, top), n in zip(out, (1, 2, 5, 5))] == [True] * 4


class VocabCopies(torch.overrides.TorchFunctionMode):
    """Counts the copies of tensors of at least `width` values (a row of logits)."""
    COPIES = ("clone", "copy_", "cpu", "to", "contiguous", "float")

    def __init__(self, width: int):
        super().__init__()
        self.width, self.count = width, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in self.COPIES and args[0].numel() >= self.width
        return func(*args, **(kwargs or {}))


def test_a_grammar_masks_its_row_of_the_logits_in_place(lm):
    """A grammar's step copies no row of logits (it cloned the row, copied it to the CPU and back: on a loaded CPU
    each copy of 49152 floats is an OpenMP region, ms waiting for a worker); its bitmask is made once per request."""
    from hqtflow.runtime.engine import Request
    from hqtflow.runtime.grammar import compile_grammar, matcher

    model, tok = lm
    width = model.get_output_embeddings().out_features
    req = Request([1, 2], SamplingParams(), lambda ev: None,
                  matcher=matcher(compile_grammar(tok, "regex", "[0-9]{3}", vocab_size=width)))
    eng, g = Engine(model, tok, max_batch_total_tokens=64), torch.Generator().manual_seed(0)
    with VocabCopies(width) as copies:
        [(first, _, _)] = eng._sample([req], torch.randn(1, width, generator=g))
    assert copies.count == 0
    mask = req.bitmask
    [(second, _, _)] = eng._sample([req], torch.randn(1, width, generator=g))
    assert req.bitmask is mask and tok.decode([first, second]).isdigit()


def test_top_p_keeps_transformers_smallest_set_reaching_the_mass():
    """top_p keeps what transformers' TopPLogitsWarper (and TGI) keep: the smallest set whose mass reaches top_p, also
    when a prefix's mass equals top_p exactly (it kept one token more: [.25, .25, .25, .125, .125] at 0.5 kept 3)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from hqtflow.runtime.engine import _warp

    def kept(x, top_p):
        ours = torch.isfinite(_warp(x.clone(), SamplingParams(do_sample=True, top_p=top_p)))
        ref = torch.isfinite(TopPLogitsWarper(top_p)(None, x.clone()[None])[0])
        assert torch.equal(ours, ref), (x, top_p, ours, ref)
        return int(ours.sum())

    exact = [([.5, .25, .25], .5, 1), ([.25, .25, .25, .125, .125], .5, 2), ([.25, .25, .25, .125, .125], .75, 3),
             ([.4, .3, .2, .1], .7, 2), ([.4, .3, .2, .1], 1e-4, 1)]
    for probs, top_p, n in exact:
        assert kept(torch.tensor(probs).log(), top_p) == n, (probs, top_p)
    torch.manual_seed(0)
    for _ in range(20):
        x = torch.randn(512) * 3
        for top_p in (0.1, 0.5, 0.9, 0.99):
            kept(x, top_p)


def test_fp16_overflow_ends_only_the_request_whose_logits_overflow(tiny_llama):
    """--dtype fp16 (api.Fp16Overflow on the lm_head): a request whose logits are NaN or infinite ends alone with the
    guard's sentence (kept in `tripped`, which generate and eval re-raise); its neighbour in the same batch answers as
    it does alone, and so does a request after it on the blocks its infinite keys and values were written to. The
    overflow is real: one token's embedding row is 1e5, fine in fp32, infinity in fp16."""
    from hqtflow import models
    from hqtflow.api import guard_fp16

    model, tok = models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama)
    bad, good, later = ids(tok, "The tower is"), ids(tok, "A cold day"), ids(tok, "A game")
    assert bad[-1] not in good + later
    with torch.no_grad():
        model.get_input_embeddings().weight[bad[-1]] = 1e5
    model.half()
    guard = guard_fp16(model, "the tiny model")
    params = SamplingParams(max_new_tokens=4, top_n=2)

    def tokens(events):
        assert events[-1].finish_reason == "length", events[-1]
        return [(e.token.id, [i for i, _ in e.token.top]) for e in events]

    def alone(x):
        eng = Engine(model, tok, max_batch_total_tokens=64)
        out = []
        eng.submit(x, params, out.append)
        while eng.step():
            pass
        return tokens(out)

    expected = [alone(good), alone(later)]
    assert guard.tripped is None
    eng = Engine(model, tok, max_batch_total_tokens=64)
    out = [[], [], []]
    eng.submit(bad, params, out[0].append), eng.submit(good, params, out[1].append)
    first = eng.pool.free_blocks[-1]  # the block the first request admitted takes
    eng.step()
    assert [e.error for e in out[0]] == [f"ModelError: {guard.tripped}"]
    assert [e.error for e in out[1]] == [None]  # its first token: the step went on without the overflowed request
    assert "the tiny model computes NaN or infinite logits in fp16" in str(guard.tripped)
    eng.submit(later, params, out[2].append)
    eng.step()
    assert eng.active[-1].blocks == [first]  # the overflowed request's block, given back
    while eng.step():
        pass
    assert [tokens(out[1]), tokens(out[2])] == expected


# -- paged KV cache, chunked prefill, determinism ------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm16(tiny_llama):
    """bf16, loaded as serve loads it (`load_any`: on the CPU kernel's packed-bf16 Linears where it takes bf16), so
    outputs can be compared bit for bit between a request alone and inside a batch."""
    from hqtflow.api import load_any

    return load_any(str(tiny_llama), "bf16")[:2]


def run_all(eng, jobs):
    """Submit every (ids, params) before the engine thread starts (they all wait together); every request's events."""
    out, done = [[] for _ in jobs], threading.Event()

    def emit_for(i):
        def emit(ev):
            out[i].append(ev)
            if (ev.finish_reason or ev.error) and all(o and (o[-1].finish_reason or o[-1].error) for o in out):
                done.set()
        return emit

    for i, (x, p) in enumerate(jobs):
        eng.submit(x, p, emit_for(i))
    eng.start()
    try:
        assert done.wait(120)
    finally:
        eng.stop()
    return out


def test_paged_cache_admits_by_free_blocks_and_preempts(lm16):
    """A KV pool of 4 blocks x 16 tokens: requests wait for free blocks, decoding ones preempt the newest (recomputed
    later), and every request still gets its full answer; the pool is whole again at the end."""
    model, tok = lm16
    jobs = [(ids(tok, p), SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in PROMPTS]
    eng = Engine(model, tok, max_batch_total_tokens=64, block_size=16)
    assert eng.pool.num_blocks == 4 and eng.capacity_tokens == 64
    out = run_all(eng, jobs)
    assert all(len(o) == 20 and o[-1].finish_reason == "length" for o in out), [o[-1] for o in out]
    assert eng.stats.preemptions > 0 and eng.stats.max_running <= 4
    assert eng.pool.num_free == 4 and not eng.active and not eng.pending
    big = Engine(model, tok, max_batch_total_tokens=4096)
    assert big.pool.num_blocks == 256
    alone = run_all(big, jobs)  # a recomputed sequence runs its generated tokens through decode steps again: exact
    assert [[(e.token.id, e.token.logprob) for e in o] for o in out] == [[(e.token.id, e.token.logprob) for e in o] for o in alone]
    too_long = Engine(model, tok, max_batch_total_tokens=16, block_size=16)
    ev = run_all(too_long, [(list(range(5, 40)), SamplingParams(max_new_tokens=2))])[0]
    assert ev[-1].error and "does not fit in the KV cache" in ev[-1].error


def test_queue_time_counts_every_wait_after_a_preemption_too(lm16, monkeypatch):
    """A request's queue time (x-queue-time, tgi_request_queue_duration) is all the time it waited in the queue: the
    first wait and each one after a preemption (only the first counted, so a preempted request's waits showed as
    inference time). A clock that ticks a second per step: each second a request spent waiting counts once."""
    import types

    from hqtflow.runtime import engine as engine_module

    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], perf_counter=time.perf_counter))
    model, tok = lm16
    eng = Engine(model, tok, max_batch_total_tokens=64, block_size=16)
    reqs = [eng.submit(ids(tok, p), SamplingParams(max_new_tokens=20, ignore_eos=True), lambda ev: None) for p in PROMPTS]
    waits, first_waits = [0] * len(reqs), [None] * len(reqs)
    while eng.step():
        for i, req in enumerate(reqs):
            if req in eng.pending:
                waits[i] += 1
            elif first_waits[i] is None:
                first_waits[i] = waits[i]
        clock[0] += 1.0
    assert all(r.finished for r in reqs) and any(r.preempted for r in reqs)
    assert [r.queue_time(clock[0]) for r in reqs] == waits
    assert any(r.preempted and w > f for r, w, f in zip(reqs, waits, first_waits))  # waits after a preemption count


def test_identical_requests_are_distinct_under_preemption(lm16):
    """Requests equal field by field (same prompt, same params object, same callback) are still distinct requests:
    preemption takes the newest one, and every one of them gets its whole answer."""
    model, tok = lm16
    params, events, lock = SamplingParams(max_new_tokens=20, ignore_eos=True), [], threading.Lock()

    def emit(ev):
        with lock:
            events.append(ev)

    eng = Engine(model, tok, max_batch_total_tokens=64, block_size=16)
    reqs = [eng.submit(ids(tok, PROMPTS[1]), params, emit) for _ in range(4)]
    while eng.step():
        pass
    assert eng.stats.preemptions > 0
    assert [len(r.generated) for r in reqs] == [20] * 4 and all(r.finished for r in reqs)
    assert sum(e.finish_reason == "length" for e in events) == 4 and not any(e.error for e in events)
    assert len({tuple(r.generated) for r in reqs}) == 1 and eng.pool.num_free == 4


def test_prefill_budget_a_long_chunk_leaves_goes_to_the_prompts_behind_it(lm):
    """Chunks are cut at fixed multiples of max_prefill_tokens, so a long prompt whose chunk does not fit what an
    earlier prompt left of the step's budget waits for the next step; the short prompts behind it take that rest
    now (they waited for the long prompt's whole prefill: TGI would have cut the long chunk to the rest and run it).
    Next step the long prompt, ahead of them, gets its whole chunk: its chunks and outputs do not change."""
    model, tok = lm
    short, later, long_prompt = ids(tok, PROMPTS[0]), ids(tok, PROMPTS[2]), ids(tok, " ".join(PROMPTS * 2))
    assert len(long_prompt) > 32 + len(short)
    eng = Engine(model, tok, max_prefill_tokens=32, max_batch_total_tokens=512)
    steps = []
    eng.on_step = lambda kind, b, dt, shape: steps.append(shape)
    out: dict = {}
    reqs = [eng.submit(x, SamplingParams(max_new_tokens=2), lambda ev, k=k: out.setdefault(k, []).append(ev))
            for k, x in (("short", short), ("long", long_prompt), ("later", later))]
    eng.step()
    assert steps == [(2, len(short) + len(later))] and "later" in out and reqs[1].computed == 0
    eng.step()
    assert reqs[1].computed == 32  # its first chunk, whole
    while eng.step():
        pass
    alone = Engine(model, tok, max_prefill_tokens=32, max_batch_total_tokens=512)
    ref = alone.submit(long_prompt, SamplingParams(max_new_tokens=2), lambda ev: out.setdefault("ref", []).append(ev))
    while alone.step():
        pass
    assert [e.token.id for e in out["long"]] == [e.token.id for e in out["ref"]] and ref.finished


def test_chunked_prefill_runs_beside_decoding_streams(lm16):
    """A long prompt is prefilled in chunks of max_prefill_tokens while a running stream keeps decoding in the same
    steps; several waiting prompts share one step; outputs equal the ones alone (chunks are cut at fixed offsets)."""
    model, tok = lm16
    long_prompt = ids(tok, " ".join(PROMPTS * 3))
    assert len(long_prompt) > 40
    ref_eng = Engine(model, tok, max_prefill_tokens=16)
    ref = [run_all(Engine(model, tok, max_prefill_tokens=16), [(x, SamplingParams(max_new_tokens=8))])[0]
           for x in (ids(tok, PROMPTS[0]), long_prompt, ids(tok, PROMPTS[2]))]
    del ref_eng
    eng = Engine(model, tok, max_prefill_tokens=16)
    steps, started = [], threading.Event()

    def on_step(kind, b, dt, shape):
        steps.append((kind, b, shape[1]))
        started.set()

    eng.on_step = on_step
    eng.start()
    try:
        first: list = []
        eng.submit(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=8), first.append)
        assert started.wait(30)
        rest = [eng.generate(long_prompt, SamplingParams(max_new_tokens=8))]
        while not (first and first[-1].finish_reason):
            time.sleep(0.01)
    finally:
        eng.stop()
    assert [e.token.id for e in first] == [e.token.id for e in ref[0]]
    assert [e.token.id for e in rest[0]] == [e.token.id for e in ref[1]]
    prefill_steps = [s for s in steps if s[0] == "prefill"]
    assert len(prefill_steps) >= -(-len(long_prompt) // 16)  # the long prompt took several steps
    assert all(n <= 16 + b for _, b, n in prefill_steps)  # <= 16 prompt tokens + one token per decoding sequence
    assert any(b == 2 for _, b, _ in prefill_steps)  # a prefill chunk and a decode token in one step
    both = run_all(Engine(model, tok, max_prefill_tokens=64),
                   [(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=8)), (ids(tok, PROMPTS[2]), SamplingParams(max_new_tokens=8))])
    assert [[e.token.id for e in o] for o in both] == [[e.token.id for e in r] for r in (ref[0], ref[2])]


def test_a_long_prompt_in_chunks_equals_it_whole_and_running_streams_decode_between_chunks(lm):
    """A prefill budget below the prompt's length: the long prompt is prefilled over several steps, each of which
    also gives the running stream a token (the step plan, not timing); its tokens, logprobs and prompt logprobs equal
    those of the prompt prefilled whole."""
    model, tok = lm
    long_prompt = ids(tok, " ".join(PROMPTS * 3))
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, prompt_logprobs=2, top_n=2)
    whole = run_all(Engine(model, tok, max_prefill_tokens=4096), [(long_prompt, params)])[0]
    eng = Engine(model, tok, max_prefill_tokens=16)
    plans = []
    schedule = eng._schedule
    eng._schedule = lambda: plans.append(plan := schedule()) or plan
    stream, chunked = [], []
    running = eng.submit(ids(tok, PROMPTS[0]), SamplingParams(max_new_tokens=40, ignore_eos=True), stream.append)
    eng.step()
    long = eng.submit(long_prompt, params, chunked.append)
    while eng.step():
        pass
    prefill_steps = [dict((r, n) for r, n in p) for p in plans[1:] if any(r is long and n > 1 for r, n in p)]
    assert len(prefill_steps) == -(-len(long_prompt) // 16) >= 3
    assert all(p[long] <= 16 and p[running] == 1 for p in prefill_steps)  # a token for the stream in every chunk's step
    assert [(e.token.id, e.token.text) for e in chunked] == [(e.token.id, e.token.text) for e in whole]
    torch.testing.assert_close(torch.tensor([e.token.logprob for e in chunked]), torch.tensor([e.token.logprob for e in whole]),
                               rtol=1e-4, atol=1e-4)
    assert [[t for t, _ in e.token.top] for e in chunked] == [[t for t, _ in e.token.top] for e in whole]
    got, want = chunked[-1].prompt, whole[-1].prompt
    assert len(got) == len(want) == len(long_prompt) and got[0] == want[0] == (None, [])
    torch.testing.assert_close(torch.tensor([lp for lp, _ in got[1:]]), torch.tensor([lp for lp, _ in want[1:]]),
                               rtol=1e-4, atol=1e-4)
    assert [[t for t, _ in top] for _, top in got] == [[t for t, _ in top] for _, top in want]
    # a pool too small for both: the stream's next block preempts the long prompt between its chunks; recomputed
    # from its first chunk, it gives the same answer (its prompt logprobs scored once)
    stream_prompt = ids(tok, PROMPTS[3])
    stream_prompt = stream_prompt + stream_prompt[:15 - len(stream_prompt) % 16]  # it needs a block two steps on
    blocks = sum(-(-(len(x) + 1) // 16) for x in (stream_prompt, long_prompt))  # what both need when admitted
    eng = Engine(model, tok, max_prefill_tokens=16, max_batch_total_tokens=16 * blocks)
    partial = []
    preempt = eng._preempt
    eng._preempt = lambda req: (partial.append(0 < req.computed < len(req.input_ids)), preempt(req))
    eng.submit(stream_prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), stream.append)
    eng.step()
    long = eng.submit(long_prompt, params, chunked.clear() or chunked.append)
    while eng.step():
        pass
    assert long.preempted and partial[0], partial
    assert [e.token.id for e in chunked] == [e.token.id for e in whole] and len(chunked[-1].prompt) == len(long_prompt)


def test_seeded_request_alone_equals_inside_a_busy_batch(lm16):
    """Sampling with a seed: the same request gives the same tokens alone and among 7 other requests (greedy and
    sampled, different lengths, joining at different steps)."""
    model, tok = lm16
    probe = (ids(tok, PROMPTS[3]), SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, seed=11,
                                                 ignore_eos=True))
    alone = run_all(Engine(model, tok), [probe])[0]
    noise = [(ids(tok, PROMPTS[i % 4]) * (1 + i % 3), SamplingParams(max_new_tokens=4 + 3 * i, do_sample=i % 2 == 1, seed=i))
             for i in range(7)]
    eng = Engine(model, tok, max_prefill_tokens=32)
    busy = run_all(eng, noise[:3] + [probe] + noise[3:])[3]
    assert [e.token.id for e in busy] == [e.token.id for e in alone]
    assert [e.token.logprob for e in busy] == [e.token.logprob for e in alone]
    assert eng.stats.max_running == 8


@pytest.mark.slow
def test_a_plain_model_loaded_for_serving_is_batch_invariant(smollm2, cpu_kernel_loaded):
    """The real SmolLM2 loaded as serve, generate and eval load a plain model (`load_any`, CPU, --dtype auto): every
    Linear on the kernel's packed-bf16 path, so a prompt's logits are the same bits alone and beside two others at
    every length (with oneDNN's bf16 GEMM on a 2-core AMX Xeon, k_proj/v_proj gave a row other sums at 64 tokens: a
    served request's logprobs, and sometimes its text, changed with its neighbours). --backend qdq keeps F.linear."""
    from torch import nn

    from hqtflow.api import load_any
    from hqtflow.quantize.bf16_linear import PackedBf16Linear

    model, _, _ = load_any(str(smollm2), "auto")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 30 * 7 + 1 and all(isinstance(m, PackedBf16Linear) and m.packed is not None for m in linears)
    x = torch.randint(3, model.config.vocab_size, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for t in (1, 9, 64):
            assert torch.equal(model(x[:1, :t]).logits[0], model(x[:, :t]).logits[0]), t
    plain, _, _ = load_any(str(smollm2), "auto", backend="qdq")
    assert not any(isinstance(m, PackedBf16Linear) for m in plain.modules())


def test_fp8_kv_cache_in_the_engine(tiny_llama, wiki_text, tmp_path):
    """--kv-cache fp8: the pool stores float8 with the checkpoint's k/v scales; a checkpoint without them is refused."""
    from hqtflow.evaluate import load_any

    assert run_cli("measure", tiny_llama, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "kv", "--kv-cache", "fp8").exit_code == 0
    model, tok, _ = load_any(str(tmp_path / "kv"), "bf16")
    eng = Engine(model, tok, kv_cache="fp8")
    assert eng.pool.keys[0].dtype == torch.float8_e4m3fn and eng.pool.scales is not None
    x = ids(tok, PROMPTS[1])
    fp8 = run_all(eng, [(x, SamplingParams(max_new_tokens=12, ignore_eos=True))])[0]
    bf16 = run_all(Engine(model, tok), [(x, SamplingParams(max_new_tokens=12, ignore_eos=True))])[0]
    assert len(fp8) == 12 and sum(a.token.id == b.token.id for a, b in zip(fp8, bf16)) >= 6
    # the fixed-shape decode step of CUDA graphs (run eagerly here) reads and writes the FP8 pool the same way
    batched = run_all(Engine(model, tok, kv_cache="fp8", cuda_graphs=(1, 2), capture=False),
                      [(x, SamplingParams(max_new_tokens=12, ignore_eos=True))])[0]
    assert [e.token.id for e in batched] == [e.token.id for e in fp8]
    torch.testing.assert_close(torch.tensor([e.token.logprob for e in batched]), torch.tensor([e.token.logprob for e in fp8]),
                               rtol=2e-2, atol=2e-2)
    plain, _, _ = load_any(str(tiny_llama), "bf16")
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        Engine(plain, tok, kv_cache="fp8")
    from hqtflow.errors import HqtflowError
    from hqtflow.runtime.server import ServeSettings, _app

    with pytest.raises(HqtflowError, match="no KV-cache scales .* serve it with --kv-cache bf16"):
        _app(plain, tok, ServeSettings(kv_cache="fp8"))
    r = run_cli("serve", "bf16", str(tiny_llama), "--kv-cache", "int8", "--port", "1")
    assert r.exit_code == 2 and "bf16 or fp8" in r.stderr


@pytest.mark.slow
def test_smollm2_greedy_alone_in_a_batch_and_generate(smollm2):
    """The real SmolLM2 (bf16): a greedy request gives model.generate's tokens, alone and among 5 others."""
    from hqtflow import models

    model, tok = models.load_model(smollm2, "bf16"), models.load_tokenizer(smollm2)
    x = ids(tok, "The capital of France is")
    with torch.inference_mode():
        ref = model.generate(torch.tensor([x]), max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)[0, len(x):]
    probe = (x, SamplingParams(max_new_tokens=12))
    others = [(ids(tok, p), SamplingParams(max_new_tokens=6 + 2 * i)) for i, p in enumerate(PROMPTS + PROMPTS[:1])]
    alone = run_all(Engine(model, tok), [probe])[0]
    busy = run_all(Engine(model, tok, max_prefill_tokens=24), others[:2] + [probe] + others[2:])[2]
    assert [e.token.id for e in alone] == [e.token.id for e in busy] == ref.tolist()[:len(alone)]


def test_decode_attention_of_a_sequence_ignores_its_neighbours():
    """paged_attention, decode rows: a sequence's output is bit-identical alone and beside sequences of other
    lengths, in float32 (SmolLM2's 9 query / 3 KV heads of 64): a batched matmul changes its rounding with the batch
    size and pads contexts, which static FP8 scales then amplify into different tokens."""
    from types import SimpleNamespace

    from hqtflow.runtime.paged import KVPool, Seq, StepPlan, paged_attention

    torch.manual_seed(0)
    pool = KVPool(layers=1, kv_heads=3, head_dim=64, num_blocks=64, block_size=16, dtype=torch.float32, device="cpu")
    lengths = [37, 5, 130, 37, 64]
    tables = [pool.allocate(pool.blocks_for(n)) for n in lengths]
    for table, n in zip(tables, lengths):  # each context's keys/values, as earlier steps wrote them
        pool.write(0, pool.slots(table, 0, n), torch.randn(n, 3, 64), torch.randn(n, 3, 64))
    layer = SimpleNamespace(layer_idx=0)

    def step(which):  # one decode token per sequence in `which`, each at the end of its context
        seqs = [Seq(j, 1, lengths[i] - 1, pool.slots(tables[i], lengths[i] - 1, lengths[i]), pool.slots(tables[i], 0, lengths[i]))
                for j, i in enumerate(which)]
        q, k, v = torch.randn(1, 9, len(which), 64), torch.randn(1, 3, len(which), 64), torch.randn(1, 3, len(which), 64)
        q[0, :, :] = queries[:, which]
        k[0, :, :], v[0, :, :] = last_k[:, which], last_v[:, which]
        return paged_attention(layer, q, k, v, None, paged=StepPlan(pool, seqs, len(which)))[0][0]

    queries, last_k, last_v = torch.randn(9, 5, 64), torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    together = step([0, 1, 2, 3, 4])
    for i in range(5):
        assert torch.equal(step([i])[0], together[i]), i
    assert torch.equal(step([3, 2, 0])[2], together[0])
