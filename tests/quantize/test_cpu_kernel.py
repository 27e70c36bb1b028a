"""The CPU FP8 kernel computes the QDQ reference's function on every path, batch-invariantly.

The kernel and the reference (FP8Linear's "qdq" backend: dequantize, then oneDNN/MKL's GEMM) see the same QDQ'd
input and the same dequantized weight hp(W * s_w); for bf16 and fp16 every product is exact in fp32, for fp32 it is
rounded once in both. Only the order of the fp32 sum differs, which gives the bound checked here, per element, with
S = sum_k |x_k * w_k| (float64) and ulp(v) = 2^-p * v (p = 7 bf16, 10 fp16, 23 fp32):

    |y_kernel - y_ref| <= 2 * K * 2^-24 * S + ulp(S) + ulp(S + |bias|)

(the two fp32 sums' worst-case errors, then the rounding to hp before and after the bias). The kernel's own order is
fixed per output element, so a row's result is bit-identical whatever M is, whichever rows are beside it and however
the work is split: checked with torch.equal over M in {1, 2, 7, 8, 9, 16, 63, 64, 65, 256, 512}, both register and
panel paths, and on every instruction set: "native" (this machine's), the AVX2-only twin (`load("avx2")`) and, on
AMX machines, the AVX512-BF16 build without tiles (`load("bf16dot")`). The AVX2 order is the one-lane build's
(`load("scalar")`: k ascending, one FMA per product), checked bit for bit. AMX's TDPBF16PS adds 32 products and the
accumulator in an order of its own (its bits are not a sequence of fp32 additions), within the same bound.
"""

import pytest
import torch

from hqtflow.quantize.fp8_linear import FP8Linear, set_backend
from hqtflow.scales import dequantize, quantize

# 12 and 13: the bf16 path's last M widened in registers in one input tile and its first in a wide tile (FP8 weights
# with one scale and a small share per thread); 28 and 29: its last M in one wide tile and its first in two; 36 and
# 37: its last M in wide tiles and its first over panels
MS = [1, 2, 7, 8, 9, 12, 13, 16, 28, 29, 36, 37, 63, 64, 65, 256, 512]
HP = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
# (K, N): odd sizes, tails on every path, a SmolLM2 width, and rows of 4096 or more (M = 1 reads more groups of them)
SHAPES = [(100, 37), (1537, 67), (576, 192), (4100, 70)]


def _variants():
    """This machine's build and the AVX2-only twin; on an AMX machine also the build without tiles (the AVX512-BF16
    path of CPUs without AMX), a different order of operations with the same contract."""
    from hqtflow.hardware import cpu_flags

    return ["native", "avx2"] + (["bf16dot"] if "amx_bf16" in cpu_flags() else [])


@pytest.fixture(scope="module")
def cpu_kernel_built(cpu_kernel_loaded):
    """The kernel module with every variant this file loads compiled, side by side the first time on a machine (a
    minute or more each, one after another)."""
    cpu_kernel_loaded.build(_variants() + ["scalar"])
    return cpu_kernel_loaded


@pytest.fixture(scope="module", params=_variants())
def ops(request, cpu_kernel_built):
    variant = request.param
    from conftest import need

    need(cpu_kernel_built.load(variant), f"the {variant} kernel could not be built: {cpu_kernel_built.build_error(variant)}")
    return cpu_kernel_built.ops(variant)


def _layer(k, n, hp, mode, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=mode != "no-bias").to(hp)
    fp8 = "E5M2" if mode == "e5m2" else "E4M3"
    F = 57344.0 if fp8 == "E5M2" else 448.0
    ws = lin.weight.abs().amax(1) if mode.startswith("per-channel") else lin.weight.abs().max()
    ws = ws / (F / 2) * 1.13
    if mode == "per-channel-pow2":  # HQT's per-channel methods: 2^ceil(log2(amax / F)), the sums scaled on some paths
        ws = 2.0 ** torch.ceil(torch.log2(ws))
    x = torch.randn(max(MS), k, dtype=hp) * 3
    s_x = None if mode == "weight-only" else (x.abs().max() / (F / 4) * 1.37).to(hp)  # not a power of two
    return FP8Linear.from_linear(lin, ws.to(hp), s_x, fp8), x


def _run(ops, mod, x):
    return ops.fp8_linear(x, mod.weight, mod.weight_scale, mod.input_scale, mod.bias)


def _bound(mod, x):
    """The documented per-element bound between the kernel and the reference (see the module docstring)."""
    xq = x if mod.input_scale is None else dequantize(quantize(x, mod.input_scale, mod.fp8), mod.input_scale, mod.hp_dtype)
    S = xq.double().abs() @ mod.dequantized_weight().double().abs().t()
    b = mod.bias.double().abs() if mod.bias is not None else 0.0
    ulp = 2.0 ** -MANTISSA[mod.hp_dtype]
    return 2 * mod.in_features * 2.0**-24 * S + ulp * S + ulp * (S + b)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("hp", list(HP))
