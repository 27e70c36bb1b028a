"""Every HQT scale method against the formulas of ../shared/reference/hqt-formats.md, written out by hand here."""

import math

import pytest
import torch

from hqtflow.errors import ConfigError
from hqtflow.formats.quant_config import SCALE_METHODS
from hqtflow.scales import (activation_scale, dequantize, full_scale, hw_scales, inc_code_scale, linear_scales,
                            quantize, round_hw, scale_method, weight_scale)


def pow2(x):
    return 2.0 ** math.ceil(math.log2(x))


def bf16(x):
    return torch.tensor(x, dtype=torch.bfloat16).item()


def test_full_scales():
    assert full_scale("E4M3", "cpu") == full_scale("E4M3", "cuda") == full_scale("E4M3", "gaudi3") == 448.0
    assert full_scale("E4M3", "gaudi2") == 240.0
    assert full_scale("E5M2", "gaudi2") == full_scale("E5M2", "cpu") == 57344.0
    with pytest.raises(ConfigError):
        full_scale("E3M4")


def test_hardware_sets():
    assert hw_scales("gaudi2") == [16.0, 1.0, 2.0**-4, 2.0**-8]
    g3 = hw_scales("gaudi3")
    assert g3[0] == 128.0 and g3[-1] == 2.0**-55 and len(g3) == 63
    assert hw_scales("cpu") == g3  # hqtflow's documented meaning off Gaudi


@pytest.mark.parametrize("raw, g2, g3", [
    (0.3, 1.0, 0.5), (1.5, 16.0, 2.0), (0.05, 2.0**-4, 2.0**-4), (0.004, 2.0**-4, 2.0**-7),
    (1e-5, 2.0**-8, 2.0**-16), (500.0, 16.0, 128.0), (2.0**-4, 2.0**-4, 2.0**-4),
])
def test_hw_aligned_rounding(raw, g2, g3):
    s = torch.tensor(raw, dtype=torch.float32)
    assert round_hw(s, "gaudi2").item() == g2
    assert round_hw(s, "gaudi3").item() == g3


@pytest.mark.parametrize("target", ["cpu", "gaudi2", "gaudi3"])
@pytest.mark.parametrize("maxabs", [3.28, 0.0123, 117.5, 1000.0])
def test_activation_scales_follow_formulas(target, maxabs):
    F = 240.0 if target == "gaudi2" else 448.0
    raw = bf16(bf16(maxabs) / (F * 0.25))  # INC computes in hp_dtype (bf16)
    assert activation_scale(maxabs, scale_method("maxabs_arbitrary", target).activation, target=target).item() == raw
    assert activation_scale(maxabs, scale_method("maxabs_pow2", target).activation, target=target).item() == pow2(raw)
    hw = activation_scale(maxabs, scale_method("maxabs_hw", target).activation, target=target).item()
    assert hw == round_hw(torch.tensor(raw), target).item()
    assert activation_scale(maxabs, scale_method("unit_scale").activation).item() == 1.0
    single = activation_scale(maxabs, scale_method("hw_aligned_single_scale", target).activation, target=target).item()
    assert single == (16.0 if target == "gaudi2" else 128.0)


def test_fp32_hp_dtype_keeps_precision():
    r = activation_scale(3.28, scale_method("maxabs_arbitrary").activation, hp_dtype="fp32")
    assert r.dtype == torch.float32 and r.item() == pytest.approx(3.28 / 112, rel=1e-7)


def test_per_channel_statistics_reduce_to_max():
    stats = [[[0.5], [3.0], [1.25]]]  # an input measured per channel
    assert activation_scale(stats, scale_method("maxabs_arbitrary").activation).item() == bf16(3.0 / 112)


@pytest.fixture
def w():
    torch.manual_seed(0)
    return (torch.randn(16, 32) * torch.logspace(-2, 1, 16)[:, None]).to(torch.bfloat16)


