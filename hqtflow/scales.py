"""FP8 scales from statistics and weights: every HQT scale method, as pure functions.

Formulas (../shared/reference/hqt-formats.md, Neural Compressor's fp8_quant): full scale F (E4M3: 448, 240 on
Gaudi2; E5M2: 57344); raw scale r = maxabs / (F * backoff) with backoff 0.5 for weights and 0.25 for
activations; rounding IDENTITY r, POW2 2^ceil(log2 r), HW_ALIGNED POW2 then 2^(k*ceil(log2(p)/k)) clamped to the
hardware set. A scale s quantizes x as cast(clamp(x / s, -F, F)) and dequantizes q as q * s. A Linear's output scale
is input scale * weight scale.

Like INC, the raw scale of a measured statistic is computed in `hp_dtype` (bf16 by default): the statistic is cast
to hp_dtype before dividing, so power-of-two scales equal INC's exactly.

Every computed scale is at least the smallest normal number of its dtype (`floored`: 2^-126 in bf16 and fp32,
2^-14 in fp16), never zero or denormal: an all-zero tensor gets that floor instead of a zero scale (its values
quantize to 0 exactly with any positive scale). INC floors a per-channel scale at bf16's smallest normal too, so
scales equal INC's down to that floor; E5M2's full scale (57344) makes scales below 2^-14 the common case there.
`linear_scales` floors again in the dtype the scales are stored in (`stored`: an fp16 checkpoint's are fp16, where
bf16's 2^-126 is 0) and refuses a scale that dtype cannot hold.
Negative or non-finite statistics never get here: reading a measurement refuses them
(`hqtflow.formats.measurement.check_statistics`).

Off Gaudi ("cpu", "cuda") there is no hardware scale set: hqtflow defines HW_ALIGNED there as Gaudi3's rule (powers
of two, k = 1, clamped to [2^-55, 2^7]), so `maxabs_hw` scales made for a CPU or CUDA checkpoint are the ones a
Gaudi3 would use, and `hw_aligned_single_scale` is Gaudi3's first hardware scale (128).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from hqtflow import choices
from hqtflow.errors import ConfigError
from hqtflow.formats.quant_config import INC_DYNAMIC_METHODS

TARGETS = ("gaudi2", "gaudi3", "cpu", "cuda")
FP8_DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
HP_DTYPES = {d.value: d.torch for d in choices.HP_DTYPES}  # hqtflow's name -> torch's dtype
WEIGHT_BACKOFF, ACTIVATION_BACKOFF = 0.5, 0.25


def floored(s: torch.Tensor) -> torch.Tensor:
    """`s` with every value at least the smallest normal number of its dtype (see the module doc)."""
    return torch.clamp(s, min=torch.finfo(s.dtype).tiny)


def full_scale(fp8: str = "E4M3", target: str = "cpu") -> float:
    """Largest finite value of the FP8 format on `target` (Gaudi2's E4M3 has the range of e4m3fnuz)."""
    if fp8 == "E4M3":
        return float(torch.finfo(torch.float8_e4m3fnuz).max) if target == "gaudi2" else float(torch.finfo(torch.float8_e4m3fn).max)
    if fp8 == "E5M2":
        return float(torch.finfo(torch.float8_e5m2).max)
    raise ConfigError(f"fp8_config {fp8!r} is not an FP8 format; valid values are {', '.join(FP8_DTYPES)}.")


def hw_scales(target: str) -> list[float]:
    """The scales the hardware applies for free (E4M3 exponent-bias set), largest first.

    Gaudi2: biases {3, 7, 11, 15} -> {16, 1, 2^-4, 2^-8}; Gaudi3 (and, by hqtflow's definition, cpu/cuda):
    biases 0..62 -> 2^7 .. 2^-55. INC uses the E4M3 set for HW_ALIGNED rounding whatever fp8_config says.
    """
    biases = [3, 7, 11, 15] if target == "gaudi2" else range(63)
    return [2.0 ** (7 - b) for b in biases]


def _hw_traits(target: str) -> tuple[float, float, int]:
    s = hw_scales(target)
    return min(s), max(s), 4 if target == "gaudi2" else 1


# ---- rounding ----------------------------------------------------------------------------------
def round_pow2(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(s)))


