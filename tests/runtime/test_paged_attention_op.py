"""hqtflow's CPU decode attention op (runtime/csrc/paged_attention_cpu.cpp) against the Python reference
(`pool.read` + `attend_one`, float32), and its batch invariance: a sequence's output is the same bits alone, in any
batch, in any order, on any number of threads, and in the one-lane (scalar) build."""

import itertools

import pytest
import torch

from hqtflow.runtime.paged import KVPool, attend_one
from hqtflow.scales import quantize

HEADS, KV_HEADS, D = 6, 2, 44  # grouped-query attention; d not a multiple of 8 (the vector loops' tails)
DIMS = (D, 64, 128)  # and the head dims whose value sums run a whole row per position


def _case(dtype, fp8=None, per_head=False, lengths=(1, 5, 17, 64, 130), seed=0, q_scale=1.0, d=D):
    """A filled pool and B decoding queries, each with its own scattered slots: (pool, q [B, heads, d], reads)."""
    g = torch.Generator().manual_seed(seed)
    scales = None
    if fp8:
        s = (torch.rand(KV_HEADS, generator=g) + 0.5) / 100 if per_head else torch.tensor(0.013)
        scales = [(s, s * 1.5)]
    pool = KVPool(layers=1, kv_heads=KV_HEADS, head_dim=d, num_blocks=256, block_size=8, dtype=dtype, device="cpu",
                  scales=scales, fp8=fp8 or "E4M3")
    slots = torch.randperm(256 * 8, generator=g)
    pool.write(0, slots, torch.randn(len(slots), KV_HEADS, d, generator=g).to(dtype) * 2,
               torch.randn(len(slots), KV_HEADS, d, generator=g).to(dtype))
    reads, start = [], 0
    assert sum(lengths) <= len(slots)
    for n in lengths:
        reads.append(slots[start:start + n])
        start += n
    q = (torch.randn(len(lengths), HEADS, d, generator=g) * q_scale).to(dtype)
    return pool, q, reads


def _op(pool, q, reads, ops=None, **extra):
    ops = ops or torch.ops.hqtflow
    ks, vs = pool.scales[0] if pool.scales is not None else (None, None)
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in reads]).cumsum(0).tolist()])
    return ops.paged_decode_attention(q, pool.keys[0], pool.values[0], torch.cat(reads), offsets, ks, vs,
                                      q.shape[-1] ** -0.5, **extra)


def _reference(pool, q, reads, **extra):
    return torch.stack([attend_one(q[b], *pool.read(0, r, q.dtype), None, **extra) for b, r in enumerate(reads)])


SINKS = torch.tensor([-1.0, 0.5, 3.0, -20.0, 0.0, 8.0])  # one logit per query head: weak to dominant
EXTRAS = {"softcap": dict(softcap=0.3), "sinks": dict(sinks=SINKS), "both": dict(softcap=0.3, sinks=SINKS)}


