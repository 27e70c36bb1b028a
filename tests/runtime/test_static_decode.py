"""The static-KV decoder (gpt-fast style) against transformers' `generate`, eager and compiled, bf16 and FP8."""

import pytest
import torch

from conftest import assert_same_decode, decode_to_the_last_slot, emulated_capture, run_cli
from hqtflow.runtime.static_decode import StaticDecoder


@pytest.fixture(scope="module")
def tiny_fp8(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("static")
    assert run_cli("measure", tiny_llama, "-o", out / "m", "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", out / "m", "-o", out / "fp8").exit_code == 0
    return out / "fp8"


def _hf_greedy(model, ids, n):
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:]


def test_static_equals_generate_fp32(tiny_llama):
    """Same model, same greedy rule: the static cache changes where K/V live, not the tokens (fp32: no ties)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (3, 11), generator=torch.Generator().manual_seed(0))
    res = StaticDecoder(model, max_length=32).generate(ids, 12)
    assert res.tokens.shape == (3, 12) and len(res.step_s) == 11 and res.prefill_s > 0
    assert torch.equal(res.tokens, _hf_greedy(model, ids, 12))
    again = StaticDecoder(model, max_length=32)
    assert torch.equal(again.generate(ids[:1], 5).tokens, res.tokens[:1, :5])  # cache reuse across batch sizes
    with pytest.raises(ValueError, match="exceed the cache"):
        again.generate(ids, 40)


def test_eos_stops_every_row(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    full = StaticDecoder(model, max_length=40).generate(ids, 20).tokens
    eos = int(full[0, 3])  # pretend the 4th token of row 0 is EOS
    res = StaticDecoder(model, max_length=40).generate(ids, 20, eos_token_id=eos)
    row0 = res.tokens[0].tolist()
    assert row0[:4] == full[0, :4].tolist() and set(row0[4:]) <= {eos}
    if eos in full[1].tolist():
        assert res.tokens.shape[1] <= 20
    else:
        assert res.tokens.shape[1] == 20
    ends = {int(full[0, 3]), int(full[1, 2])}  # several EOS ids (generation_config's list): each row stops at its own
    rows = StaticDecoder(model, max_length=40).generate(ids, 20, eos_token_id=ends).tokens.tolist()
    for row, first in zip(rows, (3, 2)):
        stop = next(i for i, t in enumerate(row) if t in ends)
        assert stop <= first and set(row[stop:]) == {row[stop]}


@pytest.mark.slow
def test_compiled_step_fp8_cpu_kernel(tiny_fp8, cpu_kernel_loaded):
    """FP8 (CPU kernel) through the compiled decode step: the custom op stays one call in the graph; tokens equal
    the eager static decoder's up to ties (compiled RMSNorm/rotary round differently: >= 90% of tokens agree)."""
    from hqtflow.evaluate import load_any

    model, tok, kind = load_any(str(tiny_fp8), backend="cpu")
    assert kind == "fp8"
    ids = torch.randint(5, 500, (2, 8), generator=torch.Generator().manual_seed(2))
    eager = StaticDecoder(model, max_length=32).generate(ids, 10).tokens
    compiled = StaticDecoder(model, max_length=32, compile=True).generate(ids, 10).tokens
    assert compiled.shape == eager.shape
    assert (compiled == eager).float().mean() >= 0.9


def test_graph_capture_leaves_the_cache_as_the_eager_step_does(tiny_llama, monkeypatch):
    """The CUDA-graph decode, with capture emulated on the CPU (its eager warm-ups, a recording that runs nothing,
    replays that rerun the step), sized as the CLI sizes it (prompt + new tokens): the warm-ups advanced the cache's
    write counter, so every later token's keys went two slots on and the last step wrote past the cache."""
    import hqtflow.runtime.cuda_graphs as cuda_graphs
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(cuda_graphs, "capture", emulated_capture)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(1))
    for new in (2, 12):  # one decode step (the warm-ups' second slot is never rewritten), and many
        eager = decode_to_the_last_slot(StaticDecoder(model, max_length=9 + new, cuda_graph=False), ids, new)
        graphed = StaticDecoder(model, max_length=9 + new, cuda_graph=True)
        assert_same_decode(decode_to_the_last_slot(graphed, ids, new), eager)
        assert graphed.graph_failed is None and graphed._graphs
        assert_same_decode(decode_to_the_last_slot(graphed, ids, new), eager)  # replayed after the cache's reset


def test_generate_engines_cli(tiny_fp8):
    """`hqtflow generate --engine static` prints the same greedy text as transformers' generate (QDQ backend)."""
    outs = {}
    for engine in ("transformers", "static"):
        r = run_cli("generate", tiny_fp8, "-p", "The history of", "--max-new-tokens", "8", "--engine", engine,
                    "--backend", "qdq")
        assert r.exit_code == 0, r.stdout + r.stderr
        outs[engine] = r.stdout
    assert outs["static"] == outs["transformers"]
    r = run_cli("generate", tiny_fp8, "--engine", "vllm")
    assert r.exit_code == 2 and "Unknown --engine" in r.stderr
    r = run_cli("generate", tiny_fp8, "--backend", "triton")
    assert r.exit_code == 2 and "FP8 backend must be auto, qdq, cpu or scaled_mm, not 'triton'" in r.stderr


