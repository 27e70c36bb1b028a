"""FP8 checkpoints written by other tools, built here by hand for the tiny Llama (safetensors + config.json), read
by hqtflow's loader: compressed-tensors (static / dynamic per-token / dynamic per-group activations; per-tensor,
per-channel, block-wise weights) and AutoFP8/vLLM `quant_method: fp8` (scalar float32 scales, static or dynamic
activations, `weight_block_size` with `weight_scale_inv`). Compared with the bf16 model (SQNR) and, where
transformers + compressed-tensors load the same files, with their logits."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import need, sqnr
from hqtflow.formats.checkpoint import load_checkpoint
from hqtflow.quantize.fp8_linear import FP8Linear

F = 448.0
PROMPT = "The tower is 324 metres tall, about the same height as an 81-storey building."
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}


@pytest.fixture(scope="module")
def base(tiny_llama):
    """bf16 model, its tensors, input maxabs of every Linear on the prompt, token ids, logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = torch.tensor([tok.encode(PROMPT)])
    amax, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: amax.__setitem__(n, max(amax.get(n, 0.0), float(a[0].abs().max())))))
    with torch.inference_mode():
        logits = model(ids).logits
    for h in hooks:
        h.remove()
    with safe_open(tiny_llama / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return {"dir": tiny_llama, "tensors": tensors, "amax": amax, "ids": ids, "logits": logits}


def q8(w, s):
    return (w.float() / s.float()).clamp(-F, F).to(torch.float8_e4m3fn)


def build(base, out, qcfg, *, weights="tensor", static=False, block=(32, 32), scale_dtype=torch.bfloat16,
          scalar=False, scale_name="weight_scale", extra=None, pow2=False):
    """Write a hand-made FP8 checkpoint of the tiny model into `out`."""
    out.mkdir()
    t = dict(base["tensors"])
    for name in base["amax"]:
        w = t[f"{name}.weight"].float()
        if weights == "tensor":
            s = (w.abs().max() / F).reshape(() if scalar else (1,))
            s = torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s
            q = q8(w, s)
        elif weights == "channel":
            s = w.abs().amax(1, keepdim=True) / F
            q = q8(w, s)
        else:
            b0, b1 = block
            blocks = w.reshape(w.shape[0] // b0, b0, w.shape[1] // b1, b1)
            s = blocks.abs().amax((1, 3)) / F
            q = q8(blocks, s[:, None, :, None]).reshape(w.shape)
        t[f"{name}.weight"], t[f"{name}.{scale_name}"] = q, s.to(scale_dtype)
        if static:
            si = torch.tensor(base["amax"][name] / F)
            si = torch.exp2(torch.ceil(torch.log2(si))) if pow2 else si
            t[f"{name}.input_scale"] = si.to(scale_dtype).reshape(() if scalar else (1,))
    t.update(extra or {})
    save_file({k: v.contiguous() for k, v in t.items()}, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((base["dir"] / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    for p in base["dir"].iterdir():
        if p.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(p, out / p.name)
    return out


def ct_config(weights, activations):
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


TENSOR_WO = ct_config({**FP8, "strategy": "tensor", "dynamic": False}, None)


def ours_logits(path, base):
    model = load_checkpoint(path)
    with torch.inference_mode():
        return model, model(base["ids"]).logits


def theirs_logits(path, base):
    import importlib.util

    from conftest import need

    need(importlib.util.find_spec("compressed_tensors") is not None, "compressed-tensors is not installed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.inference_mode():
        return model(base["ids"]).logits


CT_CASES = {
    "static_tensor": (dict(weights="tensor", static=True, pow2=True),
                      {**FP8, "strategy": "tensor", "dynamic": False}, {**FP8, "strategy": "tensor", "dynamic": False}),
    "dynamic_token_channel": (dict(weights="channel"),
                              {**FP8, "strategy": "channel", "dynamic": False}, {**FP8, "strategy": "token", "dynamic": True}),
    "dynamic_token_tensor": (dict(weights="tensor"),
                             {**FP8, "strategy": "tensor", "dynamic": False}, {**FP8, "strategy": "token", "dynamic": True}),
    "block_group": (dict(weights="block"),
                    {**FP8, "strategy": "block", "block_structure": [32, 32], "dynamic": False},
                    {**FP8, "strategy": "group", "group_size": 32, "dynamic": True}),
}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_foreign(case, base, tmp_path):
    kw, w, a = CT_CASES[case]
    path = build(base, tmp_path / case, ct_config(w, a), **kw)
    model, logits = ours_logits(path, base)
    q = model.model.layers[0].mlp.down_proj
    assert isinstance(q, FP8Linear)
    expected = {"static_tensor": "static", "block_group": "dynamic_group"}.get(case, "dynamic_token")
    assert q.activation == expected
    if case == "block_group":
        assert q.block_size == (32, 32) and q.weight_scale.shape == (2, 4)
    assert sqnr(base["logits"], logits) > 15
    try:
        theirs = theirs_logits(path, base)
    except (NotImplementedError, ValueError, RuntimeError, TypeError) as e:  # a scheme their CPU path lacks
        need(False, f"transformers + compressed-tensors cannot run {case} here ({type(e).__name__}: {e})")
    if case == "static_tensor":  # power-of-two scales: the same arithmetic, bit for bit
        assert torch.equal(theirs, logits)
    else:  # dynamic: their scales are computed in bf16, ours in float32 (like vLLM)
        assert sqnr(theirs, logits) > 25, (case, sqnr(theirs, logits))
    print(case, "sqnr vs bf16", sqnr(base["logits"], logits), "vs compressed-tensors", sqnr(theirs, logits))


def test_dynamic_token_scales_are_per_row():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    m = FP8Linear.from_linear(lin, torch.tensor(0.01), None)
    m.activation = "dynamic_token"
    x = torch.randn(3, 16, dtype=torch.bfloat16) * torch.tensor([[1.0], [100.0], [0.01]], dtype=torch.bfloat16)
    s = x.float().abs().amax(-1, keepdim=True) / F
    xq = ((x.float() / s).clamp(-F, F).to(torch.float8_e4m3fn).float() * s).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(m(x), torch.matmul(xq, m.dequantized_weight().t()))


@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_autofp8(scheme, base, tmp_path):
    kv = {f"model.layers.{i}.self_attn.{k}": torch.tensor(0.5) for i in range(2) for k in ("k_scale", "v_scale")}
    path = build(base, tmp_path / scheme, {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ["lm_head"]},
                 weights="tensor", static=scheme == "static", scale_dtype=torch.float32, scalar=True, extra=kv)
    model, logits = ours_logits(path, base)
    q = model.model.layers[1].self_attn.o_proj
    assert q.activation == ("static" if scheme == "static" else "dynamic_tensor")
    assert q.weight_scale.dtype == torch.float32 and q.weight_scale.shape == (1,)
    assert model.hqtflow_quantization["dropped_tensors"] == 0  # KV-cache scales are kept, for the FP8 KV cache
    from hqtflow.runtime.kv_cache import kv_scales

    assert [tuple(float(t) for t in pair) for pair in kv_scales(model)] == [(0.5, 0.5), (0.5, 0.5)]
    assert sqnr(base["logits"], logits) > 15


def test_autofp8_block_scale_inv(base, tmp_path):
    path = build(base, tmp_path / "ds", {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                         "weight_block_size": [32, 32]},
                 weights="block", scale_dtype=torch.float32, scale_name="weight_scale_inv")
    model, logits = ours_logits(path, base)
    q = model.model.layers[0].self_attn.q_proj
    assert q.block_size == (32, 32) and q.activation == "dynamic_group" and q.group_size == 32
    w = base["tensors"]["model.layers.0.self_attn.q_proj.weight"].float()
    assert sqnr(w, q.dequantized_weight()) > 25
    assert sqnr(base["logits"], logits) > 15


@pytest.mark.parametrize("qcfg,message", [
    (ct_config({"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False}, None),
     "Unsupported weight scheme int8"),
    (ct_config({**FP8, "strategy": "tensor", "symmetric": False, "dynamic": False}, None), "Asymmetric"),
    (ct_config({**FP8, "strategy": "group", "group_size": 32, "dynamic": False}, None), "Unsupported weight strategy 'group'"),
    ({"quant_method": "gptq"}, "Unsupported quantization method 'gptq'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [32, 32]}, "static activations are not supported"),
    ({**TENSOR_WO, "kv_cache_scheme": {"num_bits": 4, "type": "int", "strategy": "head"}}, "kv_cache_scheme"),
    ({**TENSOR_WO, "kv_cache_scheme": "fp8"}, "kv_cache_scheme"),
    ({**TENSOR_WO, "format": "int-quantized"}, "format 'int-quantized'"),
    ({**TENSOR_WO, "config_groups": {"group_0": {**TENSOR_WO["config_groups"]["group_0"], "targets": ["Conv2d"]}}},
     "targets"),
    ({**TENSOR_WO, "ignore": ["re:(["]}, r"ignore entry 're:\(\[' is not a valid regex"),
    ({**TENSOR_WO, "ignore": ["re:.*"]}, "ignore names model.*contradicts the weights"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.up_proj"]}, "ignored_layers names model.layers.0.mlp.up_proj"),
    ({"quant_method": "fp8", "ignored_layers": "lm_head"}, "ignored_layers must be a list of module names, not 'lm_head'"),
    ({"quant_method": "fp8", "modules_to_not_convert": [1]}, r"modules_to_not_convert must be a list of module names, not \[1\]"),
])
def test_unsupported_named(qcfg, message, base, tmp_path):
    from hqtflow.errors import ArtifactError

    path = build(base, tmp_path / "bad", qcfg)
    with pytest.raises(ArtifactError, match=message):
        load_checkpoint(path)


def test_foreign_checkpoint_serves(base, tmp_path):
    """A compressed-tensors checkpoint in another tool's conventions (per-channel weights, dynamic per-token
    activations) is served by `hqtflow serve fp8`'s app: /generate gives the loader's own greedy text."""
    import httpx

    from conftest import running
    from hqtflow.evaluate import load_any
    from hqtflow.runtime.server import ServeSettings, create_app

    kw, w, a = CT_CASES["dynamic_token_channel"]
    path = build(base, tmp_path / "ct", ct_config(w, a), **kw)
    model, tok, kind = load_any(str(path))
    assert kind == "fp8"
    ids = tok(PROMPT, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    expected = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    app = create_app(model, tok, ServeSettings(model_id="foreign-ct", max_input_tokens=128, max_total_tokens=160))
    with running(app) as url:
        r = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 6}}, timeout=60)
    assert r.status_code == 200 and r.json()["generated_text"] == expected


def test_targets_by_module_name_or_pattern_load(base, tmp_path):
    """compressed-tensors `targets` may name modules or give `re:` patterns, as llm-compressor writes them; they are
    read (the weights say which layers are FP8), while another layer class (`Conv2d`) is refused above."""
    group = TENSOR_WO["config_groups"]["group_0"]
    for targets in (["model.layers.0.mlp.down_proj", "lm_head"], ["re:.*mlp.*", "re:.*self_attn.*", "Linear"]):
        path = build(base, tmp_path / "_".join(t.replace(":", "").replace("*", "") for t in targets)[:40],
                     {**TENSOR_WO, "config_groups": {"group_0": {**group, "targets": targets}}})
        load_checkpoint(path)


def test_generation_config_eos_ids_are_read(base, tmp_path):
    """A checkpoint's generation_config.json names the EOS ids (Llama 3 Instruct lists three, its config.json may name
    one): they are the loaded model's, so the engine stops on each; a malformed list is refused, not ignored."""
    from hqtflow.errors import ModelError
    from hqtflow.runtime.engine import Engine

    path = build(base, tmp_path / "ct", TENSOR_WO)
    gc = json.loads((path / "generation_config.json").read_text()) if (path / "generation_config.json").is_file() else {}
    (path / "generation_config.json").write_text(json.dumps({**gc, "eos_token_id": [2, 7, 11]}))
    model = load_checkpoint(path)
    assert model.generation_config.eos_token_id == [2, 7, 11]
    from transformers import AutoTokenizer

    eng = Engine(model, AutoTokenizer.from_pretrained(path), max_batch_total_tokens=128)
    assert {7, 11} <= eng.eos
    (path / "generation_config.json").write_text(json.dumps({**gc, "eos_token_id": ["</s>"]}))
    with pytest.raises(ModelError, match="eos_token_id must be a token id or a list of them"):
        load_checkpoint(path)
