"""`torch._scaled_mm` against the QDQ reference (tolerances stated); the CPU kernel is in test_cpu_kernel.py."""

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


def test_scaled_mm_scales_cast_once_and_follow_an_in_place_change():
    """The float32 scales _scaled_mm takes are cast once, not per call, and recast when a stored scale changes."""
    import copy

    m, x = _layer(k=64, n=32)
    set_backend(m, "scaled_mm")
    first = m(x)
    kept = m._mm_scales
    assert torch.equal(m(x), first) and m._mm_scales is kept
    with torch.no_grad():
        m.input_scale.mul_(2)
        m.weight_scale.mul_(0.5)
    fresh = copy.deepcopy(m)
    fresh._mm_scales = None
    changed = m(x)
    assert m._mm_scales is not kept and torch.equal(changed, fresh(x)) and not torch.equal(changed, first)


def test_scaled_mm_only_where_it_applies():
    m, _ = _layer()
    wo = FP8Linear.from_linear(torch.nn.Linear(64, 32).to(torch.bfloat16), torch.tensor(0.01), None)
    model = torch.nn.Sequential(m, wo)
    assert set_backend(model, "scaled_mm") == 1
    assert m.backend == "scaled_mm" and wo.backend == "qdq"
    with pytest.raises(ValueError, match="FP8 backend must be auto, qdq, cpu or scaled_mm"):
        set_backend(model, "triton")


@pytest.mark.parametrize(("k", "n", "fp8", "bias", "out", "why"), [
    (576, 1536, "E4M3", True, torch.bfloat16, None),
    (576, 1536, "E4M3", True, torch.float16, None),
    (576, 1536, "E4M3", False, torch.float32, None),
    (40, 32, "E4M3", False, torch.bfloat16, "in/out features (40, 32) are not multiples of 16"),
    (64, 40, "E4M3", False, torch.bfloat16, "in/out features (64, 40) are not multiples of 16"),
    (64, 32, "E5M2", False, torch.bfloat16, "both E5M2"),
    (64, 32, "E4M3", True, torch.float32, "has a bias and computes in float32"),
])
def test_scaled_mm_refusal_follows_cudas_limits(k, n, fp8, bias, out, why):
    """CUDA's _scaled_mm refuses K or N not multiples of 16, two E5M2 operands, and a bias with float32 output (the
    CPU's runs them all). The shape limits are the ones torch's fake CUDA _scaled_mm checks too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hqtflow.quantize.fp8_linear import scaled_mm_refusal
    from hqtflow.scales import FP8_DTYPES

    got = scaled_mm_refusal("cuda", k, n, fp8, bias, out)
    assert got is None if why is None else why in got
    assert scaled_mm_refusal("cpu", k, n, fp8, bias, out) is None
    with FakeTensorMode():
        x = torch.empty(3, k, dtype=FP8_DTYPES[fp8], device="cuda")
        w = torch.empty(n, k, dtype=FP8_DTYPES[fp8], device="cuda")
        one = torch.empty((), dtype=torch.float32, device="cuda")
        try:
            torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=out)
            shapes_ok = True
        except RuntimeError as e:
            assert "divisible by 16" in str(e)
            shapes_ok = False
    assert shapes_ok == (why is None or "multiples of 16" not in why)


@pytest.mark.parametrize("out, why", [(torch.bfloat16, None), (torch.float16, "need a bf16 output"),
                                      (torch.float32, "computes in float32")])
def test_scaled_mm_refusal_rowwise_needs_bf16(out, why):
    """Per-token (row-wise) scales: CUDA's _scaled_mm takes only a bf16 output ("Only bf16 high precision output types
    are supported for row-wise scaling"); per-tensor scales take fp16 too."""
    from hqtflow.quantize.fp8_linear import scaled_mm_refusal

    got = scaled_mm_refusal("cuda", 64, 32, "E4M3", False, out, rowwise=True)
    assert got is None if why is None else why in got
    assert scaled_mm_refusal("cuda", 64, 32, "E4M3", False, torch.float16) is None
    assert scaled_mm_refusal("cpu", 64, 32, "E4M3", False, out, rowwise=True) is None


