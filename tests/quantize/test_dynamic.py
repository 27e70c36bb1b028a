"""Dynamic activations: Neural Compressor 3.10's two dynamic methods (scales equal to INC's own scale classes) and
hqtflow's per-token `fp8_dynamic`, in every runtime backend, in checkpoints (compressed-tensors `dynamic: true`,
`strategy: token`) and in serve.

INC refuses dynamic quantization on a CPU device (`Fp8cfg.parse`), so its modules cannot run here; its scale code
can: the factory and scale classes it builds for a dynamic Linear are called directly (with
CALC_SCALE_WITH_CGUID=false, INC's non-HPU arithmetic).
"""

from __future__ import annotations

import json
import types

import importlib.util

import pytest
import torch

from conftest import need, run_cli
from hqtflow.errors import ConfigError
from hqtflow.formats.quant_config import QuantConfig
from hqtflow.quantize.fp8_linear import FP8Linear, set_backend
from hqtflow.scales import INC_DYNAMIC_METHODS, dynamic_activation_scale, scale_method, weight_scale

INC_NAMES = {"maxabs_pcs_pow2": "MAXABS_PCS_POW2",
             "act_maxabs_pcs_pow2_weight_maxabs_pts_pow2_hw": "ACT_MAXABS_PCS_POW2_WEIGHT_MAXABS_PTS_POW2_HW"}


def activations() -> torch.Tensor:
    """[2, 6, 64] bf16 rows of very different magnitudes, one all-zero row (INC's per-token floor)."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 64) * torch.logspace(-4, 3, 12).reshape(2, 6, 1)
    x[1, 2] = 0
    return x.to(torch.bfloat16)


@pytest.fixture
def inc_factory(inc, monkeypatch):
    """INC's ScaleMethodFactory for a Linear under a named method (GAUDI3's scale set = hqtflow's "cpu" target)."""
    from neural_compressor.torch.algorithms.fp8_quant._core import common

    monkeypatch.setenv("CALC_SCALE_WITH_CGUID", "false")
    common.is_calc_scale_with_cguid.cache_clear()  # INC caches the variable on first read (lru_cache)
    from neural_compressor.torch.algorithms.fp8_quant._core.scale_methods.scale_method_config import (
        ScaleMethodString, scale_method_config_mapping)
    from neural_compressor.torch.algorithms.fp8_quant._core.scale_methods.scale_method_factory import (
        ScaleMethodFactory)

    from neural_compressor.torch.algorithms.fp8_quant._core.fp_utils import GAUDI3

    def make(name: str, mod: torch.nn.Module):
        mod.__hqt_config__ = types.SimpleNamespace(cfg={"device_for_scales": GAUDI3})
        cfg = scale_method_config_mapping[ScaleMethodString[INC_NAMES[name]]]
        return ScaleMethodFactory(cfg, {"hp_dtype": torch.bfloat16, "lp_dtype": torch.float8_e4m3fn}, mod, "linear")

    yield make
    common.is_calc_scale_with_cguid.cache_clear()


@pytest.mark.parametrize("name", INC_DYNAMIC_METHODS)
def test_inc_dynamic_scales_equal_inc(inc_factory, name):
    from neural_compressor.torch.algorithms.fp8_quant._core.common import QuantTensorType
    from neural_compressor.torch.algorithms.fp8_quant._core.scale_methods.scale_method_factory import QuantTensorName

    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 24).to(torch.bfloat16)
    lin.weight.data[3] = 0  # an all-zero output channel
    f = inc_factory(name, lin)
    method = scale_method(name, "cpu", dynamic=True)
    x = activations()
    theirs = f.get_scale_method(QuantTensorName.INPUT, is_dynamic=True).calc_scales(x, QuantTensorType.DYNAMIC)
    ours = dynamic_activation_scale(x, method.activation)
    assert ours.shape == theirs.shape == (2, 6, 1) and ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)
    w_theirs = f.get_scale_method(QuantTensorName.WEIGHT_OUT_CH).calc_scales(lin.weight.detach(), QuantTensorType.CONST)
    w_ours = weight_scale(lin.weight, method.weight)
    # a zero channel too: INC and hqtflow floor it at bf16's smallest normal
    assert torch.equal(w_ours, torch.as_tensor(w_theirs, dtype=torch.bfloat16).reshape(w_ours.shape))


def test_dynamic_methods_need_inc_switch():
    for name in INC_DYNAMIC_METHODS:
        with pytest.raises(ConfigError, match="only with dynamic_quantization: true"):
            QuantConfig.from_dict({"scale_method": name})
        with pytest.raises(ConfigError, match="only with dynamic_quantization"):
            scale_method(name)
        cfg = QuantConfig.from_dict({"scale_method": name, "dynamic_quantization": True})
        assert cfg.dynamic_quantization and cfg.to_dict()["dynamic_quantization"] is True
    # INC's switch on a static method: its activation rule at run time, backoff 0.5; HW rounding refused like INC
    m = scale_method("maxabs_pow2", dynamic=True)
    assert (m.activation.granularity, m.activation.backoff, m.activation.dynamic) == ("PTS", 0.5, "inc")
    with pytest.raises(ConfigError, match="cannot run with dynamic_quantization"):
        scale_method("maxabs_hw", dynamic=True)
    assert scale_method("fp8_dynamic").dynamic and scale_method("fp8_dynamic").weight.granularity == "PCS"


