"""Issue acceptance: hqtflow matches Neural Compressor's own CPU QDQ path (`use_qdq=True`) on the tiny Llama.

One hqtflow measurement feeds both sides. INC `convert()`s a bf16 copy of the model from it (QUANTIZE mode); hqtflow
computes its scales with `hqtflow.scales` (target "cpu", hp_dtype bf16) and builds `FP8Linear.from_linear` modules.

- power-of-two methods (maxabs_pow2, act_maxabs_pow2_weights_pcs_maxabs_pow2, unit_scale): every Linear's input and
  weight scale (per channel: elementwise) equals INC's exactly, value and dtype; each FP8Linear's output equals
  INC's PatchedLinear output bit for bit, and so do the whole model's logits.
- maxabs_arbitrary: the scales INC computes equal hqtflow's exactly (the statistics of a bf16 model are bf16
  values, so INC's cast of them to bf16 loses nothing: tolerance 0). INC picks the weight's FP8 codes with
  1 / bf16(1 / s) (`invert_scale`); so does hqtflow (`inc_code_scale`): the FP8 weight bytes are equal. INC's
  input QuantDequant also quantizes with that inverted scale, where hqtflow's runtime divides by s (the
  compressed-tensors arithmetic), so outputs agree only closely; `_INCRoundTrip` below changes only that and is
  bit-exact.
- INC loads the scale files `hqtflow quantize --scales-only` writes, and uses them instead of recomputing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from hqtflow.formats import measurement as mf
from hqtflow.measure.run import MeasureSettings, measure
from hqtflow.quantize.fp8_linear import FP8Linear
from hqtflow.scales import dequantize, inc_code_scale, linear_scales, quantize, scale_method

POW2_METHODS = ["maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2", "unit_scale"]
# several shapes: square, GQA (out < in), up (out > in), down (in > out), and the wide lm_head
PROBED = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.mlp.gate_proj",
          "model.layers.1.mlp.down_proj", "lm_head"]


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory) -> Path:
    s = MeasureSettings(output=str(tmp_path_factory.mktemp("eq") / "meas"), model=str(tiny_llama),
                        text=(str(wiki_text),), limit=4, max_length=64, batch_size=2)
    return measure(s, show_progress=False)


@pytest.fixture(scope="module")
def stats(measured) -> dict:
    return mf.read_measurement(measured / "measure_hooks_maxabs.json").nodes


def load_bf16(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def converted(inc, tiny_llama, measured, tmp_path_factory):
    """method -> (INC's converted model, its work directory); each INC run works on its own copy of the artifact
    (INC writes its scale file next to the measurement)."""
    cache: dict = {}

    def get(method: str):
        if method not in cache:
            work = tmp_path_factory.mktemp(method) / "artifact"
            shutil.copytree(measured, work)
            cfg = inc.FP8Config(mode="QUANTIZE", observer="maxabs", scale_method=method, use_qdq=True,
                                dump_stats_path=str(work / "measure"))
            cache[method] = (inc.convert(load_bf16(tiny_llama), cfg), work)
        return cache[method]

    return get


def hq_scales(method: str, stats: dict, model) -> dict:
    m = scale_method(method, "cpu")
    return {name: linear_scales(m, node.inputs[0], model.get_submodule(name).weight, target="cpu", hp_dtype="bf16")
            for name, node in stats.items()}


def probe_inputs(in_features: int, maxabs: float) -> list[torch.Tensor]:
    """Random bf16 activations of the measured range, plus outliers past the FP8 range (saturation)."""
    g = torch.Generator().manual_seed(in_features)
    x3 = torch.randn(2, 9, in_features, generator=g) * (maxabs / 2)
    x3[0, 0, :4] = torch.tensor([8.0, -8.0, 3.0, -0.001]) * maxabs
    x2 = torch.randn(5, in_features, generator=g) * maxabs
    return [x3.to(torch.bfloat16), x2.to(torch.bfloat16), torch.zeros(1, 1, in_features, dtype=torch.bfloat16)]


def inc_patched(qmodel) -> dict:
    return {n: m for n, m in qmodel.named_modules() if type(m).__name__ == "PatchedLinear"}


# ---- (a) scales --------------------------------------------------------------------------------
@pytest.mark.parametrize("method", POW2_METHODS)
def test_pow2_scales_equal_inc(method, converted, stats, tiny_llama):
    qmodel, work = converted(method)
    patched = inc_patched(qmodel)
    assert set(patched) == set(stats)  # every Linear, lm_head included
    ours = hq_scales(method, stats, load_bf16(tiny_llama))
    scale_json = work / f"measure_hooks_maxabs_{method.upper()}.json"
    # unit_scale uses no statistics: INC neither reads the measurement nor writes a scale file for it
    written = json.loads(scale_json.read_text())["Nodes"] if method != "unit_scale" else None
    assert (written is None) == (not scale_json.exists())
    for name, mod in patched.items():
        sc, theirs = ours[name], mod._mod_extra_config.scale  # INC's ModuleConfig of scales (hp_dtype tensors)
        inc_in, inc_w = theirs.inputs[0], theirs.params["weight"]
        if isinstance(inc_w, dict):  # PCS: {0: per output channel, 1: ones per input channel}
            assert torch.equal(inc_w[1], torch.ones(mod.in_features, dtype=torch.bfloat16)), name
            inc_w = inc_w[0]
        for what, a, b in (("input", sc.input, inc_in), ("weight", sc.weight, inc_w), ("output", sc.output, theirs.outputs[0])):
            assert a.dtype == b.dtype == torch.bfloat16 and a.shape == b.shape, (name, what, a, b)
            assert torch.equal(a, b), (name, what, a, b)
        # the scales the QDQ modules really apply (Python floats in INC's default scalar format, tensors for PCS)
        assert float(mod.quant_input.scale) == float(sc.input), name
        assert torch.equal(torch.as_tensor(mod.dequant_weights.scale, dtype=torch.bfloat16).reshape(sc.weight.shape),
                           sc.weight), name
        if written is not None:
            node = written[name]
            assert node["inputs"] == [float(sc.input)], name
            w = node["params"]["weight"]
            assert (w["0"] if isinstance(w, dict) else w) == sc.weight.float().tolist(), name


# ---- (b) outputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", POW2_METHODS)
def test_pow2_fp8_linear_bit_exact_with_inc(method, converted, stats, tiny_llama):
    qmodel, _ = converted(method)
    ref = load_bf16(tiny_llama)
    ours = hq_scales(method, stats, ref)
    patched = inc_patched(qmodel)
    with torch.inference_mode():
        for name in PROBED:
            lin, sc = ref.get_submodule(name), ours[name]
            mine = FP8Linear.from_linear(lin, sc.weight, sc.input)
            # the same FP8 weight bytes (INC stores it transposed, [in, out])
            assert torch.equal(mine.weight.view(torch.uint8), patched[name].weight.t().view(torch.uint8)), name
            for x in probe_inputs(lin.in_features, float(stats[name].inputs[0].max())):
                a, b = mine(x), patched[name](x)
                assert a.dtype == b.dtype == torch.bfloat16
                assert torch.equal(a, b), (name, tuple(x.shape), (a.float() - b.float()).abs().max().item())

        # the whole model: every Linear swapped for hqtflow's FP8Linear gives INC's logits bit for bit
        for name, sc in ours.items():
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child,
                    FP8Linear.from_linear(ref.get_submodule(name), sc.weight, sc.input))
        ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        assert torch.equal(ref(input_ids=ids).logits, qmodel(input_ids=ids).logits)


# ---- (c) maxabs_arbitrary ----------------------------------------------------------------------
# The scales INC's QDQ modules quantize with, in its default scalar scale format. INC derives 1 / s in bf16
# (`invert_scale` of the bf16 scale) and inverts it back: the input's QuantDequant inverts the bf16 tensor (a bf16
# reciprocal), the weight's QuantInput inverts the Python float it already stored (double precision; the CPU kernel
# makes a float32 tensor of it: `hqtflow.scales.inc_code_scale`). Either is within 2^-8 of s (relative); for a power
# of two both are s.
def _inc_input_scale(s: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(torch.reciprocal(s))


class _INCRoundTrip(FP8Linear):
    """Prototype only: FP8Linear whose input is quantized and dequantized with `_inc_input_scale`, as INC's is."""

    @classmethod
    def from_linear(cls, linear, weight_scale, input_scale, fp8="E4M3"):
        return super().from_linear(linear, weight_scale, _inc_input_scale(input_scale.to(linear.weight.dtype)), fp8,
                                   inc_codes=True)

    def forward(self, x):
        """INC's arithmetic and memory layout: its weight is stored [in, out] contiguous, and the GEMM's summation
        order depends on the layout on some CPUs (AVX2), so a transposed view would not be bit-identical."""
        xq = dequantize(quantize(x, self.input_scale, self.fp8), self.input_scale, self.hp_dtype)
        y = torch.matmul(xq, self.dequantized_weight().t().contiguous())
        return y + self.bias if self.bias is not None else y


def test_maxabs_arbitrary_close_to_inc(converted, stats, tiny_llama):
    qmodel, work = converted("maxabs_arbitrary")
    ref = load_bf16(tiny_llama)
    ours = hq_scales("maxabs_arbitrary", stats, ref)
    patched = inc_patched(qmodel)
    written = json.loads((work / "measure_hooks_maxabs_MAXABS_ARBITRARY.json").read_text())["Nodes"]
    worst = 0.0
    for name, mod in patched.items():
        sc, theirs = ours[name], mod._mod_extra_config.scale
        # the scales INC computes: identical (statistics of a bf16 model are bf16 values; tolerance 0)
        assert torch.equal(theirs.inputs[0], sc.input) and torch.equal(theirs.params["weight"], sc.weight), name
        assert written[name]["inputs"] == [float(sc.input)] and written[name]["params"]["weight"] == float(sc.weight)
        # the scales INC's QDQ modules quantize with: s inverted twice, within 2^-8 of s
        w_quant = mod._mod_extra_config.params["weight"][0].scale
        assert mod.quant_input.scale == float(_inc_input_scale(sc.input)), name
        assert np.float32(w_quant) == float(inc_code_scale(sc.weight)), name
        for applied, s in ((mod.quant_input.scale, sc.input), (w_quant, sc.weight)):
            worst = max(worst, abs(float(applied) / float(s) - 1))
        assert float(mod.dequant_weights.scale) == float(sc.weight), name  # dequantization uses s itself
    assert 0 < worst <= 2.0**-8, worst

    with torch.inference_mode():
        for name in PROBED:
            lin, sc = ref.get_submodule(name), ours[name]
            mine = FP8Linear.from_linear(lin, sc.weight, sc.input, inc_codes=scale_method("maxabs_arbitrary").inc_codes)
            proto = _INCRoundTrip.from_linear(lin, sc.weight, sc.input)
            # INC's FP8 weight bytes (stored transposed, [in, out]); without INC's codes some differ
            assert torch.equal(mine.weight.view(torch.uint8), patched[name].weight.t().view(torch.uint8)), name
            for x in probe_inputs(lin.in_features, float(stats[name].inputs[0].max())):
                a, b, exact = mine(x), patched[name](x), lin(x)
                assert torch.equal(proto(x), b), name  # the double inversion is the only difference
                if not exact.any():
                    continue
                diff, err = (a - b).float().norm() / exact.float().norm(), (b - exact).float().norm() / exact.float().norm()
                assert diff < 0.03, (name, diff.item())  # measured <= 0.016: under INC's own FP8 error
                assert diff < err, (name, diff.item(), err.item())


# ---- (d) INC loads hqtflow's scale files -------------------------------------------------------
def _scales_only(measured: Path, out: Path, method: str) -> Path:
    r = run_cli("quantize", "-m", measured, "--scales-only", "-o", out, "--scale-method", method)
    assert r.exit_code == 0, r.output
    return out


def _load_npz(path: Path) -> dict:
    return np.load(path, allow_pickle=True)["arr_0"].item()  # files written by these tests


def test_inc_uses_hqtflow_scale_file(inc, measured, stats, tiny_llama, converted, tmp_path):
    out = _scales_only(measured, tmp_path / "scales", "maxabs_pow2")
    stem = "measure_hooks_maxabs_MAXABS_POW2"
    work = tmp_path / "work"
    shutil.copytree(out, work)

    # the same layout INC writes for this config (its own run on the same measurement, lm_head aside)
    _, inc_work = converted("maxabs_pow2")
    theirs_json, ours_json = (json.loads((d / f"{stem}.json").read_text()) for d in (inc_work, work))
    assert {k: v for k, v in ours_json.items() if k != "Nodes"} == {k: v for k, v in theirs_json.items() if k != "Nodes"}
    assert set(ours_json["Nodes"]) == set(theirs_json["Nodes"]) - {"lm_head"}  # hqtflow's default blocklists lm_head
    assert all(ours_json["Nodes"][k] == theirs_json["Nodes"][k] for k in ours_json["Nodes"])
    theirs_npz, ours_npz = _load_npz(inc_work / f"{stem}.npz"), _load_npz(work / f"{stem}.npz")
    for name, node in ours_npz["Nodes"].items():
        other = theirs_npz["Nodes"][name]
        assert set(node) == set(other) and set(node["params"]) == set(other["params"]), name
        for a, b in ((node["inputs"][0], other["inputs"][0]), (node["outputs"][0], other["outputs"][0]),
                     (node["params"]["weight"], other["params"]["weight"])):
            assert isinstance(a, np.ndarray) and a.dtype == b.dtype == np.float32 and a.shape == b.shape == ()
            assert a == b, name

    # change two scales in both copies (INC reads the .npz; keep the JSON twin consistent)
    q_name, d_name = "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"
    new_in = float(ours_json["Nodes"][q_name]["inputs"][0]) * 4
    new_w = float(ours_json["Nodes"][d_name]["params"]["weight"]) / 8
    ours_json["Nodes"][q_name]["inputs"] = [new_in]
    ours_json["Nodes"][d_name]["params"]["weight"] = new_w
    (work / f"{stem}.json").write_text(json.dumps(ours_json, indent=4))
    ours_npz["Nodes"][q_name]["inputs"] = [np.asarray(new_in, dtype=np.float32)]
    ours_npz["Nodes"][d_name]["params"]["weight"] = np.asarray(new_w, dtype=np.float32)
    np.savez(work / f"{stem}.npz", ours_npz)
    before = (work / f"{stem}.npz").read_bytes()

    cfg = json.loads((work / "quant_config.json").read_text())  # the QUANT_CONFIG hqtflow wrote beside the scales
    assert cfg["mode"] == "QUANTIZE" and cfg["scale_method"] == "maxabs_pow2"
    cfg.update(use_qdq=True, dump_stats_path=str(work / "measure"))  # CPU: QDQ; the copy, not OUT
    qmodel = inc.convert(load_bf16(tiny_llama), inc.FP8Config(**cfg))
    patched = inc_patched(qmodel)
    assert set(patched) == set(ours_json["Nodes"])
    assert float(patched[q_name].quant_input.scale) == new_in  # INC took our (edited) values...
    assert float(patched[d_name].dequant_weights.scale) == new_w
    # ...and our scales for every other module; it computed none, so it did not rewrite the file
    ours = hq_scales("maxabs_pow2", stats, load_bf16(tiny_llama))
    for name, mod in patched.items():
        if name != q_name:
            assert float(mod.quant_input.scale) == float(ours[name].input), name
        if name != d_name:
            assert float(mod.dequant_weights.scale) == float(ours[name].weight), name
    assert (work / f"{stem}.npz").read_bytes() == before


def test_inc_loads_hqtflow_per_channel_scale_file(inc, measured, stats, tiny_llama, tmp_path):
    method, stem = "act_maxabs_pow2_weights_pcs_maxabs_pow2", "measure_hooks_maxabs_ACT_MAXABS_POW2_WEIGHTS_PCS_MAXABS_POW2"
    out = _scales_only(measured, tmp_path / "scales", method)
    nodes = _load_npz(out / f"{stem}.npz")["Nodes"]
    keys = {type(k).__name__ for n in nodes.values() for k in n["params"]["weight"]}
    # INC's own file (np.savez of its ModuleConfig dict) keys the per-channel weight scale {0: out, 1: in} with
    # ints, and its loader indexes params["weight"][0]: string keys make convert() fail with KeyError: 0
    assert keys == {"int"}, f"per-channel weight scale keys in {stem}.npz are {keys}, INC needs int 0 / 1"
    work = tmp_path / "work"
    shutil.copytree(out, work)
    cfg = json.loads((work / "quant_config.json").read_text())
    cfg.update(use_qdq=True, dump_stats_path=str(work / "measure"))
    patched = inc_patched(inc.convert(load_bf16(tiny_llama), inc.FP8Config(**cfg)))
    ours = hq_scales(method, stats, load_bf16(tiny_llama))
    assert patched and set(patched) <= set(ours)
    for name, mod in patched.items():
        assert torch.equal(mod.dequant_weights.scale.detach(), ours[name].weight), name


def test_quantize_stores_inc_weight_codes(converted, measured, stats):
    """`quantize` (maxabs_arbitrary) stores the FP8 weight bytes and weight scales INC's convert() puts in its model,
    for every Linear hqtflow quantizes (lm_head is blocklisted by default)."""
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

    patched = inc_patched(converted("maxabs_arbitrary")[0])
    ours, _ = quantize_in_memory(QuantizeSettings(measurement=str(measured), output="-", scale_method="maxabs_arbitrary"))
    mods = {n: m for n, m in ours.named_modules() if isinstance(m, FP8Linear)}
    assert set(mods) == set(stats) - {"lm_head"}
    for name, mod in mods.items():
        assert torch.equal(mod.weight.view(torch.uint8), patched[name].weight.t().view(torch.uint8)), name
        assert float(mod.weight_scale) == float(patched[name].dequant_weights.scale), name


def test_inc_loads_scale_files_of_a_per_channel_measurement(inc, tiny_llama, wiki_text, tmp_path):
    """A `maxabs_per_channel` measurement's files are `measure_hooks_maxabs_per_channel*`; the scales artifact's
    QUANT_CONFIG must name that observer, or INC looks for `measure_hooks_maxabs.npz` (FileNotFoundError)."""
    root = Path(__file__).resolve().parents[1]
    s = MeasureSettings(output=str(tmp_path / "meas"), model=str(tiny_llama), text=(str(wiki_text),), limit=2,
                        max_length=32, batch_size=2, config=str(root / "quantization_config/maxabs_per_channel_measure.json"))
    out = _scales_only(measure(s, show_progress=False), tmp_path / "scales", "maxabs_pow2")
    stem = "measure_hooks_maxabs_per_channel_MAXABS_POW2"
    assert (out / f"{stem}.npz").is_file()
    work = tmp_path / "work"
    shutil.copytree(out, work)
    cfg = json.loads((work / "quant_config.json").read_text())
    assert cfg["observer"] == "maxabs_per_channel"
    cfg.update(dump_stats_path=str(work / "measure"))  # the copy; use_qdq is already set for a cpu target
    patched = inc_patched(inc.convert(load_bf16(tiny_llama), inc.FP8Config(**cfg)))
    ours = _load_npz(work / f"{stem}.npz")["Nodes"]
    assert set(patched) == set(ours)
    for name, mod in patched.items():
        assert float(mod.quant_input.scale) == float(ours[name]["inputs"][0]), name
        assert float(mod.dequant_weights.scale) == float(ours[name]["params"]["weight"]), name


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_per_channel_weight_scales_of_a_non_hp_dtype_model_equal_inc(inc, tiny_llama, measured, model_dtype, tmp_path):
    """INC's MaxAbsPcs computes a weight's per-channel maxabs / (F * backoff) and its rounding in the weight's own
    dtype (only MaxAbsPts casts to hp_dtype first): for an fp32 or fp16 model with hp_dtype bf16, hqtflow's
    per-channel weight scales equal INC's value for value."""
    from transformers import AutoModelForCausalLM

    method = "act_maxabs_pow2_weights_pcs_maxabs_pow2"
    work = tmp_path / "artifact"
    shutil.copytree(measured, work)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=model_dtype).eval()
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    cfg = inc.FP8Config(mode="QUANTIZE", observer="maxabs", scale_method=method, use_qdq=True, hp_dtype="bf16",
                        dump_stats_path=str(work / "measure"))
    patched = inc_patched(inc.convert(model, cfg))
    rule = scale_method(method, "cpu").weight
    from hqtflow.scales import weight_scale

    compared = 0
    for name, mod in patched.items():
        theirs = mod._mod_extra_config.scale.params["weight"][0]
        ours = weight_scale(weights[name], rule, target="cpu", hp_dtype="bf16")
        assert ours.shape == theirs.shape, name
        assert torch.equal(ours.float(), theirs.float()), (name, int((ours.float() != theirs.float()).sum()))
        compared += theirs.numel()
    assert compared > 1000