def test_weight_per_tensor(w):
    m = w.abs().max().item()
    assert weight_scale(w, scale_method("maxabs_arbitrary").weight).item() == bf16(m / 224)
    assert weight_scale(w, scale_method("maxabs_pow2").weight).item() == pow2(bf16(m / 224))
    assert weight_scale(w, scale_method("maxabs_hw", "gaudi2").weight, target="gaudi2").item() == \
        round_hw(torch.tensor(bf16(m / 120)), "gaudi2").item()


def test_weight_per_channel(w):
    s = weight_scale(w, scale_method("act_maxabs_pow2_weights_pcs_maxabs_pow2").weight)
    assert s.shape == (16,)
    for i in range(16):
        assert s[i].item() == pow2(bf16(w[i].abs().max().item() / 224))


def test_inc_per_channel_weight_scales_are_computed_in_the_weights_dtype():
    """INC's MaxAbsPcs: maxabs / 224 and its rounding in the weight's dtype (fp32 here), then hp_dtype (bf16); hqtflow's
    own methods cast to bf16 first. 224 * (1 + 2^-12) is 224 in bf16 (scale 1) but over it in fp32 (pow2: 2)."""
    w = torch.tensor([[224 * (1 + 2**-12), 1.0]])
    rule = scale_method("act_maxabs_pow2_weights_pcs_maxabs_pow2").weight
    assert weight_scale(w, rule).tolist() == [2.0] and weight_scale(w, rule, inc=False).tolist() == [1.0]


def _qdq_err(w, s):
    return float(((w.float() - dequantize(quantize(w, s), s, torch.float32)) ** 2).sum())


def test_opt_weight_minimises_error(w):
    """INC's mmse_scale: ||W - dq(q(W))|| computed in hp_dtype (bf16), the last candidate of the least error; its
    float32 error is the least up to bf16's resolution (tests/test_inc_equivalence.py runs INC's own function)."""
    for name, cands in (("maxabs_pow2_opt_weight", [2.0**e for e in range(-10, 10)]),
                        ("maxabs_hw_opt_weight", hw_scales("cpu"))):
        s = weight_scale(w, scale_method(name).weight)
        errs = {c: float(torch.norm(w - dequantize(quantize(w, torch.tensor(c)), torch.tensor(c), torch.bfloat16)))
                for c in cands}
        assert s.item() == [c for c in cands if errs[c] == min(errs.values())][-1], name
        best = min(_qdq_err(w, torch.tensor(c, dtype=torch.bfloat16)) for c in cands)
        assert _qdq_err(w, s) == pytest.approx(best, rel=2.0**-7), name


def test_pcs_opt_weight_minimises_error_per_channel(w):
    s = weight_scale(w, scale_method("act_maxabs_pow2_weights_pcs_opt_pow2").weight)
    ref = weight_scale(w, scale_method("act_maxabs_pow2_weights_pcs_maxabs_pow2").weight)
    for i in range(16):
        errs = [_qdq_err(w[i:i + 1], (ref[i] * 2.0**e).reshape(1, 1)) for e in range(-3, 5)]
        assert _qdq_err(w[i:i + 1], s[i].reshape(1, 1)) == pytest.approx(min(errs), rel=1e-6)
        assert math.log2(s[i].item()).is_integer()