CASES = [("fp32", torch.float32, None, False), ("bf16", torch.bfloat16, None, False),
         ("bf16 + fp8 e4m3", torch.bfloat16, "E4M3", False), ("fp32 + fp8 e4m3 per head", torch.float32, "E4M3", True),
         ("fp32 + fp8 e5m2 per head", torch.float32, "E5M2", True)]


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("name,dtype,fp8,per_head", CASES, ids=[c[0] for c in CASES])
def test_matches_the_per_sequence_reference(cpu_kernel_loaded, name, dtype, fp8, per_head, d):
    """The same function as pool.read + attend_one: float32 throughout, only the summation order differs (the op's
    order is fixed; torch's depends on the shapes), so within a few float32 ulps before the cast to q's dtype."""
    pool, q, reads = _case(dtype, fp8, per_head, d=d)
    got, ref = _op(pool, q, reads), _reference(pool, q, reads)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)  # one bf16 rounding apart
    torch.testing.assert_close(got, ref, **tol)


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("per_head", [False, True])
def test_every_fp8_code_is_read_as_the_reference_reads_it(cpu_kernel_loaded, fp8, dtype, per_head):
    """Each sequence attends to one position, so its output is that position's value row as the op widened it: all 256
    codes (NaN and subnormals included) are code * scale rounded to q's dtype, as `pool.read` reads them (E4M3 with a
    bf16 or fp32 query is widened 8 codes at a time, the others through a table)."""
    d, codes = 64, torch.arange(256, dtype=torch.uint8)
    scales = [(torch.tensor([0.02, 3.5]), torch.tensor([0.0173, 1e-3]))] if per_head else [(torch.tensor(0.5), torch.tensor(0.0173))]
    pool = KVPool(layers=1, kv_heads=KV_HEADS, head_dim=d, num_blocks=1, block_size=8, dtype=dtype, device="cpu",
                  scales=scales, fp8=fp8)
    pool.keys[0].view(torch.uint8).zero_()
    pool.values[0].view(torch.uint8)[:4] = torch.stack([codes.reshape(4, d), codes.flip(0).reshape(4, d)], 1)
    reads = [torch.tensor([s]) for s in range(4)]
    q = torch.randn(4, HEADS, d).to(dtype)
    got = _op(pool, q, reads)
    _, values = pool.read(0, torch.arange(4), dtype)
    want = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.any()
    assert torch.equal(got[~nan], want[~nan])  # every subnormal; -0 comes out as 0 (the weighted sum starts at +0)


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_head", [False, True])
def test_the_pool_stores_the_reference_codes(cpu_kernel_loaded, fp8, dtype, per_head):
    """An FP8 pool's write (the kernel library's fp8_quantize on a CPU) stores `quantize`'s bytes: saturated past the
    format's maximum, subnormals, a strided input like the attention's [T, kv_heads, d] view."""
    s = torch.tensor([0.02, 3.5]) if per_head else torch.tensor(0.0173)
    pool = KVPool(layers=1, kv_heads=KV_HEADS, head_dim=D, num_blocks=4, block_size=8, dtype=dtype, device="cpu",
                  scales=[(s, s * 2)], fp8=fp8)
    x = torch.randn(KV_HEADS, 20, D) * torch.logspace(-8, 6, 20).reshape(1, 20, 1)  # [heads, T, d], as attention has it
    k, v = x.to(dtype).transpose(0, 1), (-x).to(dtype).transpose(0, 1)
    slots = torch.randperm(32)[:20]
    pool.write(0, slots, k, v)
    for stored, src, scale in ((pool.keys[0], k, pool.scales[0][0]), (pool.values[0], v, pool.scales[0][1])):
        assert torch.equal(stored.view(torch.uint8)[slots], quantize(src, scale, fp8).view(torch.uint8))