@pytest.mark.parametrize("method", ["maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2"])
def test_e5m2_scales_equal_inc(inc, tiny_llama, measured, stats, method, tmp_path):
    """fp8_config E5M2: a full scale of 57344 puts most scales below 2^-14 (the tiny model's weights near 2^-18);
    every input and weight scale equals INC's, none raised to a floor above bf16's smallest normal."""
    work = tmp_path / "artifact"
    shutil.copytree(measured, work)
    cfg = inc.FP8Config(mode="QUANTIZE", observer="maxabs", scale_method=method, use_qdq=True, fp8_config="E5M2",
                        dump_stats_path=str(work / "measure"))
    patched = inc_patched(inc.convert(load_bf16(tiny_llama), cfg))
    m = scale_method(method, "cpu")
    model = load_bf16(tiny_llama)
    below = 0
    for name, mod in patched.items():
        sc = linear_scales(m, stats[name].inputs[0], model.get_submodule(name).weight, target="cpu", fp8="E5M2",
                           hp_dtype="bf16")
        theirs = mod._mod_extra_config.scale
        inc_w = theirs.params["weight"]
        inc_w = inc_w[0] if isinstance(inc_w, dict) else inc_w
        assert torch.equal(sc.input, theirs.inputs[0]) and torch.equal(sc.weight, inc_w), name
        below += int((sc.weight.float() < 2.0**-14).sum())
    assert below > 0