def test_mse_weight_scale_is_the_least_squares_multiplier(w):
    """fp8_dynamic_mse: each channel's scale is amax / 448 times the multiplier (0.70..1.00, rounded to the weight's
    dtype as stored, at least the scale floor) with the least float32 squared round-trip error; never worse than amax / 448; an outlier channel
    whose only large value would saturate keeps amax / 448 when no smaller scale helps."""
    from hqtflow.scales import MSE_MULTIPLIERS, floored

    w = torch.cat([w, torch.tensor([[448.0] + [0.5] * 31], dtype=torch.bfloat16)])
    s = weight_scale(w, scale_method("fp8_dynamic_mse").weight)
    ref = weight_scale(w, scale_method("fp8_dynamic").weight)
    assert s.dtype == ref.dtype == torch.bfloat16 and s.shape == ref.shape
    def err(row, scale):  # the runtime's weight: hp(q * s), here bf16
        return float(((row.float() - dequantize(quantize(row, scale), scale, torch.bfloat16).float()) ** 2).sum())

    for i in range(w.shape[0]):
        cands = [ref[i]] + [floored((ref[i].float() * m).to(torch.bfloat16)) for m in MSE_MULTIPLIERS]
        errs = [err(w[i:i + 1], c.reshape(1, 1)) for c in cands]
        assert err(w[i:i + 1], s[i].reshape(1, 1)) == min(errs) <= errs[0]
    assert (s < ref).any() and (s <= ref).all()


def test_mse_weight_scale_ties_go_to_the_largest_multiplier():
    """[56, 38.5] in bf16 (amax / 448 = 0.125, error 2.25): the scales 0.1226 and 0.1235 both give the least error
    (1.5625); the larger one (the larger multiplier, nearer amax / 448) is chosen, whichever order they come in."""
    w = torch.tensor([[56.0, 38.5]], dtype=torch.bfloat16)
    assert weight_scale(w, scale_method("fp8_dynamic_mse").weight).tolist() == [0.12353515625]


@pytest.mark.parametrize("name", SCALE_METHODS)
def test_every_method_gives_positive_finite_scales(name, w):
    from hqtflow.scales import DYNAMIC_METHODS, INC_DYNAMIC_METHODS

    sc = linear_scales(scale_method(name, dynamic=name in INC_DYNAMIC_METHODS), 2.5, w)
    if name in DYNAMIC_METHODS:  # activation scales come at run time (tests/quantize/test_dynamic.py)
        assert sc.input is None and torch.isfinite(sc.weight).all() and (sc.weight > 0).all()
        return
    assert torch.isfinite(sc.input).all() and (sc.input > 0).all()
    assert torch.isfinite(sc.weight).all() and (sc.weight > 0).all()
    torch.testing.assert_close(sc.output, sc.input * sc.weight)


@pytest.mark.parametrize("name", SCALE_METHODS)
def test_scales_floored_in_the_dtype_they_are_stored_in(name):
    """An fp16 model: a zero input statistic, an all-zero weight row or tensor get fp16's smallest normal (2^-14),
    not bf16's 2^-126 (0 in fp16); INC scale files store hp_dtype (bf16) scales, floored at 2^-126."""
    from hqtflow.scales import INC_DYNAMIC_METHODS

    m = scale_method(name, dynamic=name in INC_DYNAMIC_METHODS)
    w = (torch.randn(8, 32, generator=torch.Generator().manual_seed(1)) * 0.05).half()
    w[0] = 0
    for weight in (w, torch.zeros_like(w)):
        sc = linear_scales(m, 0.0, weight)
        for s in (sc.weight,) if m.dynamic else (sc.input, sc.weight, sc.output):
            assert s.dtype == torch.float16 and (s >= 2.0**-14).all(), (name, s)
    sc = linear_scales(m, 0.0, torch.zeros_like(w), store=torch.bfloat16)
    assert sc.weight.dtype == torch.bfloat16 and (sc.weight >= 2.0**-126).all()
    assert m.weight.value != "MAXABS" or sc.weight.float().min() < 2.0**-14