@pytest.mark.slow
def test_compiled_attention_packs_grouped_heads_as_eager_does():
    """The compiled step's attention (`sdpa_gqa`): a single query token's heads packed onto their key/value heads, as
    transformers does eager (it repeats keys and values under torch.compile, 4x slower on CPU): the same bits as
    transformers' eager attention, and SDPA called on the packed shapes."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hqtflow.runtime.static_decode import sdpa_gqa

    g = torch.Generator().manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q = torch.randn(2, 6, 1, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 10, 16, generator=g).bfloat16() for _ in range(2))
    mask = torch.zeros(2, 1, 1, 10, dtype=torch.bfloat16)
    mask[0, ..., 7:] = float("-inf")  # an unfilled static cache past row 0's position
    eager, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    seen = []

    def attention(q, k, v, mask):
        return sdpa_gqa(module, q, k, v, mask, scaling=0.25)[0]

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend=lambda gm, _: seen.append(gm) or gm)(q, k, v, mask)
    assert compiled.shape == eager.shape == (2, 1, 6, 16)
    assert torch.equal(compiled, eager)
    sdpa = [n for gm in seen for n in gm.graph.nodes if n.target is torch._C._nn.scaled_dot_product_attention]
    assert sdpa and all(n.args[0].meta["example_value"].shape == (2, 2, 3, 16) for n in sdpa)


@pytest.mark.slow
def test_compiled_decoders_keep_their_own_graphs(tiny_factory):
    """The compiled step checks only its inputs' and global state's guards, not the model's or the cache's: in one
    process, decoders of models of different depths, each at two batch sizes, decode as their eager twins do, and a
    decoder's step keeps none of the model's guards (the code object is the decoder's own)."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(5, 500, (3, 7), generator=torch.Generator().manual_seed(4))
    for layers in (1, 3):
        model = AutoModelForCausalLM.from_pretrained(tiny_factory("llama", num_hidden_layers=layers),
                                                     dtype=torch.float32).eval()
        eager, compiled = StaticDecoder(model, max_length=24), StaticDecoder(model, max_length=24, compile=True)
        for rows in (ids, ids[:2], ids):
            assert torch.equal(compiled.generate(rows, 9).tokens, eager.generate(rows, 9).tokens)
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(compiled._step._torchdynamo_orig_callable)
        assert len(entries) == 2  # one graph per batch size, found again for the third call
        guards = str(entries[0].guard_manager)
        assert "source=L['tokens']" in guards and "L['self']" not in guards and "L['cache']" not in guards


@pytest.mark.slow
def test_compiled_decoder_uses_the_packed_attention(tiny_llama):
    from hqtflow import models
    from hqtflow.runtime.static_decode import ATTENTION

    model = models.load_model(tiny_llama, "bf16")
    StaticDecoder(model, max_length=16)
    assert model.config._attn_implementation == "sdpa"
    StaticDecoder(model, max_length=16, compile=True)
    assert model.config._attn_implementation == ATTENTION


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
@pytest.mark.parametrize("prompt", [5, 9])  # the window (8) fills while decoding, or in the prompt already
def test_graphed_sliding_window_decode_past_the_window(tiny_factory, model_type, prompt, monkeypatch):
    """A sliding-window model (Mistral: every layer; Gemma 3: local and global layers), window 8, decoding past it
    with capture emulated on the CPU, its replays seeing the cache layers' Python numbers as recorded (transformers'
    sliding static layer counts in a Python int: a real replay neither sees it advance nor advances it): the graphed
    decode equals the eager one, and both the greedy tokens of whole-sequence forwards without a cache."""
    import hqtflow.runtime.cuda_graphs as cuda_graphs
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_factory(model_type), dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (2, prompt), generator=torch.Generator().manual_seed(3))
    new = 12
    eager = decode_to_the_last_slot(StaticDecoder(model, max_length=prompt + new, cuda_graph=False), ids, new)
    seq = ids
    with torch.inference_mode():
        for _ in range(new):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(eager[0], seq[:, prompt:])
    graphed = StaticDecoder(model, max_length=prompt + new, cuda_graph=True)
    layers = lambda: [layer for cache in graphed._caches.values() for layer in cache.layers]  # noqa: E731
    monkeypatch.setattr(cuda_graphs, "capture", lambda fn, pool=None, warmup=2: emulated_capture(
        fn, pool, warmup, frozen=layers()))
    assert_same_decode(decode_to_the_last_slot(graphed, ids, new), eager)
    assert graphed.graph_failed is None and graphed._graphs
    assert_same_decode(decode_to_the_last_slot(graphed, ids, new), eager)  # replayed after the cache's reset