# ---- (e) the opt-weight search -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["maxabs_pow2_opt_weight", "act_maxabs_pow2_weights_pcs_opt_pow2"])
def test_opt_weight_scales_equal_inc_mmse(inc, tiny_llama, method, monkeypatch):
    """INC's own mmse_scale / mmse_scale_multi (which convert() runs only on Gaudi) on every weight of the tiny Llama,
    its HPU calls shimmed: the weight's `.to("hpu")` is the weight, HPU's saturating FP8 cast is the CPU cast after a
    clamp. hqtflow's opt-weight scales equal INC's choice (its error computed in bf16, ties to the later candidate)."""
    from neural_compressor.torch.algorithms.fp8_quant._core import fp_utils

    from hqtflow.scales import weight_scale

    class OnHpu(torch.Tensor):
        def to(self, *args, **kwargs):
            return self.as_subclass(torch.Tensor) if args[:1] == ("hpu",) else super().to(*args, **kwargs)

    monkeypatch.setattr(fp_utils, "cast_to_fp8_fcn", lambda x, dtype, scale_inv=None: x.float().clamp(-448, 448).to(dtype))
    monkeypatch.setattr(fp_utils, "cur_accelerator", type("Sync", (), {"synchronize": lambda self: None})())
    rule = scale_method(method, "cpu").weight
    pow2 = lambda s: torch.exp2(torch.ceil(torch.log2(s)))  # noqa: E731 - INC's POW2 rounding of the choice
    model = load_bf16(tiny_llama)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for name in names:
        w = model.get_submodule(name).weight.detach()
        ours = weight_scale(w, rule, target="cpu", hp_dtype="bf16")
        if rule.granularity == "PCS":
            ref = weight_scale(w, scale_method("act_maxabs_pow2_weights_pcs_maxabs_pow2").weight)
            theirs = fp_utils.mmse_scale_multi(w.t().as_subclass(OnHpu), ref, list(rule.candidates),
                                               torch.float8_e4m3fn, torch.bfloat16)
        else:
            theirs = fp_utils.mmse_scale(w.as_subclass(OnHpu), list(rule.candidates), torch.float8_e4m3fn, torch.bfloat16)
        assert torch.equal(ours.float(), pow2(torch.as_tensor(theirs).float()).reshape(ours.shape)), name
    assert len(names) == 14
