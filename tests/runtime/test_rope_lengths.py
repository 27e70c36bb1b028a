"""RoPE whose frequencies depend on the sequence's length (dynamic NTK, Phi-3's longrope) in the serving engine: a
request's tokens and logprobs are transformers' generate on that request alone, whatever it is batched with and
however its prompt is chunked (transformers picks the frequencies from the longest position of the whole forward)."""

import threading

import pytest
import torch

from hqtflow.runtime.engine import Engine, SamplingParams

ROPES = {
    "llama_dynamic": ("llama", dict(max_position_embeddings=64, rope_scaling=dict(rope_type="dynamic", factor=4.0))),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=32,
                                   rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8,
                                                     long_factor=[4.0] * 8))),
}
NEW = 8


def run(model, tok, prompts, **engine_args):
    """Greedy events of every prompt, all submitted at once to one engine."""
    out, done = [[] for _ in prompts], threading.Event()

    def emit_for(i):
        def emit(ev):
            out[i].append(ev)
            if all(o and (o[-1].finish_reason or o[-1].error) for o in out):
                done.set()
        return emit

    engine = Engine(model, tok, max_batch_total_tokens=1024, **engine_args)
    for i, ids in enumerate(prompts):
        engine.submit(ids, SamplingParams(max_new_tokens=NEW, ignore_eos=True), emit_for(i))
    engine.start()
    try:
        assert done.wait(120)
    finally:
        engine.stop()
    return [([e.token.id for e in events], [e.token.logprob for e in events]) for events in out]


def generate_alone(path, ids):
    """transformers' generate on a freshly loaded model (dynamic NTK's module keeps what it grew to)."""
    from hqtflow import models

    model = models.load_model(path, "fp32")
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [s[0].log_softmax(-1)[t].item() for s, t in zip(out.logits, tokens)]  # raw: min_new_tokens masks EOS


@pytest.mark.parametrize("name", sorted(ROPES))
def test_length_dependent_rope_is_per_request(name, tiny_factory, wiki_text, tmp_path):
    from hqtflow import models

    model_type, overrides = ROPES[name]
    path = tiny_factory(model_type, **overrides)
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    with torch.no_grad():  # peaky attention, so that other frequencies change the tokens, not only the logprobs
        for n, p in model.named_parameters():
            if "q_proj" in n or "k_proj" in n or "qkv_proj" in n:
                p.mul_(6)
    long_ids = tok(wiki_text.read_text()[:4000])["input_ids"][:80]
    short_ids = tok("The tower is tall")["input_ids"]
    [alone] = run(model, tok, [long_ids])
    [chunked, beside] = run(model, tok, [long_ids, short_ids], max_prefill_tokens=16)
    [short_alone] = run(model, tok, [short_ids])
    assert chunked[0] == alone[0] and beside[0] == short_alone[0]
    assert chunked[1] == pytest.approx(alone[1], abs=1e-5) and beside[1] == pytest.approx(short_alone[1], abs=1e-5)
    model.save_pretrained(tmp_path)  # the same weights for transformers, loaded fresh
    for ids, got in ((long_ids, alone), (short_ids, short_alone)):
        ref = generate_alone(tmp_path, ids)
        assert got[0] == ref[0]
        assert got[1] == pytest.approx(ref[1], abs=1e-5)
