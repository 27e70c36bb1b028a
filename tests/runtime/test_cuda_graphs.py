"""Decode steps as CUDA graphs (runtime/cuda_graphs.py): the fixed-shape batched step they capture is checked here on
the CPU (`capture=False`: the same buckets, dummy rows and masks, run eagerly) against the per-sequence path; the
capture itself runs only on a CUDA GPU."""

import pytest
import torch

from conftest import assert_same_decode, decode_to_the_last_slot
from hqtflow.runtime.cuda_graphs import DecodeGraphs, parse_batch_sizes
from hqtflow.runtime.engine import Engine, SamplingParams
from hqtflow.runtime.paged import DecodeBatch, KVPool, Seq, StepPlan, paged_attention

PROMPTS = ["The tower is", "In 1990 the band released their second album , which",
           "A", "The game was played on a cold day in the north of the country and"]


def test_parse_batch_sizes():
    assert parse_batch_sizes("8,1, 2,2") == (1, 2, 8)
    assert parse_batch_sizes("0") == () and parse_batch_sizes("") == ()
    with pytest.raises(ValueError, match="non-negative"):
        parse_batch_sizes("-1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_attention_equals_each_sequence_alone(dtype):
    """Batched over 8 rows (5 real, 3 dummies), contexts masked past their lengths: each row's output is the
    per-sequence float32 attention's, to float32 rounding in float32 (to bf16 rounding in bf16), whatever the
    unwritten slots of a row's last block hold; the new keys/values land in their slots and the dummies write only
    the scratch slot."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    pool = KVPool(layers=1, kv_heads=3, head_dim=64, num_blocks=64, block_size=16, dtype=dtype, device="cpu")
    for t in pool.keys + pool.values:  # unwritten slots hold whatever memory held: NaN here (it did on an H100)
        t.fill_(float("nan"))
    scratch = pool.allocate(1)[0] * 16
    pool.zero(scratch)
    lengths = [37, 5, 130, 16, 64]
    tables = [pool.allocate(pool.blocks_for(n)) for n in lengths]
    for table, n in zip(tables, lengths):
        pool.write(0, pool.slots(table, 0, n - 1), torch.randn(n - 1, 3, 64), torch.randn(n - 1, 3, 64))
    q, k, v = (torch.randn(1, h, 8, 64).to(dtype) for h in (9, 3, 3))
    layer = SimpleNamespace(layer_idx=0)
    before = pool.keys[0].clone()
    plan = DecodeBatch(pool, 8, 256, scratch)
    plan.fill([(0, n - 1, table) for n, table in zip(lengths, tables)])
    batched = paged_attention(layer, q, k, v, None, paged=plan)[0][0]
    after = pool.keys[0].clone()
    changed = ((after != before) & ~(after.isnan() & before.isnan())).any(-1).any(-1).nonzero().flatten().tolist()
    expected = sorted([pool.slots(t, n - 1, n).item() for t, n in zip(tables, lengths)] + [scratch])
    assert changed == expected
    pool.keys[0].copy_(before)
    for i, (n, table) in enumerate(zip(lengths, tables)):
        seq = Seq(0, 1, n - 1, pool.slots(table, n - 1, n), pool.slots(table, 0, n))
        alone = paged_attention(layer, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], None,
                                paged=StepPlan(pool, [seq], 1))[0][0, 0]
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: a few units in the last place of values ~1
        torch.testing.assert_close(batched[i], alone, rtol=tol, atol=tol)
    assert torch.isfinite(batched).all()


def test_buckets():
    pool = KVPool(layers=1, kv_heads=1, head_dim=8, num_blocks=80, block_size=16, dtype=torch.float32, device="cpu")
    g = DecodeGraphs(None, pool, (1, 2, 4, 8), 0, capture=False)
    assert g.shape(3, 10) == (4, 256) and g.shape(1, 257) == (1, 512) and g.shape(8, 1280) == (8, 2048)
    assert g.shape(9, 10) is None and g.shape(1, 1281) is None  # more rows than the largest bucket; past the pool


@pytest.fixture(scope="module")
def lm(tiny_llama):
    from hqtflow import models

    return models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama)


def _run(eng, jobs):
    outs = [[] for _ in jobs]
    for (x, p), out in zip(jobs, outs):
        eng.submit(x, p, out.append)
    while eng.step():
        pass
    return outs


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_engine_decode_steps_through_the_batched_step(lm, compile):
    """The engine with decode graphs (run eagerly here; compiled or not) generates what the per-sequence engine does:
    same greedy tokens, logprobs to float32 rounding, through mixed prefill/decode steps and batches of 1..4 (buckets
    1, 2, 4; compiled: 2, 4, and one compile)."""
    from torch._dynamo.utils import counters

    model, tok = lm
    torch._dynamo.reset()
    counters.clear()
    jobs = [(tok(p)["input_ids"], SamplingParams(max_new_tokens=6 + 3 * i)) for i, p in enumerate(PROMPTS)]
    steps = []
    graphed = Engine(model, tok, cuda_graphs=(1, 2, 4), capture=False, max_prefill_tokens=24, compile=compile,
                     on_step=lambda kind, n, s, shape: steps.append((kind, shape)))
    ref = _run(Engine(model, tok, max_prefill_tokens=24), jobs)
    got = _run(graphed, jobs)
    assert graphed.graphs is not None and graphed.graphs.failed is None
    assert ("decode", (4, 4)) in steps and ("decode", (3, 4)) in steps  # 3 sequences: one dummy row
    # compiled: one sequence runs in the bucket of 2, so every bucket shares one compile (a size of 1 would add one)
    assert ("decode", (1, 2 if compile else 1)) in steps
    assert counters["frames"]["ok"] == (1 if compile else 0)
    assert any(kind == "prefill" for kind, _ in steps)
    for a, b in zip(ref, got):
        assert [e.token.id for e in a] == [e.token.id for e in b]
        torch.testing.assert_close(torch.tensor([e.token.logprob for e in a]), torch.tensor([e.token.logprob for e in b]),
                                   rtol=1e-4, atol=1e-4)
        assert a[-1].generated_text == b[-1].generated_text and b[-1].finish_reason == "length"
    assert graphed.pool.num_free == graphed.pool.num_blocks - 1  # every block back but the scratch one


def test_engine_on_cpu_has_no_graphs(lm):
    assert Engine(*lm).graphs is None


def test_compile_without_decode_graphs_is_refused(lm):
    """compile=True compiles the graphs' decode step: without graphs it would be silently ignored, so it is refused."""
    with pytest.raises(ValueError, match="--compile compiles the CUDA-graph decode steps"):
        Engine(*lm, compile=True)
    with pytest.raises(ValueError, match="--compile compiles the CUDA-graph decode steps"):
        Engine(*lm, cuda_graphs=(), compile=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled-graphs"])
def test_graphs_on_cuda_match_eager(lm, compile):
    """On CUDA: greedy tokens of captured decode steps (the eager step or the compiled one) equal the eager
    per-sequence engine's; each shape is captured once and replayed."""
    model, tok = lm
    model = model.to("cuda")  # float32: the batched and per-sequence kernels agree far below a token flip
    try:
        jobs = [(tok(p)["input_ids"], SamplingParams(max_new_tokens=12)) for p in PROMPTS]
        ref = _run(Engine(model, tok, cuda_graphs=(), max_batch_total_tokens=4096), jobs)
        eng = Engine(model, tok, max_batch_total_tokens=4096, compile=compile)
        got = _run(eng, jobs)
        assert eng.graphs is not None and eng.graphs.failed is None and eng.graphs.graphs
        assert [[e.token.id for e in a] for a in ref] == [[e.token.id for e in b] for b in got]
    finally:
        model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_decoder_graph_on_cuda_matches_eager(lm):
    """StaticDecoder on CUDA, its cache sized as the CLI sizes it (prompt + new tokens, so the last slot is written):
    the captured decode step gives the eager step's tokens, last logits, keys, values and write counters (batch 1 and
    3), on its first generate (the capture's warm-ups) and replayed after the cache's reset."""
    from hqtflow.runtime.static_decode import StaticDecoder

    model, tok = lm
    model = model.to("cuda")
    try:
        for batch in (1, 3):
            ids = torch.tensor([tok(PROMPTS[1])["input_ids"]] * batch)
            size = ids.shape[1] + 16
            eager = decode_to_the_last_slot(StaticDecoder(model, max_length=size, cuda_graph=False), ids, 16)
            graphed = StaticDecoder(model, max_length=size)
            assert graphed.cuda_graph
            assert_same_decode(decode_to_the_last_slot(graphed, ids, 16), eager, atol=1e-5)
            assert graphed.graph_failed is None and graphed._graphs
            assert_same_decode(decode_to_the_last_slot(graphed, ids, 16), eager, atol=1e-5)
    finally:
        model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_static_decoder_graph_on_cuda_past_a_sliding_window(tiny_factory, model_type):
    """A sliding-window model (window 8: Mistral's every layer, Gemma 3's local ones), the prompt (9 tokens) and the
    decode past the window: the captured steps give the eager steps' tokens, last logits and cache (transformers'
    sliding static layer kept a Python counter the replays never advanced: they wrote past its window)."""
    from transformers import AutoModelForCausalLM

    from hqtflow.runtime.static_decode import StaticDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_factory(model_type), dtype=torch.float32).eval().to("cuda")
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(3))
    eager = decode_to_the_last_slot(StaticDecoder(model, max_length=9 + 16, cuda_graph=False), ids, 16)
    graphed = StaticDecoder(model, max_length=9 + 16)
    assert graphed.cuda_graph
    assert_same_decode(decode_to_the_last_slot(graphed, ids, 16), eager, atol=1e-5)
    assert graphed.graph_failed is None and graphed._graphs
    assert_same_decode(decode_to_the_last_slot(graphed, ids, 16), eager, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_decoder_compiled_graph_on_cuda_matches_eager(lm):
    """StaticDecoder(compile=True) on CUDA: the compiled step is what the graph captures (gpt-fast's reduce-overhead);
    its tokens, last logits and cache (sized to the last slot) are the eager step's (fp32, inductor's own kernels)."""
    from hqtflow.runtime.static_decode import StaticDecoder

    model, tok = lm
    model = model.to("cuda")
    try:
        ids = torch.tensor([tok(PROMPTS[1])["input_ids"]] * 2)
        size = ids.shape[1] + 16
        eager = decode_to_the_last_slot(StaticDecoder(model, max_length=size, cuda_graph=False), ids, 16)
        dec = StaticDecoder(model, max_length=size, compile=True)
        assert dec.cuda_graph and dec.compiled
        assert_same_decode(decode_to_the_last_slot(dec, ids, 16), eager, atol=1e-3)
        assert dec.graph_failed is None and dec._graphs
    finally:
        model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_checkpoint_loads_onto_cuda_whole_and_its_engine_captures(tiny_llama, wiki_text, tmp_path):
    """The server's loader on CUDA puts every tensor on the GPU, the buffers computed at construction (rotary) too:
    left on the CPU, each forward copied them over, graph capture failed and the FP8 server decoded eagerly."""
    from conftest import run_cli
    from hqtflow.api import load_any

    assert run_cli("measure", tiny_llama, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "fp8").exit_code == 0
    model, tok, kind = load_any(str(tmp_path / "fp8"), "bf16", device="cuda")
    assert kind == "fp8" and {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cuda"}
    eng = Engine(model, tok, max_batch_total_tokens=4096)
    outs = _run(eng, [(tok(p)["input_ids"], SamplingParams(max_new_tokens=8)) for p in PROMPTS])
    assert all(o and o[-1].finish_reason for o in outs)
    assert eng.graphs is not None and eng.graphs.failed is None and eng.graphs.graphs


def test_graph_buckets_cover_every_step_up_to_a_context():
    """`buckets(n)`: the (batch, context) shapes that decode steps of sequences of at most n tokens use, which the
    server captures before it accepts requests; past the pool's slots nothing is listed (such steps run eagerly)."""
    from types import SimpleNamespace

    pool = SimpleNamespace(num_blocks=64, block_size=16)  # 1024 slots
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.pool, graphs.batch_sizes, graphs.failed, graphs.max_context = pool, (1, 2, 4), None, 1024
    assert graphs.buckets(200) == [(1, 256), (2, 256), (4, 256)]
    assert graphs.buckets(600) == [(b, c) for b in (1, 2, 4) for c in (256, 512, 1024)]
    assert graphs.buckets(10_000) == graphs.buckets(1024)
    for b in range(1, 5):
        for n in range(1, 1025, 37):
            assert graphs.shape(b, n) in graphs.buckets(n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_all_before_requests_then_no_capture_while_serving(lm):
    """Every bucket captured up front on dummy rows; the engine's steps then replay them (no new graph) and generate
    what the eager engine does."""
    model, tok = lm
    model = model.to("cuda")
    try:
        jobs = [(tok(p)["input_ids"], SamplingParams(max_new_tokens=12)) for p in PROMPTS]
        ref = _run(Engine(model, tok, cuda_graphs=(), max_batch_total_tokens=4096), jobs)
        eng = Engine(model, tok, max_batch_total_tokens=4096)
        n = eng.graphs.capture_all(512)
        assert eng.graphs.failed is None and n == len(eng.graphs.buckets(512)) == 12
        got = _run(eng, jobs)
        assert len(eng.graphs.graphs) == n
        assert [[e.token.id for e in a] for a in ref] == [[e.token.id for e in b] for b in got]
    finally:
        model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("layout", ["mixed", "fresh"])
def test_varlen_attention_on_cuda_matches_each_sequence_alone(monkeypatch, window, fp8, layout):
    """A CUDA step's sequences in one flash-attention call (paged.varlen_runs): a fresh prompt, a chunk after its
    past and decoding tokens, out of order with padding rows ("mixed"), or fresh prompts side by side ("fresh"), each
    row as the per-sequence path computes it (SDPA per chunk, float32 per decoding token), to bf16 rounding, in a
    sliding window or not, over a bf16 or FP8 cache."""
    from types import SimpleNamespace

    from hqtflow.runtime import paged

    torch.manual_seed(0)
    dev, kvh, heads, d = "cuda", 2, 6, 64
    scales = [(torch.tensor(0.02), torch.tensor(0.03))] if fp8 else None
    pool = KVPool(layers=1, kv_heads=kvh, head_dim=d, num_blocks=64, block_size=16, dtype=torch.bfloat16, device=dev,
                  scales=scales)
    # (new tokens, past): decoding (1, p), a chunk after its past (n, p), a fresh prompt (n, 0)
    shapes = [(1, 40), (20, 0), (17, 33), (1, 5)] if layout == "mixed" else [(20, 0), (3, 0), (31, 0)]
    seqs, start = [], 0
    for n, past in shapes:
        table = pool.allocate(pool.blocks_for(past + n))
        if past:
            pool.write(0, pool.slots(table, 0, past), torch.randn(past, kvh, d, device=dev) * 2,
                       torch.randn(past, kvh, d, device=dev) * 2)
        seqs.append(Seq(start, n, past, pool.slots(table, past, past + n), pool.slots(table, 0, past + n), past + n))
        start += n
    T = start + (3 if layout == "mixed" else 0)
    q, k, v = (torch.randn(1, h, T, d, device=dev, dtype=torch.bfloat16) * 2 for h in (heads, kvh, kvh))
    layer = SimpleNamespace(layer_idx=0, _parameters={})
    keys, values = pool.keys[0].clone(), pool.values[0].clone()
    one_call = paged_attention(layer, q, k, v, None, paged=StepPlan(pool, seqs, T), sliding_window=window)[0][0]
    pool.keys[0].copy_(keys)
    pool.values[0].copy_(values)
    monkeypatch.setattr(paged, "varlen_runs", lambda query: False)
    each = paged_attention(layer, q, k, v, None, paged=StepPlan(pool, seqs, T), sliding_window=window)[0][0]
    torch.testing.assert_close(one_call, each, rtol=1.6e-2, atol=1.6e-2)
    assert (one_call[start:] == 0).all() and torch.isfinite(one_call).all()


def test_varlen_packing_of_a_step():
    """What the CUDA varlen call is handed (built on any device): cumulative query lengths over the step's
    sequences in order, each one's keys from its first query's window to its last token (so the call's bottom-right
    causal alignment puts query i at position past + i), the longest of each; no slots when every sequence is a fresh
    prompt in a bf16 cache (the keys are the step's own)."""
    pool = KVPool(layers=1, kv_heads=1, head_dim=8, num_blocks=16, block_size=4, dtype=torch.bfloat16, device="cpu")
    seqs, start = [], 0
    for n, past in ((1, 9), (5, 0), (3, 6)):
        table = pool.allocate(pool.blocks_for(past + n))
        seqs.append(Seq(start, n, past, pool.slots(table, past, past + n), pool.slots(table, 0, past + n), past + n))
        start += n
    plan = StepPlan(pool, seqs, start + 2)
    rows, cu_q, cu_k, max_q, max_k, slots = plan.varlen(None)
    assert rows == slice(0, 9) and cu_q.tolist() == [0, 1, 6, 9] and cu_k.tolist() == [0, 10, 15, 24]
    assert (max_q, max_k) == (5, 10) and torch.equal(slots, torch.cat([s.read for s in seqs]))
    _, _, cu_k, _, max_k, slots = plan.varlen(4)  # a window of 4: the first query of each sees 3 keys back
    assert cu_k.tolist() == [0, 4, 9, 15] and max_k == 6
    assert torch.equal(slots, torch.cat([seqs[0].read[6:], seqs[1].read, seqs[2].read[3:]]))
    assert plan.varlen(4)[2] is cu_k  # built once per step and window
    fresh = StepPlan(pool, [Seq(0, 5, 0, seqs[1].write, seqs[1].read, 5)], 5)
    assert fresh.varlen(None)[5] is None