@pytest.mark.parametrize("mode", ["w8a8", "weight-only", "per-channel", "per-channel-pow2", "e5m2", "no-bias"])
def test_kernel_is_the_reference_and_batch_invariant(ops, k, n, hp, mode):
    mod, x = _layer(k, n, HP[hp], mode)
    with torch.inference_mode():
        full = _run(ops, mod, x)
        ref = mod(x)  # the QDQ reference
        # the same function as the reference, within the fp32-ordering bound; mostly bit-identical after rounding
        assert full.dtype == ref.dtype and full.shape == ref.shape
        d = (full.double() - ref.double()).abs()
        assert (d <= _bound(mod, x)).all(), f"worst excess {(d - _bound(mod, x)).max().item():.3g}"
        if hp != "fp32":
            assert (full == ref).float().mean() >= 0.98
        # independent of M: every prefix of the batch gives the same rows, bit for bit
        for m in MS:
            assert torch.equal(_run(ops, mod, x[:m]), full[:m]), f"rows differ at M={m}"
        # independent of neighbours and of padding rows: the same rows among others, reordered, or padded
        other = torch.randn(40, k, dtype=x.dtype) * 100
        mixed = torch.cat([other[:13], x[:7], other[13:], torch.zeros(9, k, dtype=x.dtype)])
        assert torch.equal(_run(ops, mod, mixed)[13:20], full[:7])
        assert torch.equal(_run(ops, mod, x.flip(0)), full.flip(0))
        # 3-D input: the same rows
        assert torch.equal(_run(ops, mod, x[:64].reshape(4, 16, k)), full[:64].reshape(4, 16, n))


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("hp", list(HP))
def test_per_channel_weights_are_the_reference_for_every_code_and_scale(ops, fp8, hp):
    """Each weight row with a scale of its own (the bf16 paths build a table of hp(v * s) per row):
    every finite FP8 code in every row, scales from fp32's subnormals (bf16: from 2^-109) to 2^100 (fp16: 2^-1), read
    back through one-hot input rows (y[m, n] = hp(W[n, m] * s_n) exactly), on the register path (M <= 12) and the
    panel path, equal to the reference's `dequantize` bit for bit."""
    e4m3 = fp8 == "E4M3"
    codes = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F] if e4m3 else
                         [c for c in range(256) if (c & 0x7F) < 0x7C], dtype=torch.uint8)  # NaN and inf left out
    n, k = 70, codes.numel()
    w = torch.stack([codes.roll(3 * r) for r in range(n)]).view(torch.float8_e4m3fn if e4m3 else torch.float8_e5m2)
    torch.manual_seed(0)
    # bf16: products normal (bf16 dot products flush subnormals); fp16: within its range (0 * inf = NaN sums)
    low, top = (-108, 100) if hp == "bf16" else (-149, -1) if hp == "fp16" else (-149, 100)
    scale = (torch.rand(n) + 0.5) * 2.0 ** torch.linspace(low, top, n).round()
    want = dequantize(w, scale[:, None], HP[hp]).t()
    eye = torch.eye(k, dtype=HP[hp])
    for rows in (slice(0, 1), slice(5, 17), slice(0, k)):
        got = ops.fp8_linear(eye[rows], w, scale, None, None)
        assert torch.equal(got.isnan(), want[rows].isnan()) and torch.equal(got.nan_to_num(), want[rows].nan_to_num())


@pytest.mark.parametrize("hp", ["bf16", "fp32"])
def test_large_inputs_in_row_chunks_give_the_same_rows(ops, hp):
    """An input of more than a few MB is computed in slices of rows (here: K = 16390, slices of 64 fp32 or 192 bf16
    rows, the last one short), each in chunks: every row is the same, bit for bit, as computed alone, in a small
    batch or in another slice."""
    mod, _ = _layer(16390, 20, HP[hp], "w8a8", seed=5)
    x = torch.randn(300, 16390, dtype=HP[hp])
    with torch.inference_mode():
        full = _run(ops, mod, x)
        d = (full.double() - mod(x).double()).abs()
        assert (d <= _bound(mod, x)).all()
        for rows in (slice(0, 1), slice(0, 2), slice(0, 65), slice(0, 129), slice(100, 300), slice(299, 300)):
            assert torch.equal(_run(ops, mod, x[rows]), full[rows]), rows


def test_large_outputs_give_the_same_rows(ops):
    """An output over 32 MiB (a fresh mapping that the threads' first writes fault in): the same rows, bit for bit,
    as in small batches, and within the bound of the reference."""
    mod, _ = _layer(40, 1100, torch.float32, "w8a8", seed=9)
    x = torch.randn(8000, 40) * 3
    with torch.inference_mode():
        full = _run(ops, mod, x)
        assert full.nbytes > 32 << 20
        assert ((full[:700].double() - mod(x[:700]).double()).abs() <= _bound(mod, x[:700])).all()
        for rows in (slice(0, 1), slice(0, 3), slice(4000, 4700), slice(7990, 8000)):
            assert torch.equal(_run(ops, mod, x[rows]), full[rows]), rows