def round_hw(s: torch.Tensor, target: str) -> torch.Tensor:
    lo, hi, k = _hw_traits(target)
    p = round_pow2(s)
    aligned = 2.0 ** (torch.ceil(torch.log2(p) / k) * k)
    return torch.clamp(aligned, min=lo, max=hi).to(s.dtype)


def apply_rounding(s: torch.Tensor, rounding: str, target: str) -> torch.Tensor:
    if rounding == "IDENTITY":
        return s
    if rounding == "POW2":
        return round_pow2(s)
    if rounding == "HW_ALIGNED":
        return round_hw(s, target)
    if rounding == "HW_ALIGNED_FIXED":
        return torch.full_like(s, hw_scales(target)[0])
    if rounding == "SCALE_UNIT":
        return torch.ones_like(s)
    raise ConfigError(f"Unknown rounding method {rounding!r}.")


# ---- methods -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """How one tensor kind (weight or activation) gets its scale."""

    granularity: str = "PTS"  # PTS: one scale; PCS: one per output channel (weights)
    value: str = "MAXABS"  # MAXABS | FIXED_VALUE | OPT | DUMMY_SCALES | MSE (hqtflow's: see `_least_squares_per_channel`)
    rounding: str = "IDENTITY"
    backoff: float = 1.0
    candidates: tuple[float, ...] | None = None  # OPT: scales (PTS) or multipliers (PCS) to search
    # Activations computed at run time from each input instead of a measurement: None (static), "inc" (Neural
    # Compressor's dynamic arithmetic, in the input's dtype) or "fp32" (compressed-tensors / vLLM: amax / F in
    # float32). With granularity PCS the scale is per token (one per row of the last dimension), PTS per call.
    dynamic: str | None = None


@dataclass(frozen=True)
class ScaleMethod:
    name: str
    weight: Rule
    activation: Rule

    smoothquant: bool = False  # HQT 1.17's SmoothQuant (hqtflow.quantize.smoothquant); weight/activation: its fallback

    @property
    def dynamic(self) -> bool:
        return self.activation.dynamic is not None

    @property
    def inc_codes(self) -> bool:
        """Weights take their FP8 codes as Neural Compressor picks them (`inc_code_scale`): every method but
        hqtflow's own (compressed-tensors' arithmetic: w / s)."""
        return self.name not in HQTFLOW_DYNAMIC_METHODS


# Neural Compressor 3.10's methods that exist only with `dynamic_quantization: true` (it refuses them otherwise).
# hqtflow's own: compressed-tensors FP8_DYNAMIC (llm-compressor's preset, vLLM's near-lossless default):
# per-channel weights amax / F, per-token activations amax / F in float32, no backoff, no rounding; and
# fp8_dynamic_mse: the same, each weight channel's scale amax / F times the multiplier in MSE_MULTIPLIERS with the
# least squared rounding error of that channel (a data-free search; the checkpoint layout is FP8_DYNAMIC's).
HQTFLOW_DYNAMIC_METHODS = ("fp8_dynamic", "fp8_dynamic_mse")
MSE_MULTIPLIERS = tuple(round(0.70 + 0.01 * i, 2) for i in range(31))  # 0.70 .. 1.00
DYNAMIC_METHODS = INC_DYNAMIC_METHODS + HQTFLOW_DYNAMIC_METHODS
# The Habana Quantization Toolkit 1.17's SmoothQuant methods (hqtflow.quantize.smoothquant; not in INC 3.10)
SMOOTHQUANT_METHODS = ("smoothquant_weights_output_channel_maxabs_pow2",
                       "weaksmoothquant_weights_output_channel_maxabs_pow2", "smoothquant_opt")
INC_DYNAMIC_BACKOFF = 0.5  # INC's ScaleMethodFactory forces this backoff on every dynamic activation scale


def as_dynamic(method: ScaleMethod) -> ScaleMethod:
    """`method` with `dynamic_quantization: true`, as INC applies it: its activation rule (PTS: one scale per call,
    PCS: per token) computed at run time with backoff 0.5; HW_ALIGNED or fixed activation scales are refused."""
    if method.dynamic:
        return method
    a = method.activation
    if a.value != "MAXABS" or a.rounding not in ("IDENTITY", "POW2"):
        raise ConfigError(f"Scale method {method.name} cannot run with dynamic_quantization (INC supports dynamic "
                          "activations with MAXABS values and IDENTITY or POW2 rounding only).")
    return replace(method, activation=replace(a, backoff=INC_DYNAMIC_BACKOFF, dynamic="inc"))