def reference(lin, method, x):
    """The dynamic QDQ written out: per-token scale, x and W quantized and dequantized, matmul in bf16."""
    s = dynamic_activation_scale(x, method.activation).float()
    xq = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(s).to(torch.bfloat16)
    sw = weight_scale(lin.weight, method.weight).float().reshape(-1, 1)
    wq = (lin.weight.float() / sw).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(sw).to(torch.bfloat16)
    return torch.matmul(xq, wq.t()) + lin.bias


@pytest.mark.parametrize("name", [*INC_DYNAMIC_METHODS, "fp8_dynamic"])
def test_fp8linear_dynamic_backends(name, cpu_kernel_loaded):
    torch.manual_seed(2)
    lin = torch.nn.Linear(64, 48).to(torch.bfloat16)
    method = scale_method(name, dynamic=name in INC_DYNAMIC_METHODS)
    m = FP8Linear.from_linear(lin, weight_scale(lin.weight, method.weight), None, dynamic=method.activation)
    assert m.activation == "dynamic_token" and m.input_scale is None
    x = activations()
    with torch.no_grad():
        ref = m(x)
        assert torch.equal(ref, reference(lin, method, x))
        for backend in ("cpu", "scaled_mm"):
            assert m.supports(backend)
            m.backend = backend
            y = m(x)
            # fp32 sums in another order (and, for fp32 scales, no bf16 rounding of the dequantized input)
            err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
            assert y.shape == ref.shape and err < 1e-2, (backend, err)
        m.backend = "qdq"


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("dyn") / "meas"
    assert run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "4", "--max-length", "64").exit_code == 0
    return out


@pytest.mark.parametrize("name", ["fp8_dynamic", "fp8_dynamic_mse", "maxabs_pcs_pow2"])
def test_dynamic_checkpoint(measured, tmp_path, name):
    """The checkpoint is compressed-tensors `dynamic: true, strategy: token`, loads into dynamic FP8Linears with the
    method's rule, runs as the in-memory model does, and transformers + compressed-tensors load it."""
    import hqtflow
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

    out = tmp_path / "fp8"
    r = run_cli("quantize", "-m", measured, "-o", out, "--scale-method", name)
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    act = qc["config_groups"]["group_0"]["input_activations"]
    assert act["dynamic"] is True and act["strategy"] == "token"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    ours = name.startswith("fp8_dynamic")  # compressed-tensors' own per-token rule (no INC key)
    assert ("hqtflow_dynamic_activations" in qc) == (not ours)
    assert json.loads((out / "hqtflow_manifest.json").read_text())["data"]["mode"] == "w8a8-dynamic"
    r = run_cli("inspect", out)  # no static input scales: inspect still reports the weights
    assert r.exit_code == 0, r.output
    saved, tok = hqtflow.load(out, backend="qdq", dtype="bf16")  # the bf16 model it came from
    layers = [m for m in saved.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.activation == "dynamic_token" and m.input_scale is None for m in layers)
    assert all((m.dynamic_rule is not None) == (not ours) for m in layers)
    live, _ = quantize_in_memory(QuantizeSettings(measurement=str(measured), output="-", scale_method=name))
    ids = torch.tensor([tok.encode("The tower is 324 metres tall, about the same height as")])
    with torch.inference_mode():
        ref = saved(ids).logits
        assert torch.equal(live(ids).logits, ref)
        assert set_backend(saved, "cpu") == len(layers)
        assert torch.allclose(saved(ids).logits.float(), ref.float(), atol=0.05, rtol=0.05)
    if ours:  # the standard loader runs the same per-token function
        need(importlib.util.find_spec("compressed_tensors") is not None, "compressed-tensors is not installed")
        from transformers import AutoModelForCausalLM

        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        with torch.inference_mode():
            diff = (theirs(ids).logits.float() - ref.float()).abs().max()
        assert float(diff) < 0.05


def test_dynamic_refusals(measured, tmp_path):
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "s", "--scale-method", "maxabs_pcs_pow2", "--scales-only")
    assert r.exit_code != 0 and "--scales-only does not apply" in r.output
    cfg = tmp_path / "q.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "maxabs_pcs_pow2"}))
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "c", "-c", cfg)
    assert r.exit_code != 0 and "dynamic_quantization: true" in r.output


def test_serve_dynamic_checkpoint(measured, tmp_path):
    from hqtflow.evaluate import load_any
    from hqtflow.runtime.engine import Engine, SamplingParams

    out = tmp_path / "fp8"
    assert run_cli("quantize", "-m", measured, "-o", out, "--scale-method", "maxabs_pcs_pow2").exit_code == 0
    model, tok, kind = load_any(str(out))
    assert kind == "fp8" and any(getattr(m, "dynamic_rule", None) is not None for m in model.modules())
    eng = Engine(model, tok).start()
    try:
        events = eng.generate(tok("The tower is")["input_ids"], SamplingParams(max_new_tokens=4))
    finally:
        eng.stop()
    assert 1 <= len(events) <= 4 and events[-1].finish_reason in ("length", "eos_token")