def test_scale_over_the_stored_dtype_refused():
    """A finite statistic whose scale fp16 cannot hold (1e7 / 112 -> 2^17 > 65504) is refused in one sentence, not
    written as inf; bf16 holds it; over MAX_SCALE (what any reader takes) every dtype refuses."""
    from hqtflow.errors import ArtifactError, ModelError

    m, w = scale_method("maxabs_pow2"), torch.full((4, 8), 0.1)
    with pytest.raises(ArtifactError, match=r"^The measured input maxabs of q gives the input scale 1.31e\+05, over "
                                            r"6.55e\+04, the largest float16 value; the statistics are corrupt.$"):
        linear_scales(m, 1e7, w.half(), name="q")
    assert linear_scales(m, 1e7, w.bfloat16()).input.item() == 2.0**17
    with pytest.raises(ArtifactError, match="over 5.93e\\+33, the most any reader takes; the statistics are corrupt"):
        linear_scales(m, 1e38, w.bfloat16(), name="q")
    big = torch.full((4, 8), 2e4).half()  # 2^9 * 2^7: each scale fits fp16, their product (the output scale) not
    assert linear_scales(m, 5e4, big, name="q").input.item() == 2.0**9  # a checkpoint stores no output scale
    with pytest.raises(ArtifactError, match="gives the output scale"):  # INC scale files do
        linear_scales(m, 5e4, big, name="q", store=torch.float16)
    with pytest.raises(ModelError, match="The weight of q gives the scale inf, over 6.55e\\+04"):  # scale files, hp fp16
        linear_scales(m, 1.0, torch.full((4, 8), 1e6), name="q", hp_dtype="fp16", store=torch.float16)
    from hqtflow.formats.scale_files import MAX_SCALE
    from hqtflow.scales import LinearScales, stored

    top = torch.tensor(65504.0, dtype=torch.float16)  # the limits themselves are stored: "over" means over
    assert stored(LinearScales(top, top / top), torch.float16, output=True).input.item() == 65504.0  # output too
    top = torch.tensor(MAX_SCALE)
    assert stored(LinearScales(top, top), torch.float32).weight.item() == MAX_SCALE


def test_quantize_saturates_and_matches_torch_cast():
    x = torch.tensor([0.0, 1.0, -3.3, 447.0, 1000.0, -1e6, 0.0015])
    q = quantize(x, torch.tensor(1.0))
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().tolist()[4:6] == [448.0, -448.0]  # saturated, not NaN
    torch.testing.assert_close(q.float()[:4], x[:4].to(torch.float8_e4m3fn).float())
    q5 = quantize(x, torch.tensor(1.0), "E5M2")
    assert q5.dtype == torch.float8_e5m2 and q5.float()[5].item() == -57344.0


def test_inc_code_scale():
    """1 / (1 / s): the inner reciprocal rounded to s's dtype (INC's invert_scale), the outer in double precision."""
    s = torch.tensor([0.0123, 3.0, 0.5, 2.0**-9, 448.0 / 7], dtype=torch.bfloat16)
    want = [1 / float(torch.tensor(1 / float(v), dtype=torch.bfloat16)) for v in s.float()]
    got = inc_code_scale(s)
    assert got.dtype == torch.float32 and got.tolist() == [float(torch.tensor(w, dtype=torch.float32)) for w in want]
    assert got[2] == 0.5 and got[3] == 2.0**-9  # powers of two are unchanged
    assert ((got / s.float() - 1).abs() <= 2.0**-8).all() and got[0] != s[0].float()
    # INC's methods pick codes this way; hqtflow's own keep compressed-tensors' w / s
    assert scale_method("maxabs_arbitrary").inc_codes and scale_method("maxabs_pow2").inc_codes
    assert not scale_method("fp8_dynamic").inc_codes and not scale_method("fp8_dynamic_mse").inc_codes


def test_unknown_method_and_target():
    with pytest.raises(ConfigError, match="Unknown scale method 'maxabs_fast'"):
        scale_method("maxabs_fast")
    with pytest.raises(ConfigError, match="Unknown scale target 'tpu'"):
        scale_method("maxabs_pow2", "tpu")


def test_dict_form():
    m = scale_method({"default": {"weight": {"granularity": "PCS", "rounding_method": "POW2", "backoff": 0.5},
                                  "activation": {"rounding_method": "POW2", "backoff": 0.25}}})
    assert m.weight.granularity == "PCS" and m.activation.rounding == "POW2"