def _hw_candidates(target: str) -> tuple[float, ...]:
    return tuple(hw_scales(target))


def scale_method(spec: str | dict, target: str = "cpu", *, dynamic: bool = False) -> ScaleMethod:
    """The weight and activation rules of a scale method name (or INC's dict form, its `default` section).

    `dynamic`: INC's `dynamic_quantization` (see `as_dynamic`); INC's dynamic-only methods need it.
    """
    if target not in TARGETS:
        raise ConfigError(f"Unknown scale target {target!r}; valid values are {', '.join(TARGETS)}.")
    if isinstance(spec, dict):
        if not isinstance(spec.get("default"), dict):
            raise ConfigError("A scale_method object needs a 'default' section (as Neural Compressor requires).")
        return _checked_dynamic(_from_dict(spec["default"], target), dynamic, "default")
    if spec in INC_DYNAMIC_METHODS and not dynamic:
        raise ConfigError(f"Scale method {spec} is supported only with dynamic_quantization: true (as in Neural Compressor).")
    if spec in SMOOTHQUANT_METHODS:
        if dynamic:
            raise ConfigError(f"{spec} computes static smoothed scales; it cannot run with dynamic_quantization.")
        fallback = _named("act_maxabs_pow2_weights_pcs_maxabs_pow2", target)
        return ScaleMethod(spec, fallback.weight, fallback.activation, smoothquant=True)
    m = _named(spec, target)
    return as_dynamic(m) if dynamic else m


def _named(spec: str, target: str) -> ScaleMethod:
    w_pow2 = Rule(rounding="POW2", backoff=WEIGHT_BACKOFF)
    a_pow2 = Rule(rounding="POW2", backoff=ACTIVATION_BACKOFF)
    w_hw = Rule(rounding="HW_ALIGNED", backoff=WEIGHT_BACKOFF)
    a_hw = Rule(rounding="HW_ALIGNED", backoff=ACTIVATION_BACKOFF)
    pcs_pow2 = Rule("PCS", rounding="POW2", backoff=WEIGHT_BACKOFF)
    pcs_opt = Rule("PCS", "OPT", "POW2", WEIGHT_BACKOFF, tuple(2.0**e for e in range(-3, 5)))
    table = {
        "unit_scale": (Rule(value="FIXED_VALUE", rounding="SCALE_UNIT"), Rule(value="FIXED_VALUE", rounding="SCALE_UNIT")),
        "hw_aligned_single_scale": (Rule(value="FIXED_VALUE", rounding="HW_ALIGNED_FIXED"),
                                    Rule(value="FIXED_VALUE", rounding="HW_ALIGNED_FIXED")),
        "maxabs_hw": (w_hw, a_hw),
        "maxabs_pow2": (w_pow2, a_pow2),
        "maxabs_arbitrary": (Rule(backoff=WEIGHT_BACKOFF), Rule(backoff=ACTIVATION_BACKOFF)),
        "maxabs_hw_opt_weight": (Rule("PTS", "OPT", "HW_ALIGNED", WEIGHT_BACKOFF, _hw_candidates(target)), a_hw),
        "maxabs_pow2_opt_weight": (Rule("PTS", "OPT", "POW2", WEIGHT_BACKOFF, tuple(2.0**e for e in range(-10, 10))), a_pow2),
        "act_maxabs_hw_weights_pcs_maxabs_pow2": (pcs_pow2, a_hw),
        "act_maxabs_pow2_weights_pcs_maxabs_pow2": (pcs_pow2, a_pow2),
        "act_maxabs_hw_weights_pcs_opt_pow2": (pcs_opt, a_hw),
        "act_maxabs_pow2_weights_pcs_opt_pow2": (pcs_opt, a_pow2),
        # INC 3.10's dynamic methods (`as_dynamic` sets the activation backoff to 0.5 as INC does)
        "act_maxabs_pcs_pow2_weight_maxabs_pts_pow2_hw": (w_hw, Rule("PCS", rounding="POW2")),
        "maxabs_pcs_pow2": (pcs_pow2, Rule("PCS", rounding="POW2")),
        "fp8_dynamic": (Rule("PCS"), Rule("PCS", dynamic="fp32")),
        "fp8_dynamic_mse": (Rule("PCS", "MSE", candidates=MSE_MULTIPLIERS), Rule("PCS", dynamic="fp32")),
    }
    if spec not in table:
        raise ConfigError(f"Unknown scale method {spec!r}; valid values are {', '.join(table)}.")
    weight, activation = table[spec]
    return ScaleMethod(spec, weight, activation)



