"""Fast FP8 backends against the QDQ reference (tolerances stated)."""

import pytest
import torch

from hqtflow.quantize.fp8_linear import FP8Linear, set_backend


def _layer(k=576, n=1536, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, 7, k, dtype=torch.bfloat16) * 2
    s_x = (x.abs().max() / 112).to(torch.bfloat16)
    s_w = (lin.weight.abs().max() / 224).to(torch.bfloat16)
    return FP8Linear.from_linear(lin, s_w, s_x), x


@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_matches_qdq(bias):
    """_scaled_mm accumulates the FP8 products in fp32 and scales once; QDQ multiplies dequantized bf16 values.
    Both see the same FP8 inputs and weights, so outputs agree to bf16 rounding: |d| <= 1e-2 * max|y| + 1e-2."""
    m, x = _layer(bias=bias)
    with torch.inference_mode():
        ref = m(x)
        set_backend(m, "scaled_mm")
        fast = m(x)
    assert fast.shape == ref.shape and fast.dtype == ref.dtype
    tol = 1e-2 * ref.abs().max().item() + 1e-2
    assert (fast.float() - ref.float()).abs().max().item() <= tol


def test_scaled_mm_only_where_it_applies():
    m, _ = _layer()
    wo = FP8Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), torch.tensor(0.01), None)
    model = torch.nn.Sequential(m, wo)
    assert set_backend(model, "scaled_mm") == 1
    assert m.backend == "scaled_mm" and wo.backend == "qdq"
    with pytest.raises(ValueError, match="Unknown FP8 backend"):
        set_backend(model, "triton")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8 tensor cores)")
def test_scaled_mm_on_cuda():
    m, x = _layer(4096, 4096)
    m, x = m.cuda(), x.cuda()
    with torch.inference_mode():
        ref = m(x)
        set_backend(m, "scaled_mm")
        fast = m(x)
    assert (fast.float() - ref.float()).abs().max().item() <= 1e-2 * ref.abs().max().item() + 1e-2


# ---- the CPU kernel --------------------------------------------------------------------------------------------
def _pow2(t):
    return torch.exp2(torch.round(torch.log2(t.float()))).to(torch.bfloat16)


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (100, 37), (128, 64)])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 40])
@pytest.mark.parametrize("mode", ["w8a8", "weight-only", "per-channel", "e5m2"])
def test_cpu_kernel_matches_qdq(cpu_kernel_loaded, k, n, m, mode):
    """The kernel sees the same FP8 weights and the same QDQ'd input as the reference; products are exact in fp32
    and only the summation order differs, so with power-of-two scales the outputs agree to bf16 rounding of the
    result: |d| <= 2^-7 * |y_ref| + 1e-3 * max|y_ref| elementwise (bias included)."""
    torch.manual_seed(k + n + m)
    lin = torch.nn.Linear(k, n, bias=True).to(torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16) * 3
    fp8 = "E5M2" if mode == "e5m2" else "E4M3"
    F = 57344.0 if fp8 == "E5M2" else 448.0
    ws = lin.weight.abs().amax(1) if mode == "per-channel" else lin.weight.abs().max()
    s_x = None if mode == "weight-only" else _pow2(x.abs().max() / (F / 4))
    mod = FP8Linear.from_linear(lin, _pow2(ws / (F / 2)), s_x, fp8)
    with torch.inference_mode():
        ref = mod(x)
        assert set_backend(mod, "cpu") == 1
        got = mod(x)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    d = (got.float() - ref.float()).abs()
    assert (d <= 2 ** -7 * ref.float().abs() + 1e-3 * ref.float().abs().max()).all(), d.max()