def test_peaked_scores_and_long_contexts(cpu_kernel_loaded):
    """Scores hundreds apart (exp underflows to 0 for most positions) and contexts over several 128-position chunks,
    whose partial softmaxes the op merges: as close to a float64 reference as torch's float32 path is."""
    for q_scale, lengths in ((40.0, (1, 9, 300)), (1.0, (128, 129, 256, 257, 500))):
        pool, q, reads = _case(torch.float32, lengths=lengths, q_scale=q_scale)
        exact = []
        for b, r in enumerate(reads):
            k, v = (t.double().repeat_interleave(HEADS // KV_HEADS, dim=1) for t in pool.read(0, r, torch.float32))
            w = (torch.einsum("hd,lhd->hl", q[b].double(), k) * D ** -0.5).softmax(-1)
            exact.append(torch.einsum("hl,lhd->hd", w, v))
        exact = torch.stack(exact)
        op_err = (_op(pool, q, reads).double() - exact).abs().max().item()
        torch_err = (_reference(pool, q, reads).double() - exact).abs().max().item()
        assert op_err <= 4 * torch_err + 1e-6, (q_scale, op_err, torch_err)


@pytest.mark.parametrize("name,dtype,fp8,per_head", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("d", (D, 64))
def test_a_sequence_is_the_same_alone_and_in_any_batch(cpu_kernel_loaded, name, dtype, fp8, per_head, d):
    pool, q, reads = _case(dtype, fp8, per_head, lengths=(3, 64, 1, 200, 17, 9, 130, 40), d=d)
    full = _op(pool, q, reads)
    for b in range(len(reads)):
        assert torch.equal(_op(pool, q[b:b + 1], reads[b:b + 1]), full[b:b + 1])
    order = torch.randperm(len(reads), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_op(pool, q[order], [reads[i] for i in order]), full[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_op(pool, q, reads), full)
    finally:
        torch.set_num_threads(threads)


def test_the_one_lane_build_gives_the_same_bits(cpu_kernel_loaded):
    """The order of operations is written out (8 lanes, a fixed tree): vector builds compute what the scalar one does."""
    from conftest import need

    need(cpu_kernel_loaded.load("scalar"), f"the scalar build failed: {cpu_kernel_loaded.build_error('scalar')}")
    for (_, dtype, fp8, per_head), d in itertools.product(CASES, DIMS):
        pool, q, reads = _case(dtype, fp8, per_head, d=d)
        assert torch.equal(_op(pool, q, reads), _op(pool, q, reads, cpu_kernel_loaded.ops("scalar")))


@pytest.mark.parametrize("extra", EXTRAS, ids=list(EXTRAS))
@pytest.mark.parametrize("name,dtype,fp8,per_head", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_soft_capping_and_sinks(cpu_kernel_loaded, extra, name, dtype, fp8, per_head):
    """Gemma 2's soft-capped scores and gpt-oss's sink logits: the function of `attend_one` (transformers' eager
    arithmetic), which they change (a cap of 0.3 flattens the scores; a sink of 8 takes most of a head's weight), the
    same bits alone and in a batch, and in the one-lane build."""
    kw = EXTRAS[extra]
    pool, q, reads = _case(dtype, fp8, per_head, q_scale=4.0)
    got, ref = _op(pool, q, reads, **kw), _reference(pool, q, reads, **kw)
    tol = dict(rtol=1e-5, atol=4e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)  # summation order
    torch.testing.assert_close(got, ref, **tol)
    assert (got.float() - _op(pool, q, reads).float()).abs().max() > 0.05  # they matter here
    for b in range(len(reads)):
        assert torch.equal(_op(pool, q[b:b + 1], reads[b:b + 1], **kw), got[b:b + 1])
    from conftest import need

    need(cpu_kernel_loaded.load("scalar"), f"the scalar build failed: {cpu_kernel_loaded.build_error('scalar')}")
    assert torch.equal(_op(pool, q, reads, cpu_kernel_loaded.ops("scalar"), **kw), got)
    if dtype == torch.float32:  # a NaN key makes its sequence NaN, as torch's softmax does (the first lane tanh made
        pool.keys[0][reads[1][0]] = float("nan")  # it +-cap, real weight; the op gave NaN scores weight 0)
        nan = _op(pool, q, reads, **kw).isnan()
        assert torch.equal(nan, _reference(pool, q, reads, **kw).isnan()) and nan[1].all() and not nan[0].any()


def test_refuses_inconsistent_inputs(cpu_kernel_loaded):
    pool, q, reads = _case(torch.float32, lengths=(4, 4))
    slots = torch.cat(reads)
    call = torch.ops.hqtflow.paged_decode_attention
    with pytest.raises(RuntimeError, match="offsets must have B \\+ 1 entries"):
        call(q, pool.keys[0], pool.values[0], slots, torch.tensor([0, 8]), None, None, 0.1)
    with pytest.raises(RuntimeError, match="every sequence needs a context"):
        call(q, pool.keys[0], pool.values[0], slots, torch.tensor([0, 0, 8]), None, None, 0.1)
    with pytest.raises(RuntimeError, match="scales are for an FP8 cache"):
        call(q, pool.keys[0], pool.values[0], slots, torch.tensor([0, 4, 8]), torch.tensor(1.0), torch.tensor(1.0), 0.1)
    with pytest.raises(RuntimeError, match="slot out of range"):
        call(q, pool.keys[0], pool.values[0], slots + 10_000, torch.tensor([0, 4, 8]), None, None, 0.1)
    with pytest.raises(RuntimeError, match="sinks are one per query head"):
        call(q, pool.keys[0], pool.values[0], slots, torch.tensor([0, 4, 8]), None, None, 0.1, 0.0, torch.zeros(2))
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        call(q, pool.keys[0], pool.values[0], slots, torch.tensor([0, 4, 8]), None, None, 0.1, -1.0)