def _key(r: Rule) -> tuple[str, str, str]:
    """What INC compares to recognise a method (ScaleMethodConfig.__eq__): backoff and params are not part of it."""
    return (r.granularity, r.value, r.rounding)


def _reference(weight: Rule, activation: Rule, target: str) -> ScaleMethod | None:
    """The named INC method whose rules have the same granularity, value type and rounding (INC's
    get_scale_method_from_config), or None."""
    for name in [*SCALE_METHOD_NAMES]:
        m = _named(name, target)
        if name not in HQTFLOW_DYNAMIC_METHODS and (_key(m.weight), _key(m.activation)) == (_key(weight), _key(activation)):
            return m
    return None


def _from_dict(spec: dict, target: str = "cpu", section: str = "default", base: ScaleMethod | None = None) -> ScaleMethod:
    """One `{weight, activation}` entry of INC's dict form, as INC's parse_scale_method + validate_and_populate read
    it: a missing key comes from `base` (the default entry; for the default itself: PTS, MAXABS, IDENTITY, backoff
    1.0); the combination must be one of INC's named methods (whose OPT candidates fill in missing params)."""

    def rule(d: dict, b: Rule | None) -> Rule:
        b = b or Rule()
        cands = (d.get("params") or {}).get("weight_scales") if "params" in d else b.candidates
        return Rule(d.get("granularity", b.granularity), d.get("scale_value_type", b.value),
                    d.get("rounding_method", b.rounding), float(d.get("backoff", b.backoff)),
                    tuple(float(c) for c in cands) if cands else None)

    w = rule(spec.get("weight") or {}, base.weight if base else None)
    a = rule(spec.get("activation") or {}, base.activation if base else None)
    ref = _reference(w, a, target)
    if ref is None:
        raise ConfigError(f"scale_method.{section}: weight {'/'.join(_key(w))} with activation {'/'.join(_key(a))} is not "
                          "one of Neural Compressor's scale methods, which INC refuses.")
    if w.value == "OPT" and not w.candidates:
        w = replace(w, candidates=ref.weight.candidates)
    return ScaleMethod(ref.name, w, a)


SCALE_METHOD_NAMES = ("unit_scale", "hw_aligned_single_scale", "maxabs_hw", "maxabs_pow2", "maxabs_arbitrary",
                      "maxabs_hw_opt_weight", "maxabs_pow2_opt_weight", "act_maxabs_hw_weights_pcs_maxabs_pow2",
                      "act_maxabs_pow2_weights_pcs_maxabs_pow2", "act_maxabs_hw_weights_pcs_opt_pow2",
                      "act_maxabs_pow2_weights_pcs_opt_pow2", *INC_DYNAMIC_METHODS)
LAYER_INDEX = (re.compile(r"layers\.(\d+)"), re.compile(r"layers/(\d+)"))


@dataclass(frozen=True)
class ScaleRules:
    """A scale method per module: INC 3.10's dict `scale_method` with `nodes` (module names), `layers` (decoder
    layer indices, found by `layers.<i>` in the name) and `layer_types` (module class names) sections."""

    default: ScaleMethod
    nodes: dict = field(default_factory=dict)
    layers: dict = field(default_factory=dict)
    layer_types: dict = field(default_factory=dict)

    def __call__(self, name: str, type_name: str = "Linear") -> ScaleMethod:
        """INC's find_node_scale_method_config: a node entry, else the layer index's, else the type's, else default."""
        if name in self.nodes:
            return self.nodes[name]
        for pattern in LAYER_INDEX:
            match = pattern.search(name)
            if match:
                if match.group(1) in self.layers:
                    return self.layers[match.group(1)]
                break
        return self.layer_types.get(type_name, self.default)

    def methods(self) -> list[ScaleMethod]:
        return [self.default, *self.nodes.values(), *self.layers.values(), *self.layer_types.values()]

    @property
    def uniform(self) -> bool:
        return not (self.nodes or self.layers or self.layer_types)