def test_scaled_mm_outside_cudas_limits_keeps_qdq_or_is_refused(monkeypatch):
    """On CUDA (the layers' device judged as CUDA), "auto" gave scaled_mm to layers CUDA's _scaled_mm refuses at their
    first call: they keep qdq now, and an explicit --backend scaled_mm is refused in one sentence naming the layer."""
    from hqtflow.choices import Backend
    from hqtflow.errors import BackendError
    from hqtflow.quantize import fp8_linear

    real = fp8_linear.scaled_mm_refusal
    monkeypatch.setattr(fp8_linear, "scaled_mm_refusal", lambda device, *rest, **kw: real("cuda", *rest, **kw))
    monkeypatch.setattr(fp8_linear, "resolve_backend",
                        lambda b, device: Backend.SCALED_MM if b == "auto" else Backend(b))
    good, _ = _layer(k=64, n=32)
    odd, _ = _layer(k=40, n=32)
    fp32_bias, _ = _layer(k=64, n=32)
    fp32_bias.hp_dtype = torch.float32
    model = torch.nn.Sequential(good, odd, fp32_bias)
    assert set_backend(model, "auto") == 1
    assert [m.backend for m in model] == ["scaled_mm", "qdq", "qdq"]
    with pytest.raises(BackendError) as e:
        set_backend(model, "scaled_mm")
    assert str(e.value) == ("--backend scaled_mm cannot run layer 1: its in/out features (40, 32) are not multiples of "
                            "16 (--backend auto keeps such layers on qdq).")
    assert set_backend(torch.nn.Sequential(good), "scaled_mm") == 1


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_input_quantization_on_cuda_is_the_eager_one():
    """The compiled (one-kernel) input quantization of the CUDA path against the eager float32 arithmetic, at several
    M (one compile serves them all). Static: the same FP8 bytes. Per token: the same scales, but on an H100 some codes
    differed (likely a multiply by the row scale's reciprocal instead of the division), so a value a float32 rounding
    away from a tie between two FP8 codes may take the other one: codes at most one step apart, under 1% of them."""
    from hqtflow.quantize.fp8_linear import fused, quantize_per_token
    from hqtflow.scales import quantize

    torch.manual_seed(0)
    scale = torch.tensor([0.0123], dtype=torch.bfloat16, device="cuda")
    for m in (1, 7, 64, 300):
        x = (torch.randn(m, 4096, device="cuda") * 3).to(torch.bfloat16)
        x[0, :5] = torch.tensor([1e4, -1e4, 0.0, 1e-30, -0.0])
        assert torch.equal(fused(quantize)(x, scale, "E4M3").view(torch.uint8), quantize(x, scale, "E4M3").view(torch.uint8))
        assert torch.equal(quantize(x, scale.float(), "E4M3").view(torch.uint8),
                           (x.float() / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
        q, s = fused(quantize_per_token)(x, "E4M3")
        q_ref, s_ref = quantize_per_token(x, "E4M3")
        assert torch.equal(s, s_ref)
        steps = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()  # e4m3fn codes are monotonic per sign
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
def test_three_kernel_quantization_is_the_reference(dtype, fp8):
    """`quantize` divides by a [1] float32 scale (the division float32 without copying x to float32 first: the CUDA
    path's eager input quantization, FP8Linear.eager_quantizer = "aten"): the bytes of cast(clamp(x.float() / s)),
    overflow and signed zero included."""
    from hqtflow.scales import FP8_DTYPES, quantize

    torch.manual_seed(0)
    x = (torch.randn(37, 263) * torch.logspace(-8, 8, 263)).to(dtype)
    x[0, :3] = torch.tensor([0.0, -0.0, float(torch.finfo(dtype).max)])
    F = float(torch.finfo(FP8_DTYPES[fp8]).max)
    for scale in (torch.tensor([0.0123], dtype=torch.bfloat16), torch.tensor(3.7), torch.tensor([2.0 ** -9])):
        reference = (x.float() / scale.float()).clamp(-F, F).to(FP8_DTYPES[fp8])
        got = quantize(x, scale.float(), fp8)
        assert got.dtype == reference.dtype
        assert torch.equal(got.view(torch.uint8), reference.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton runs there)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", ["E4M3", "E5M2"])
def test_triton_quantization_on_cuda_is_the_reference(dtype, fp8):
    """The CUDA path's eager input quantization (`triton_quantize`, one kernel): the reference's bytes, subnormals,
    overflow, infinities and signed zeros included, at sizes on and off the kernel's block; NaN stays NaN."""
    from hqtflow.quantize import triton_quantize
    from hqtflow.scales import quantize

    assert triton_quantize.available  # torch's CUDA builds ship Triton
    torch.manual_seed(0)
    for rows, cols in ((37, 263), (1, 2048), (300, 4096), (3, 1)):
        x = (torch.randn(rows, cols) * torch.logspace(-8, 8, cols)).to(dtype).cuda()
        x.view(-1)[:4] = torch.tensor([0.0, -0.0, float(torch.finfo(dtype).max), -float("inf")])[:x.numel()]
        for scale in (torch.tensor([0.0123]), torch.tensor(3.7), torch.tensor([2.0 ** -9])):
            s = scale.float().cuda()
            got, reference = triton_quantize.quantize(x, s, fp8), quantize(x, s, fp8)
            assert got.dtype == reference.dtype and got.shape == x.shape
            assert torch.equal(got.view(torch.uint8), reference.view(torch.uint8)), (rows, cols, float(scale))
    nan = torch.tensor([float("nan"), 1.0], dtype=dtype, device="cuda")
    assert triton_quantize.quantize(nan, torch.ones((), device="cuda"), fp8).float()[0].isnan()
    strided = (torch.randn(64, 48) * 100).to(dtype).cuda().t()  # not contiguous: quantized as its values, in its shape
    assert not strided.is_contiguous()
    got, reference = triton_quantize.quantize(strided, s, fp8), quantize(strided, s, fp8)
    assert torch.equal(got.view(torch.uint8), reference.view(torch.uint8))


def test_scaled_mm_scales_are_cast_once_also_under_compile():
    """The float32 scales `_scaled_mm` takes are cast on the first eager call and kept: a compiled step reads those
    tensors (on an H200, compiling cast them in every call: 448 kernels, 0.48 ms of an 8B decode step's 5.0 ms), and
    a new stored scale is cast into the same tensors, which a captured graph reads."""
    import copy

    m, x = _layer(64, 32)
    set_backend(m, "scaled_mm")
    with torch.no_grad():
        eager = m(x)
        cached = m._mm_scales[1:]
        casts = []
        cast = m._cast_scales
        m._cast_scales = lambda w, a: casts.append(1) or cast(w, a)
        compiled = torch.compile(m, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), eager)
        assert not casts  # the cached tensors are the compiled step's inputs
        del m._cast_scales
        m.weight_scale.mul_(2)  # stored scale changed in place (its version moves)
        doubled = m(x)
        assert m._mm_scales[1] is cached[0] and m._mm_scales[2] is cached[1]
        assert torch.equal(cached[1], m.weight_scale.float().reshape(()))
        fresh = copy.deepcopy(m)
        fresh._mm_scales = None
        assert torch.equal(doubled, fresh(x)) and not torch.equal(doubled, eager)


def test_capturing_selects_the_compiled_quantization_for_warm_up_and_capture():
    """`capturing()` (around runtime.cuda_graphs.capture's warm-up and capture) is what makes a CUDA FP8Linear
    quantize its input with the one compiled kernel, so that kernel is compiled in the warm-up, not while a graph
    records; it ends with the block, an error included."""
    from hqtflow.quantize import fp8_linear, triton_quantize
    from hqtflow.scales import quantize

    m, _ = _layer(64, 32)
    compiled = fp8_linear.fused(quantize)
    assert m._cuda_quantizer() is quantize
    with pytest.raises(RuntimeError):
        with fp8_linear.capturing():
            assert m._cuda_quantizer() is compiled
            raise RuntimeError
    assert m._cuda_quantizer() is quantize
    m.eager_quantizer = "triton"
    assert m._cuda_quantizer() is (triton_quantize.quantize if triton_quantize.available else quantize)  # with a GPU
    m.eager_quantizer = "compiled"
    assert m._cuda_quantizer() is compiled


def test_linears_reading_one_tensor_share_its_quantization_only_when_told():
    """Under `sharing_inputs()` (the engine's steps) the CUDA path's FP8 input is kept on the input tensor and taken
    by the next Linear reading that tensor with a scale of equal value (q/k/v, gate/up); a scale of another value
    quantizes anew; outside it nothing is kept (a caller may change its input in place between calls)."""
    from hqtflow.quantize import fp8_linear
    from hqtflow.scales import quantize

    torch.manual_seed(0)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    layers = []
    for out, scale in ((32, 0.01), (16, 0.01), (48, 0.02)):
        lin = torch.nn.Linear(64, out, bias=False).to(torch.bfloat16)
        layers.append(FP8Linear.from_linear(lin, lin.weight.abs().max().reshape(1) / 448, torch.tensor([scale])))
    q, k, other = layers
    x2 = x.reshape(-1, 64)
    with torch.no_grad():
        scales = [m._float_scales()[0] for m in layers]
        first = q._shared_quantized(x, x2, scales[0])
        assert not hasattr(x, "_hqtflow_fp8") and k._shared_quantized(x, x2, scales[1]) is not first
        with fp8_linear.sharing_inputs():
            first = q._shared_quantized(x, x2, scales[0])
            assert torch.equal(first.view(torch.uint8), quantize(x2, scales[0]).view(torch.uint8))
            assert k._shared_quantized(x, x2, scales[1]) is first  # equal value, another tensor
            third = other._shared_quantized(x, x2, scales[2])
            assert third is not first and torch.equal(third.view(torch.uint8), quantize(x2, scales[2]).view(torch.uint8))
            y = x + 0
            assert q._shared_quantized(y, y.reshape(-1, 64), scales[0]) is not first  # another tensor


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8 tensor cores)")
def test_a_graph_of_an_fp8_linear_replays_its_eager_output():
    from hqtflow.runtime.cuda_graphs import capture

    m, x = _layer(256, 512)
    m, x = m.cuda(), x.cuda()
    set_backend(m, "scaled_mm")
    with torch.inference_mode():
        eager = m(x)  # three eager kernels
        graph, out = capture(lambda: m(x))  # the compiled kernel: the same bytes
        graph.replay()
    assert torch.equal(out, eager)


def test_scaled_mm_scales_follow_a_device_move():
    """A moved layer (`.to()`) casts its float32 scales anew on its new device: they are not copied into the tensors
    cast on the old one (the meta device stands in for a GPU)."""
    m, x = _layer(64, 32)
    set_backend(m, "scaled_mm")
    with torch.no_grad():
        m(x)
        before = m._mm_scales[1:]
        m.to("meta")
        a, b = m._float_scales()
    assert a.device.type == "meta" and b.device.type == "meta" and before[0].device.type == "cpu"