@pytest.fixture(scope="module")
def avx2_and_scalar(cpu_kernel_built):
    from conftest import need

    for variant in ("avx2", "scalar"):
        need(cpu_kernel_built.load(variant), f"the {variant} kernel could not be built: {cpu_kernel_built.build_error(variant)}")
    return cpu_kernel_built.ops("avx2"), cpu_kernel_built.ops("scalar")


@pytest.mark.parametrize("k,n", SHAPES + [(7, 13), (4100, 24)])
@pytest.mark.parametrize("hp", list(HP))
@pytest.mark.parametrize("mode", ["w8a8", "weight-only", "per-channel", "e5m2"])
def test_avx2_adds_in_the_scalar_order(avx2_and_scalar, k, n, hp, mode):
    """The AVX2 path (outer products over the packed weight: decode tiles, and panels with column blocks) adds every
    output's products in the one-lane build's order, k ascending, one FMA each: the same bits at every M."""
    avx2, scalar = avx2_and_scalar
    mod, x = _layer(k, n, HP[hp], mode, seed=11)
    packed = avx2.fp8_pack(mod.weight)
    assert packed.shape == (-(-n // 8), k, 8) and torch.equal(packed.reshape(-1, k * 8)[:, :8].flatten()[:n],
                                                               mod.weight.view(torch.uint8)[:, 0])
    with torch.inference_mode():
        for m in (1, 2, 3, 65):
            args = (x[:m], mod.weight, mod.weight_scale, mod.input_scale, mod.bias)
            want = scalar.fp8_linear(*args)
            assert torch.equal(avx2.fp8_linear(*args, packed), want), f"M={m}"
            assert torch.equal(avx2.fp8_linear(*args), want), f"M={m}, packed per call"


def test_packed_weight_is_checked_and_follows_the_weight(cpu_kernel_loaded):
    torch.manual_seed(4)
    lin = torch.nn.Linear(96, 40).to(torch.bfloat16)
    mod = FP8Linear.from_linear(lin, (lin.weight.abs().max() / 448).to(torch.bfloat16), None)
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert set_backend(mod, "cpu") == 1
        before = mod(x)
        packed = torch.ops.hqtflow.fp8_pack(mod.weight)
        if packed.numel():  # this machine's kernel reads a packed layout: a wrong one is refused
            with pytest.raises(RuntimeError, match="packed must be fp8_pack"):
                torch.ops.hqtflow.fp8_linear(x, mod.weight, mod.weight_scale, None, None, packed[:-1])
        mod.weight.copy_(FP8Linear.from_linear(lin, (lin.weight.abs().max() / 100).to(torch.bfloat16), None).weight)
        after = mod(x)  # repacked: the new weight, not the layout of the old one
        assert not torch.equal(after, before)
        assert torch.equal(after, torch.ops.hqtflow.fp8_linear(x, mod.weight, mod.weight_scale, None, mod.bias))
        set_backend(mod, "qdq")
        assert mod.packed is None


@pytest.mark.parametrize("scales", ["per-tensor", "per-channel", "per-channel-pow2"])
def test_the_packed_layout_gives_the_same_bits(ops, scales):
    """`fp8_pack(weight)` (on the bf16 path: every 64 x 16-row chunk already in the order decode widens it, two blocks
    of 16 rows widened side by side) changes where the bytes are read from, never a result: the same bits as the
    plain [N, K] bytes at decode and panel sizes of M, with ragged N and K, static and weight-only inputs, per-tensor
    and per-channel scales (powers of two: the sums scaled on the decode paths)."""
    torch.manual_seed(7)
    per_channel = scales != "per-tensor"
    for k, n in ((70, 17), (576, 48), (200, 100), (130, 97)):
        lin = torch.nn.Linear(k, n).to(torch.bfloat16)
        s_w = (lin.weight.abs().amax(1) if per_channel else lin.weight.abs().max()) / 448
        if scales == "per-channel-pow2":
            s_w = 2.0 ** torch.ceil(torch.log2(s_w))
        w = (lin.weight / (s_w[:, None] if per_channel else s_w)).to(torch.float8_e4m3fn)
        packed = ops.fp8_pack(w)
        for m in (1, 2, 3, 8, 12, 16, 33, 70):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            for s_x in (None, (x.abs().max() / 448).to(torch.bfloat16)):
                args = (x, w, s_w.to(torch.bfloat16), s_x, lin.bias.detach())
                assert torch.equal(ops.fp8_linear(*args, packed), ops.fp8_linear(*args, None)), (k, n, m, s_x is None)


@pytest.mark.parametrize("hp", [torch.bfloat16, torch.float32])
def test_every_path_adds_in_one_order(ops, hp):
    """Sums whose bits show their order. Every weight is 0 or 1 (16 columns 1 in every row); each input row is 2^-12
    but for +2^14 and -2^14 in two of those 16 columns. A 2^-12 term added while a partial sum holds 2^14 is lost
    (under half an fp32 ulp of it), so each output counts its taken 2^-12 terms outside that span, in the kernel's
    order. Every row gives the same bits alone, in a tile of 9 and among 70 (the decode, tile and panel paths),
    packed or not: a path adding in another order would differ."""
    torch.manual_seed(3)
    n, k, m = 97, 576, 70
    w = torch.randint(0, 2, (n, k)).float()
    large = torch.randperm(k)[:16]
    w[:, large] = 1.0
    x = torch.full((m, k), 2.0**-12)
    for row in range(m):
        a, b = large[torch.randperm(16)[:2]].tolist()
        x[row, a], x[row, b] = 2.0**14, -(2.0**14)
    x, wq, scale = x.to(hp), w.to(torch.float8_e4m3fn), torch.tensor(1.0, dtype=hp)
    for packed in (None, ops.fp8_pack(wq)):
        among = ops.fp8_linear(x, wq, scale, None, None, packed)
        for row in range(m):
            alone = ops.fp8_linear(x[row:row + 1], wq, scale, None, None, packed)
            assert torch.equal(alone[0], among[row]), (row, packed is None)
        for m0 in range(0, m - 9, 9):
            assert torch.equal(ops.fp8_linear(x[m0:m0 + 9], wq, scale, None, None, packed), among[m0:m0 + 9]), m0
    exact = (x.double() @ w.double().t()).to(hp)
    assert (among != exact).float().mean() > 0.5  # terms were lost: the bits depend on the order


@pytest.mark.parametrize("hp", [torch.bfloat16, torch.float32])
def test_thread_count_does_not_change_results(ops, hp):
    """Threads take row blocks as they free up (which thread computes a row varies run to run): the same bits with
    1 thread and with more threads than cores, at decode and panel sizes of M, for FP8 and packed bf16 weights."""
    mod, x = _layer(576, 1100, hp, "w8a8")
    w = torch.randn(1100, 576).to(torch.bfloat16)
    packed = ops.bf16_pack(w)
    xs = [x[:m] for m in (1, 2, 9, 70, 300)]  # 300 rows: an input larger than a panel (fewer, larger blocks)
    threads = torch.get_num_threads()

    def run():
        out = [_run(ops, mod, xm) for xm in xs]
        if packed.numel():  # this machine's kernel has the packed bf16 path (fp32 inputs on AVX2, else bf16)
            dt = torch.float32 if packed.dtype == torch.bfloat16 else torch.bfloat16
            out += [ops.bf16_linear(xm.to(dt), packed, 1100, None) for xm in xs]
        return out

    with torch.inference_mode():
        try:
            torch.set_num_threads(1)
            one = run()
            torch.set_num_threads(5)
            many = [run() for _ in range(3)]
        finally:
            torch.set_num_threads(threads)
        for got in many + [run()]:
            assert all(torch.equal(a, b) for a, b in zip(got, one))


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
def test_per_channel_powers_of_two_give_the_same_rows_at_the_range_limits(ops, fp8):
    """Per-channel scales that are powers of two with a static input scale: the bf16 path's register tiles may
    multiply each row's sum by its scale (one shared table) where the panels dequantize each row (a table per row),
    which is the same function only while every partial sum stays in fp32's normal range (`scales_commute`). Across
    that limit, scales from 2^-118 to 2^100 and input scales from 2^-90 to 2^60, inputs near the smallest code that
    cancel: a row computed alone (register path) is the panels' row bit for bit, and within the reference's bound
    (plus what bf16 dot products flush: products and sums under 2^-126)."""
    F = 57344.0 if fp8 == "E5M2" else 448.0
    torch.manual_seed(5)
    k, n = 576, 48
    for lo, hi, sx_e in [(-8, -4, -6), (-118, -100, -20), (-40, -30, -70), (-30, -20, -75), (0, 0, -90), (-10, 100, 20),
                         (-20, 5, 60), (90, 100, 10)]:
        w = torch.randn(n, k)
        s = 2.0 ** torch.randint(lo, hi + 1, (n,)).float()
        wq = quantize(w / s[:, None] * 0.5, torch.ones(()), fp8)
        x = (torch.randn(64, k) * 2.0**sx_e).to(torch.bfloat16)
        x[::2] *= 2.0**-10  # many inputs at the smallest codes, their products cancelling
        x[1::4] = -x[::4] * 0.5
        s_x = torch.tensor(2.0**sx_e * 4 / F * 1.37)
        mod = FP8Linear(k, n, bias=False, hp_dtype=torch.bfloat16, fp8=fp8, per_channel=True)
        mod.weight.copy_(wq), mod.weight_scale.copy_(s[:, None]), mod.input_scale.copy_(s_x)
        full = _run(ops, mod, x)
        for m in (1, 2, 12, 16, 36):
            assert torch.equal(_run(ops, mod, x[:m]).nan_to_num(), full[:m].nan_to_num()), f"rows differ at M={m}, {lo, hi, sx_e}"
        with torch.inference_mode():
            d = (full.double() - mod(x).double()).abs()
        assert (d.nan_to_num() <= _bound(mod, x) + 2 * k * 2.0**-126).all()  # + products and sums flushed below 2^-126


@pytest.mark.parametrize("k,n", [(576, 700), (1537, 67)])
@pytest.mark.parametrize("mode", ["w8a8", "per-channel", "per-channel-pow2", "bf16-weights"])
def test_large_m_rows_are_the_same_whatever_the_threads_and_neighbours(ops, k, n, mode):
    """At large M every row is the same, bit for bit, with 1, 2 or 5 threads, as computed alone, in a batch of 255,
    from row 255 on (its rows in other tile places) and in the last rows of 1000; K = 1537 takes several passes over
    K. FP8 weights (one scale, per row) and packed bf16 ones (the `lm_head`'s); every build."""
    torch.manual_seed(3)
    x = torch.randn(1000, k, dtype=torch.bfloat16) * 3
    if mode == "bf16-weights":
        w = torch.randn(n, k).to(torch.bfloat16)
        packed = ops.bf16_pack(w)
        if not packed.numel():
            pytest.skip("this build has no packed bf16 path")
        x = x.float() if packed.dtype == torch.bfloat16 else x  # fp32 inputs on AVX2, bf16 on the bf16 paths
        run = lambda xm: ops.bf16_linear(xm, packed, n, None)  # noqa: E731
        ref = lambda xm: torch.nn.functional.linear(xm.double(), w.double())  # noqa: E731
    else:
        mod, _ = _layer(k, n, torch.bfloat16, mode, seed=4)
        run = lambda xm: _run(ops, mod, xm)  # noqa: E731
    threads = torch.get_num_threads()
    with torch.inference_mode():
        try:
            outs = []
            for t in (1, 2, 5):
                torch.set_num_threads(t)
                outs.append(run(x))
            parts = [run(x[:1]), run(x[:255]), run(x[255:]), run(x[992:])]
        finally:
            torch.set_num_threads(threads)
        full = outs[0]
        assert all(torch.equal(o, full) for o in outs[1:])
        assert torch.equal(parts[0], full[:1]) and torch.equal(parts[1], full[:255])
        assert torch.equal(parts[2], full[255:]) and torch.equal(parts[3], full[992:])
        if mode == "bf16-weights":
            r = ref(x)
            assert (full.double() - r).abs().max() <= 1e-2 * r.abs().max()
        else:
            assert ((full.double() - mod(x).double()).abs() <= _bound(mod, x)).all()


@pytest.mark.parametrize("activation", ["dynamic_token", None])
def test_fp8linear_cpu_backend_rows_do_not_depend_on_the_batch(cpu_kernel_loaded, activation):
    """Through FP8Linear (the runtime's layer): per-token dynamic activations and weight-only are batch-invariant too."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(576, 1536).to(torch.bfloat16)
    mod = FP8Linear.from_linear(lin, (lin.weight.abs().max() / 448).to(torch.bfloat16), None)
    mod.activation = activation
    x = torch.randn(3, 70, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = mod(x)
        assert set_backend(mod, "cpu") == 1
        full = mod(x)
        assert (full.double() - ref.double()).abs().max() <= 2e-2 * ref.abs().max().item()
        for rows in (1, 5, 70):
            assert torch.equal(mod(x[:1, :rows]), full[:1, :rows])


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("hp", list(HP))
def test_input_qdq_is_bit_exact(ops, fp8, hp):
    """The vectorised input rounding equals torch's FP8 casts bit for bit: normals, subnormals, saturation, ties."""
    hp = HP[hp]
    torch.manual_seed(2)
    x = torch.cat([torch.randn(4000) * 10, torch.randn(4000) * 1e-3, torch.randn(2000) * 1e-6, torch.randn(2000) * 3e3,
                   torch.tensor([0.0, -0.0, 448, 464, 500, -1e9, 1e-30, 0.0009765625 * 1.5])]).to(hp)
    for s in (0.37, 1.0, 0.0625):
        sc = torch.tensor(s, dtype=hp)
        assert torch.equal(ops.fp8_qdq(x, sc, fp8 == "E4M3"), dequantize(quantize(x, sc, fp8), sc, hp))


def _near_ties(fp8, count, seed):
    """bf16 inputs x and scales s with x / s at, or an ulp or two from, a midpoint of the FP8 grid (normal and
    subnormal), where x * (1 / s) and x / s can round apart."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique().sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.randn(count, generator=g).bfloat16().float()
    x = x[x != 0]
    s = x.abs() / mids[torch.randint(0, len(mids), (len(x),), generator=g)]
    s = (s.view(torch.int32) + torch.randint(-2, 3, s.shape, generator=g, dtype=torch.int32)).view(torch.float32)
    return x, s


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
def test_input_rounding_divides_exactly_near_ties(ops, fp8):
    """The input is divided by its scale as torch divides (x * (1 / s), a tempting shortcut, rounds differently near
    the FP8 grid's rounding boundaries). Scales that put inputs at those boundaries give torch's bits, in the quantize
    op (a scale per row, every input against every scale) and in fp8_linear's bf16 input path."""
    dt = torch.float8_e4m3fn if fp8 == "E4M3" else torch.float8_e5m2
    x, s = _near_ties(dt, 2000, seed=4)
    xs = x.expand(len(s), -1).contiguous()
    ref = quantize(xs, s[:, None], fp8)
    assert torch.equal(ops.fp8_quantize(xs, s, fp8 == "E4M3").view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(ops.fp8_quantize(xs.bfloat16(), s, fp8 == "E4M3").view(torch.uint8), ref.view(torch.uint8))
    if fp8 == "E4M3":  # y = x QDQ'd through an identity weight: one exact product per output
        eye = torch.eye(len(x)).to(torch.float8_e4m3fn)
        for sx in s[:16]:
            got = ops.fp8_linear(x.bfloat16()[None], eye, torch.ones(1), sx.reshape(1), None)
            assert torch.equal(got, dequantize(quantize(x.bfloat16()[None], sx, fp8), sx, torch.bfloat16))


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
def test_every_bf16_input_divides_exactly(ops, fp8):
    """Every finite bf16 (and its fp32 value) quantizes as torch's x / s does, with ordinary scales, tiny ones, scales
    whose reciprocal is subnormal (above 2^126) or infinite (a subnormal scale)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    for s in (0.37, 3.1e-3, 1.7e5, 1.3 * 2.0**-110, 0.9 * 2.0**126, 1.1 * 2.0**126, 3e-39):
        sc = torch.tensor([s], dtype=torch.float32)
        for xin in (x, x.float()):
            ref = quantize(xin[None], sc, fp8)
            assert torch.equal(ops.fp8_quantize(xin[None], sc, fp8 == "E4M3").view(torch.uint8), ref.view(torch.uint8)), s


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
def test_input_rounding_with_power_of_two_scales(ops, fp8):
    """A power-of-two scale (maxabs_pow2's) is applied as a multiply by its exact reciprocal, not a divide: the same
    bits as torch's division at the FP8 grid's midpoints and a bf16 ulp either side, for scales from 2^-126 to 2^127
    (and a subnormal one, which divides) in the quantize op, and in fp8_linear's bf16 and fp32 input paths."""
    dt = torch.float8_e4m3fn if fp8 == "E4M3" else torch.float8_e5m2
    grid = torch.arange(256, dtype=torch.uint8).view(dt).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique().sort().values
    mids = torch.cat([(grid[1:] + grid[:-1]) / 2, grid[1:]])
    for e in (-130, -126, -60, -7, 0, 5, 60, 127):
        s = torch.tensor(2.0**e, dtype=torch.float32)
        xb = (mids * s).bfloat16()
        bits = xb.view(torch.int16)
        xb = torch.cat([xb, (bits + 1).view(torch.bfloat16), (bits - 1).view(torch.bfloat16)])
        xb = torch.cat([xb, -xb])
        xb = xb[torch.isfinite(xb) & (xb != 0)]
        for x in (xb, xb.float()):
            ref = quantize(x[None], s, fp8)
            got = ops.fp8_quantize(x[None], s.reshape(1), fp8 == "E4M3")
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), e
            # through an identity weight: one exact product per output (outputs normal and finite: bf16 dot products
            # flush subnormals)
            if fp8 == "E4M3" and abs(e) <= 60:
                eye = torch.eye(len(x)).to(torch.float8_e4m3fn)
                got = ops.fp8_linear(x[None], eye, torch.ones(1), s.reshape(1), None)
                assert torch.equal(got, dequantize(ref, s, x.dtype)), e


@pytest.mark.parametrize("hp", list(HP))
def test_dequantize_and_quantize_are_the_reference(ops, hp):
    hp = HP[hp]
    torch.manual_seed(3)
    lin = torch.nn.Linear(200, 96).to(hp)
    for ws in (lin.weight.abs().max() / 448 * 1.3, lin.weight.abs().amax(1) / 448 * 1.3):
        ws = ws.to(hp)
        mod = FP8Linear.from_linear(lin, ws, None)
        assert torch.equal(mod.weight.view(torch.uint8), quantize(lin.weight, ws.reshape(-1, 1) if ws.dim() else ws).view(torch.uint8))
        assert torch.equal(ops.fp8_quantize(lin.weight, ws.reshape(-1), True).view(torch.uint8), mod.weight.view(torch.uint8))
        assert torch.equal(ops.fp8_dequantize(mod.weight, mod.weight_scale, hp), dequantize(mod.weight, mod.weight_scale, hp))


def test_isa_is_reported(ops):
    assert ops.fp8_isa() in ("amx-bf16", "bf16-dot", "avx512-fma", "avx2-fma", "scalar")


def test_auto_dtype_is_the_fastest_here(monkeypatch):
    from hqtflow import hardware

    monkeypatch.setattr(hardware, "cpu_flags", lambda: ("avx", "avx2", "f16c", "fma"))  # an AVX2-only CPU
    assert hardware.fastest_dtype("cpu") == "fp32" and hardware.resolve_dtype("auto") == "fp32"
    assert hardware.resolve_dtype("bf16") == "bf16"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: ("avx2", "avx512_bf16", "avx512f"))
    assert hardware.fastest_dtype("cpu") == "bf16" and hardware.fastest_dtype("cuda") == "bf16"


def test_fp8_checkpoint_runs_in_fp32(cpu_kernel_loaded, tiny_llama, wiki_text, tmp_path):
    """What `auto` picks on CPUs without native bf16: the high-precision parts and the FP8 layers' dtype are fp32."""
    import hqtflow
    from conftest import run_cli

    r = run_cli("measure", tiny_llama, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "4", "--max-length", "64")
    assert r.exit_code == 0, r.output
    r = run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "fp8")
    assert r.exit_code == 0, r.output
    ids = torch.randint(0, 500, (2, 33))
    logits = {}
    for dtype, backend in (("fp32", "cpu"), ("fp32", "qdq"), ("bf16", "qdq")):
        model, _ = hqtflow.load(tmp_path / "fp8", dtype=dtype, backend=backend)
        fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
        assert fp8 and all(m.hp_dtype == HP[dtype] and m.backend == backend for m in fp8)
        assert model.get_input_embeddings().weight.dtype == HP[dtype]
        with torch.inference_mode():
            logits[dtype, backend] = model(ids).logits.float()
    ref = logits["fp32", "qdq"]
    assert (logits["fp32", "cpu"] - ref).abs().max() <= 1e-4 * ref.abs().max()  # fp32 sums in another order
    assert (logits["bf16", "qdq"] - ref).abs().max() <= 0.1 * ref.abs().max()  # bf16 vs fp32 compute
    # the CLI's --dtype: chosen, or refused with one sentence
    r = run_cli("generate", tmp_path / "fp8", "--dtype", "fp32", "--max-new-tokens", "3")
    assert r.exit_code == 0, r.output
    r = run_cli("generate", tmp_path / "fp8", "--dtype", "fp64")
    assert r.exit_code == 2 and "--dtype must be auto, bf16, fp16 or fp32, not 'fp64'." in r.output and "Traceback" not in r.output


def test_bf16_linear_large_inputs_in_slices_give_the_same_rows(cpu_kernel_loaded):
    """The bf16-weight Linear takes a large input in slices of rows too (K = 16390: 64 rows in fp32, 192 in bf16):
    rows bit-identical alone, across slices and in the whole batch. A build without a bf16-weight path (AVX-512
    without BF16, scalar) refuses the op."""
    from hqtflow.quantize.bf16_linear import kernel_dtype

    dt = kernel_dtype()
    torch.manual_seed(8)
    w = torch.randn(12, 16390).bfloat16()
    packed = torch.ops.hqtflow.bf16_pack(w)
    x, bias = torch.randn(400, 16390, dtype=dt), torch.randn(12, dtype=dt)
    if not packed.numel():
        with pytest.raises(RuntimeError, match="no bf16 path"):
            torch.ops.hqtflow.bf16_linear(x, packed, 12, bias)
        return
    with torch.inference_mode():
        full = torch.ops.hqtflow.bf16_linear(x, packed, 12, bias)
        ref = torch.nn.functional.linear(x.double(), w.double(), bias.double())
        assert (full.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
        for rows in (slice(0, 1), slice(0, 65), slice(60, 200), slice(399, 400)):
            assert torch.equal(torch.ops.hqtflow.bf16_linear(x[rows], packed, 12, bias), full[rows]), rows


def test_high_precision_linears_read_packed_bf16(cpu_kernel_loaded):
    """set_backend("cpu") runs the model's high-precision Linears holding bf16 values (an lm_head kept in bf16) on the
    kernel, in its dtype (fp32 on AVX2, bf16 on AMX and AVX512-BF16): the function of F.linear within the bound of the
    module docstring, rows independent of the batch, state dict unchanged; an fp32 weight that is not all bf16 values
    keeps F.linear; another backend swaps the class back."""
    from hqtflow.quantize.bf16_linear import PackedBf16Linear, kernel_dtype

    dt = kernel_dtype()
    torch.manual_seed(6)
    lin = torch.nn.Linear(96, 40).to(dt)
    head, exact_fp32 = torch.nn.Linear(40, 300, bias=True).to(dt), torch.nn.Linear(300, 7, bias=False)
    model = torch.nn.Sequential(FP8Linear.from_linear(lin, lin.weight.abs().max() / 448, None), head, exact_fp32)
    with torch.no_grad():
        head.weight.copy_(head.weight.bfloat16().to(dt))  # bf16 values, as a bf16 checkpoint loaded in fp32
    keys = list(model.state_dict())
    x = torch.randn(9, 40, dtype=dt)
    with torch.inference_mode():
        ref = head(x)
        set_backend(model, "cpu")
        assert type(head) is PackedBf16Linear and list(model.state_dict()) == keys
        y = head(x)
        if torch.ops.hqtflow.bf16_pack(head.weight.bfloat16()).numel():  # this machine's kernel has a bf16-weight path
            assert head.packed is not None
            S = x.double().abs() @ head.weight.double().abs().t()
            ulp = 2.0 ** -MANTISSA[dt] if dt != torch.float32 else 0.0
            bound = 2 * 40 * 2.0**-24 * S + ulp * S + (ulp + 2.0**-24) * (S + head.bias.double().abs())
            assert ((y.double() - ref.double()).abs() <= bound).all()
            for m in (1, 2, 7):
                assert torch.equal(head(x[:m]), y[:m])
            assert torch.equal(head(torch.cat([x, torch.randn(30, 40, dtype=dt)]))[:9], y)
        if dt == torch.float32:  # an fp32 weight that is not all bf16 values: F.linear
            assert type(exact_fp32) is PackedBf16Linear and exact_fp32.packed is None
        h = torch.randn(5, 300)
        assert torch.equal(exact_fp32(h), torch.nn.functional.linear(h, exact_fp32.weight))
        set_backend(model, "qdq")
        assert type(head) is torch.nn.Linear and torch.equal(head(x), ref)


def _specials(hp):
    """Values a clamp and a cast must treat as torch does: NaN of either sign (bf16's own NaN is 0xFFFF, all payload
    bits set), +-inf, huge values (saturated), one ordinary value."""
    nan = torch.tensor([float("nan")], dtype=hp)
    neg_nan = torch.tensor([-1], dtype=torch.int16).view(torch.bfloat16).to(hp) if hp == torch.bfloat16 else -nan
    big = 3e38 if hp != torch.float16 else 6e4
    return torch.cat([nan, neg_nan, torch.tensor([float("inf"), -float("inf"), big, -big, 1.0], dtype=hp)])


def _same(a, b):
    """Equal bit for bit where finite or infinite, NaN exactly where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


@pytest.mark.parametrize("variant", _variants() + ["scalar"])
@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("hp", list(HP))
def test_nan_inf_and_huge_inputs_are_the_reference(cpu_kernel_built, variant, fp8, hp):
    """NaN stays NaN (the reference's clamp and cast keep it; the vector clamp once made it -F * s), +-inf and huge
    values saturate to +-F * s: in the input QDQ, the quantize op's bytes and fp8_linear's output rows, at M = 1 and
    M > 1, on every build (the vector lanes and the scalar tail)."""
    from conftest import need

    need(cpu_kernel_built.load(variant), f"the {variant} kernel could not be built: {cpu_kernel_built.build_error(variant)}")
    ops = cpu_kernel_built.ops(variant)
    hp = HP[hp]
    sp = _specials(hp)
    x = torch.ones(37, dtype=hp)
    x[[0, 5, 17, 18, 33, 36, 35]] = sp  # lanes of the first and second vector, and the scalar tail
    for s in (0.01, 0.0625):  # a divide, and a power of two (a multiply)
        sc = torch.tensor(s, dtype=hp)
        assert _same(ops.fp8_qdq(x, sc, fp8 == "E4M3"), dequantize(quantize(x, sc, fp8), sc, hp))
        got = ops.fp8_quantize(x[None], sc.float().reshape(1), fp8 == "E4M3").view(torch.uint8)
        assert torch.equal(got, quantize(x[None], sc, fp8).view(torch.uint8))
    mod, xs = _layer(576, 192, hp, "e5m2" if fp8 == "E5M2" else "w8a8")
    for m in (1, 2, 9, 64):
        xm = xs[:m].clone()
        for i in range(m):
            xm[i, (37 * i) % 576] = sp[i % len(sp)]
        with torch.inference_mode():
            got, ref = _run(ops, mod, xm), mod(xm)
        assert torch.equal(got.isnan(), ref.isnan()), f"M={m}"
        nan_rows = torch.tensor([i % len(sp) < 2 for i in range(m)])  # rows given a NaN: all NaN; the others finite
        assert torch.isnan(got[nan_rows]).all() and torch.isfinite(got[~nan_rows]).all()
        d = (got.double() - ref.double()).abs()[~ref.isnan()]
        assert (d <= _bound(mod, xm)[~ref.isnan()]).all(), f"M={m}"