def scale_rules(spec: str | dict, target: str = "cpu", *, dynamic: bool = False) -> ScaleRules:
    """The per-module scale methods of a `scale_method` (a name: the same method everywhere)."""
    if not isinstance(spec, dict):
        return ScaleRules(scale_method(spec, target, dynamic=dynamic))
    default = scale_method(spec, target, dynamic=dynamic)
    raw_default = _from_dict(spec["default"], target)
    sections = {}
    for section in ("nodes", "layers", "layer_types"):
        entries = {}
        for key, entry in (spec.get(section) or {}).items():
            m = _from_dict(entry, target, f"{section}.{key}", raw_default)
            entries[str(key)] = _checked_dynamic(m, dynamic, f"{section}.{key}")
        sections[section] = entries
    return ScaleRules(default, **sections)


def _checked_dynamic(m: ScaleMethod, dynamic: bool, where: str) -> ScaleMethod:
    if m.name in INC_DYNAMIC_METHODS and not dynamic:
        raise ConfigError(f"scale_method.{where} is {m.name}, which INC supports only with dynamic_quantization: true.")
    return as_dynamic(m) if dynamic else m


# ---- FP8 casts (the QDQ reference) -------------------------------------------------------------
def quantize(x: torch.Tensor, scale: torch.Tensor, fp8: str = "E4M3", fullscale: float | None = None) -> torch.Tensor:
    """cast(clamp(x / scale, -F, F)) to the FP8 dtype, computed in float32 (saturating, never NaN).

    The same arithmetic as Neural Compressor's CPU QDQ path (torchao's `_quantize_affine_float8`).
    """
    F = float(torch.finfo(FP8_DTYPES[fp8]).max) if fullscale is None else fullscale
    s = scale.to(x.device, torch.float32)  # a dimensioned float32 divisor: the division is float32, x not copied first
    return torch.div(x, s.reshape(1) if s.dim() == 0 else s).clamp_(-F, F).to(FP8_DTYPES[fp8])