def test_cpu_kernel_arbitrary_scales_and_3d_input(cpu_kernel_loaded):
    """Non-power-of-two scales: the reference rounds W * s to bf16 before the matmul and the kernel scales the fp32
    sum once, so agreement is to a few bf16 ulps of the weights: |d| <= 1e-2 * max|y|."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(576, 192, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 5, 576, dtype=torch.bfloat16)
    mod = FP8Linear.from_linear(lin, (lin.weight.abs().max() / 437).to(torch.bfloat16), (x.abs().max() / 301).to(torch.bfloat16))
    with torch.inference_mode():
        ref = mod(x)
        set_backend(mod, "cpu")
        got = mod(x)
    assert got.shape == (2, 5, 192)
    assert (got.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("hp", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_kernel_input_qdq_is_bit_exact(cpu_kernel_loaded, fp8, hp):
    """The vectorised input rounding equals torch's FP8 casts bit for bit: normals, subnormals, saturation, ties."""
    from hqtflow.scales import dequantize, quantize

    torch.manual_seed(2)
    x = torch.cat([torch.randn(4000) * 10, torch.randn(4000) * 1e-3, torch.randn(2000) * 1e-6, torch.randn(2000) * 3e3,
                   torch.tensor([0.0, -0.0, 448, 464, 500, -1e9, 1e-30, 0.0009765625 * 1.5])]).to(hp)
    for s in (0.37, 1.0, 0.0625):
        sc = torch.tensor(s, dtype=hp)
        assert torch.equal(torch.ops.hqtflow.fp8_qdq(x, sc, fp8 == "E4M3"), dequantize(quantize(x, sc, fp8), sc, hp))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_dequantize_is_the_reference(cpu_kernel_loaded, dtype):
    torch.manual_seed(3)
    lin = torch.nn.Linear(200, 96).to(torch.bfloat16)
    for ws in (lin.weight.abs().max() / 448, lin.weight.abs().amax(1) / 448):
        mod = FP8Linear.from_linear(lin, ws.to(torch.bfloat16), None)
        ref = (mod.weight.float() * mod.weight_scale.float()).to(dtype)
        assert torch.equal(torch.ops.hqtflow.fp8_dequantize(mod.weight, mod.weight_scale, dtype), ref)


def test_cpu_backend_coverage_and_auto(cpu_kernel_loaded):
    """Block-wise weights stay on the reference; dynamic activations are QDQ'd first, then run by the kernel."""
    blk = FP8Linear(256, 128, bias=False, hp_dtype=torch.bfloat16, block_size=(128, 128), activation=None)
    dyn = FP8Linear(256, 128, bias=False, hp_dtype=torch.bfloat16, activation="dynamic_token")
    dyn.weight.copy_(torch.randn(128, 256).to(torch.float8_e4m3fn))
    dyn.weight_scale.fill_(0.01)
    model = torch.nn.Sequential(blk, dyn)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = dyn(x)
        assert set_backend(model, "auto") == 1
        assert blk.backend == "qdq" and dyn.backend == "cpu"
        got = dyn(x)
    assert (got.float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


def test_cpu_kernel_under_torch_compile(cpu_kernel_loaded):
    """The op has a fake implementation, so compiled graphs (the static decode step) keep it as one call."""
    mod, x = _layer(k=128, n=64)
    set_backend(mod, "cpu")
    with torch.inference_mode():
        eager = mod(x[:, :1])
        compiled = torch.compile(mod, fullgraph=True)(x[:, :1])
    assert torch.equal(eager, compiled)


@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_weight_quantize_is_the_reference(cpu_kernel_loaded, fp8, dtype):
    """`quantize_weight` (used by from_linear and --disk-offload) gives the reference's FP8 bytes exactly."""
    from hqtflow.scales import quantize

    torch.manual_seed(4)
    w = torch.randn(37, 300) * torch.logspace(-6, 3, 300)
    w[0, :5] = torch.tensor([0.0, -0.0, 6e4, -6e4, 1e-30])  # finite in every dtype (weights are)
    w = w.to(dtype)
    for scale in (torch.tensor([0.013]), w.float().abs().amax(1) / 448):
        scale = scale.to(dtype).clamp(min=1e-3)
        got = cpu_kernel_loaded.quantize_weight(w, scale, fp8)
        ref = quantize(w, scale.reshape(-1, 1) if scale.numel() > 1 else scale, fp8)
        assert got.dtype == ref.dtype and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
