"""SmoothQuant with HQT 1.17's semantics, folded into the model (hqtflow/quantize/smoothquant.py).

- the folding is exact: the smoothed bf16 model computes the same logits as the original;
- down_proj (one consumer, so HQT's per-Linear smoothing vector is hqtflow's): the FP8 weight bytes equal those of
  HQT's formulas written out (S = s * post on the input, W' = W / (1 / S) per output channel), the input scale is
  post and the weight scale HQT's divided by post;
- the CLI writes a standard checkpoint that hqtflow and transformers load; a per-tensor measurement is refused.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import numpy as np

import pytest
import torch

from conftest import need, run_cli
from hqtflow.scales import SMOOTHQUANT_METHODS

CFG = {"mode": "MEASURE", "observer": "maxabs_per_channel"}


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("sq")
    (d / "m.json").write_text(json.dumps(CFG))
    out = d / "meas"
    r = run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "4", "--max-length", "64", "-c", d / "m.json")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def stats(measured):
    from hqtflow.formats.measurement import load_measurement

    return load_measurement(measured).ranks[0]


def hqt_down_proj(method: str, a: np.ndarray, W: torch.Tensor):
    """HQT 1.17's linear_*smoothquant* scale functions for one Linear, transcribed (float32, F = 448)."""
    F, pow2 = 448.0, (lambda v: 2 ** torch.ceil(torch.log2(v)))
    a = torch.from_numpy(a).float().clamp(min=1e-5)
    w = W.float().abs().amax(0).clamp(min=1e-5)
    if method == "smoothquant_weights_output_channel_maxabs_pow2":
        s = pow2(a ** 0.5 / w ** 0.5)
        post = pow2((a / s).max() / (F * 0.25))
    elif method == "weaksmoothquant_weights_output_channel_maxabs_pow2":
        mid = w.max() / torch.sqrt(w.max() / w.min())
        s = pow2(1 / (w / mid) ** 0.5)
        post = pow2((a.max() / s).max() / (F * 0.25))
    else:
        s, post = pow2((a / (F * 0.25)) ** 0.5 / (w / (F * 0.5)) ** 0.5), torch.tensor(1.0)
    S = s * post
    Wt = W.float() / (1 / S)
    ws = pow2(Wt.abs().amax(1) / (F * 0.5))
    return S, post, ws, (Wt / ws[:, None]).clamp(-F, F).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("method", SMOOTHQUANT_METHODS)
def test_folding_exact_and_hqt_scales(method, tiny_llama, stats):
    from transformers import AutoModelForCausalLM

    from hqtflow.quantize.smoothquant import convert_smoothquant, smooth

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    smoothed = copy.deepcopy(model)
    with torch.inference_mode():
        ref = model(ids).logits
        posts = smooth(smoothed, names, stats, method, 448.0)
        assert {n for n in names if not n.endswith("o_proj")} == set(posts)  # every norm- or up-fed Linear
        torch.testing.assert_close(smoothed(ids).logits, ref, rtol=0, atol=1e-2)
    down = "model.layers.0.mlp.down_proj"
    W = model.get_submodule(down).weight.detach()
    S, post, ws, q = hqt_down_proj(method, np.asarray(stats.nodes[down].inputs[0]).reshape(-1), W)
    fp8 = copy.deepcopy(model)
    with torch.no_grad():
        convert_smoothquant(fp8, names, stats, method, target="cpu", fp8="E4M3", hp_dtype="bf16")
    lin = fp8.get_submodule(down)
    assert float(lin.input_scale) == float(post)
    if method != "smoothquant_opt":  # opt picks its own multiple per channel (HQT's mmse); the maxabs ones are exact
        assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(lin.weight_scale.float().flatten(), (ws / post).flatten())
    # the quantized model stays close to bf16
    with torch.inference_mode():
        err = (fp8(ids).logits.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) < 0.2


def test_cli_checkpoint(measured, tmp_path):
    import hqtflow

    out = tmp_path / "sq"
    r = run_cli("quantize", "-m", measured, "-o", out, "--scale-method", "smoothquant_weights_output_channel_maxabs_pow2")
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "tensor"
    model, _ = hqtflow.load(out, backend="qdq", dtype="bf16")
    norm = model.get_submodule("model.layers.0.input_layernorm").weight
    assert norm.dtype == torch.bfloat16 and not bool((norm == 1).all())  # the smoothing lives in the norm
    need(importlib.util.find_spec("compressed_tensors") is not None, "compressed-tensors is not installed")
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7]])
    with torch.inference_mode():
        assert float((theirs(ids).logits.float() - model(ids).logits.float()).abs().max()) < 0.05


def test_refusals(tiny_llama, wiki_text, measured, tmp_path):
    plain = tmp_path / "plain"
    assert run_cli("measure", tiny_llama, "-o", plain, "--text", wiki_text, "--limit", "2", "--max-length", "32").exit_code == 0
    r = run_cli("quantize", "-m", plain, "-o", tmp_path / "x", "--scale-method", "smoothquant_opt")
    assert r.exit_code == 3 and "maxabs_per_channel" in r.stderr
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "y", "--scale-method", "smoothquant_opt", "--scales-only")
    assert r.exit_code == 2 and "FP8 checkpoints only" in r.stderr