def inc_code_scale(s: torch.Tensor) -> torch.Tensor:
    """The scale Neural Compressor picks a weight's FP8 codes with (the weight is dequantized with `s` itself):
    1 / s in s's own dtype (its `invert_scale`; Gaudi's cast multiplies by this), inverted back in double precision,
    as float32. Within 2^-8 of a bf16 `s` (relative); exactly `s` for a power of two."""
    return torch.reciprocal(s).double().reciprocal().float()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in float32, then cast to `dtype`."""
    return (q.float() * scale.float()).to(dtype)


# ---- computing scales --------------------------------------------------------------------------
def dynamic_activation_scale(x: torch.Tensor, rule: Rule, *, fp8: str = "E4M3", target: str = "cpu") -> torch.Tensor:
    """The run-time scale of activation `x` under a dynamic rule: [..., 1] per token (PCS) or 0-d (PTS).

    "inc": Neural Compressor 3.10's MaxAbsDynamicPcs / MaxAbsDynamicPts off Gaudi's cguid path, in x's dtype:
    amax(|x|) / (F * backoff), per token at least bf16's smallest normal (PCS), then the rounding.
    "fp32": compressed-tensors / vLLM: amax(|x|) / F in float32, at least 1e-12.
    """
    F = full_scale(fp8, target)
    if rule.dynamic == "fp32":
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True) if rule.granularity == "PCS" else xf.abs().amax()
        return (amax / F).clamp(min=1e-12)
    if rule.granularity == "PCS":
        s = torch.amax(torch.abs(x), dim=-1, keepdim=True) / (F * rule.backoff)
        s = torch.max(s, torch.tensor(torch.finfo(torch.bfloat16).tiny, device=x.device))
    else:
        s = torch.max(torch.abs(x.detach())) / (F * rule.backoff)
    return apply_rounding(s, rule.rounding, target)


def activation_scale(maxabs, rule: Rule, *, target: str = "cpu", fp8: str = "E4M3", hp_dtype: str = "bf16") -> torch.Tensor:
    """A per-tensor activation scale (0-d tensor in hp_dtype) from a measured maxabs (scalar or array)."""
    hp = HP_DTYPES[hp_dtype]
    if rule.value in ("FIXED_VALUE", "DUMMY_SCALES"):
        base = torch.tensor(1.0, dtype=hp)
        return apply_rounding(base, rule.rounding, target) if rule.value == "FIXED_VALUE" else base
    m = torch.as_tensor(maxabs, dtype=torch.float32).to(hp).max()
    raw = m / (full_scale(fp8, target) * rule.backoff)
    return floored(apply_rounding(raw, rule.rounding, target))


def weight_scale(w: torch.Tensor, rule: Rule, *, target: str = "cpu", fp8: str = "E4M3", hp_dtype: str = "bf16",
                 inc: bool = True) -> torch.Tensor:
    """A weight [out, in] scale: 0-d (PTS) or [out] (PCS), in hp_dtype.

    `inc` (every INC method): per-channel maxabs / (F * backoff) and its rounding are computed in the weight's own
    dtype, as INC's MaxAbsPcs does (only its MaxAbsPts casts to hp_dtype first), so an fp32 or fp16 model's
    per-channel scales equal INC's; hqtflow's own methods compute everything in hp_dtype."""
    hp = HP_DTYPES[hp_dtype]
    own = w.detach()
    w = own.to(hp)
    F = full_scale(fp8, target)
    dev = w.device
    if rule.value == "DUMMY_SCALES":
        return torch.ones(w.shape[0], dtype=hp, device=dev) if rule.granularity == "PCS" else torch.tensor(1.0, dtype=hp, device=dev)
    if rule.value == "FIXED_VALUE":
        return apply_rounding(torch.tensor(1.0, dtype=hp, device=dev), rule.rounding, target)
    if rule.granularity == "PCS":
        src = own if inc else w
        ref = floored(apply_rounding(src.abs().amax(dim=1) / (F * rule.backoff), rule.rounding, target).to(hp))
        if rule.value == "MSE":
            return _least_squares_per_channel(w, ref, rule.candidates, fp8, F)
        if rule.value != "OPT":
            return ref
        return floored(apply_rounding(_best_per_channel(w, ref, rule.candidates, fp8, F), rule.rounding, target))
    if rule.value == "OPT":
        return floored(apply_rounding(_best_single(w, rule.candidates, fp8, F), rule.rounding, target))
    raw = w.abs().max() / (F * rule.backoff)
    return floored(apply_rounding(raw, rule.rounding, target))


def _best_single(w: torch.Tensor, candidates, fp8: str, F: float) -> torch.Tensor:
    """The candidate scale with the least ||W - dq(q(W))||, computed as INC's `mmse_scale` does: in w's dtype
    (hp_dtype), so candidates within its resolution tie, and a tie goes to the later candidate."""
    best, best_err = None, float("inf")
    for s in candidates:
        y = (w / s).float().clamp(-F, F).to(FP8_DTYPES[fp8]).to(w.dtype) * s
        err = float(torch.norm(w - y))  # a w.dtype value, as INC compares them
        if err <= best_err:
            best, best_err = torch.tensor(s, dtype=w.dtype, device=w.device), err
    return best


def _best_per_channel(w: torch.Tensor, ref: torch.Tensor, multipliers, fp8: str, F: float) -> torch.Tensor:
    """Per output channel: ref * the multiplier with the least squared error (ties: the first, as INC)."""
    best_err = torch.full((w.shape[0],), float("inf"), dtype=w.dtype, device=w.device)
    best = torch.full((w.shape[0],), -1.0, dtype=w.dtype, device=w.device)
    for m in multipliers:
        s = ref * m
        y = dequantize(quantize(w, s[:, None], fp8, F), s[:, None], w.dtype)
        err = ((w - y) ** 2).sum(dim=1)
        better = err < best_err
        best = torch.where(better, torch.tensor(m, dtype=w.dtype, device=w.device), best)
        best_err = torch.where(better, err, best_err)
    return best * ref


def _least_squares_per_channel(w: torch.Tensor, ref: torch.Tensor, multipliers, fp8: str, F: float) -> torch.Tensor:
    """Per output channel: the scale ref * m (rounded to w's dtype, as stored) whose FP8 round trip of the channel
    has the least squared error, summed in float32 (ties: the largest m, so a channel no smaller scale improves keeps
    amax / F). Values above the smaller scale's range saturate; the error counts that."""
    wf = w.float()
    best = ref.clone()
    best_err = ((wf - dequantize(quantize(w, ref[:, None], fp8, F), ref[:, None], w.dtype).float()) ** 2).sum(dim=1)
    for m in sorted(multipliers, reverse=True):
        s = floored((ref.float() * m).to(w.dtype))
        err = ((wf - dequantize(quantize(w, s[:, None], fp8, F), s[:, None], w.dtype).float()) ** 2).sum(dim=1)
        better = err < best_err
        best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


@dataclass(frozen=True)
class LinearScales:
    """Scales of one Linear: input (0-d; None for dynamic activations), weight (0-d or [out]), output = input *
    weight."""

    input: torch.Tensor | None
    weight: torch.Tensor

    @property
    def output(self) -> torch.Tensor:
        return floored(self.input * self.weight)


def linear_scales(method: ScaleMethod, input_maxabs, weight: torch.Tensor, *, target: str = "cpu",
                  fp8: str = "E4M3", hp_dtype: str = "bf16", name: str = "a Linear",
                  store: torch.dtype | None = None) -> LinearScales:
    """The scales of one Linear, computed in hp_dtype and returned in `store`, the dtype they are stored in (None:
    the weight's, as a checkpoint stores them; INC scale files: hp_dtype), by `stored`. Refused (one sentence naming
    `name`): a weight holding NaN or infinity (a damaged model file: no scale fits it). `input_maxabs` None:
    no input scale (weight-only)."""
    from hqtflow.errors import ModelError

    if not bool(torch.isfinite(weight).all()):
        bad = int((~torch.isfinite(weight)).sum())
        raise ModelError(f"The weight of {name} holds {bad} NaN or infinite values; no FP8 scale fits it (is the "
                         "model file damaged?).")
    kw = dict(target=target, fp8=fp8, hp_dtype=hp_dtype)
    s_in = None if method.dynamic or input_maxabs is None else activation_scale(input_maxabs, method.activation, **kw)
    return stored(LinearScales(s_in, weight_scale(weight, method.weight, inc=method.inc_codes, **kw)),
                  store or weight.dtype, name, output=store is not None)


def stored(sc: LinearScales, dtype: torch.dtype, name: str = "a Linear", *, output: bool = False) -> LinearScales:
    """`sc` cast to `dtype`, where it is stored, each scale floored at dtype's smallest normal number there (a bf16
    scale of 2^-126 is 0 in float16). Refused, in one sentence naming `name`: a scale (input, weight, and with
    `output` the output scale input x weight, which INC scale files store and checkpoints do not) over dtype's
    largest value or over `MAX_SCALE`, what any reader takes; an input or output scale that large means corrupt
    statistics, a weight scale a weight no FP8 scale of this dtype fits."""
    from hqtflow.errors import ArtifactError, ModelError
    from hqtflow.formats.scale_files import MAX_SCALE

    top = min(MAX_SCALE, float(torch.finfo(dtype).max))
    limit = f"{top:.3g}, " + (f"the largest {str(dtype).removeprefix('torch.')} value" if top < MAX_SCALE
                              else "the most any reader takes")
    out = None if sc.input is None or not output else sc.input.double() * sc.weight.double()
    for what, s in (("weight", sc.weight), ("input", sc.input), ("output", out)):
        if s is not None and not bool((s.double() <= top).all()):  # NaN fails too
            v = float(s.double().max())
            if what == "weight":
                raise ModelError(f"The weight of {name} gives the scale {v:.3g}, over {limit}; no FP8 scale of it can "
                                 "be stored (is the model file damaged?).")
            raise ArtifactError(f"The measured input maxabs of {name} gives the {what} scale {v:.3g}, over {limit}; "
                                "the statistics are corrupt.")
    return LinearScales(None if sc.input is None else floored(sc.input.to(dtype)), floored(sc.weight.to(dtype)))
