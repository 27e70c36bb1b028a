"""`hqtflow quantize` on a tiny model: the FP8 checkpoint, its loading, the QDQ Linear, scale files, bad input."""

import json

import numpy as np
import pytest
import torch

from conftest import ROOT, refused_quantize, run_cli, sqnr
from hqtflow.formats.artifact import read_manifest
from hqtflow.quantize.fp8_linear import FP8Linear


CFG = ROOT / "quantization_config"


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "meas"
    r = run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "6", "--max-length", "64",
                "-c", CFG / "maxabs_measure_include_outputs.json")
    assert r.exit_code == 0, r.output
    return out


def require_compressed_tensors():
    import importlib.util

    from conftest import need

    need(importlib.util.find_spec("compressed_tensors") is not None, "compressed-tensors is not installed")


def quantize_cli(measured, out, *extra):
    r = run_cli("quantize", "-m", measured, "-o", out, *extra)
    assert r.exit_code == 0, r.output
    return out


def test_fp8_linear_qdq_reference():
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    s_w, s_x = torch.tensor(0.01, dtype=torch.bfloat16), torch.tensor(0.02, dtype=torch.bfloat16)
    m = FP8Linear.from_linear(lin, s_w, s_x)
    assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.shape == (1,) and m.input_scale.shape == (1,)
    # the reference written out: q(x) = cast(clamp(x / s, +-448)) in fp32, dq = q * s, then the matmul in bf16
    sx, sw = s_x.item(), s_w.item()  # the bf16 values of the scales
    xq = (x.float() / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(sx).to(torch.bfloat16)
    wq = (lin.weight.float() / sw).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(sw).to(torch.bfloat16)
    with torch.no_grad():
        ref = torch.matmul(xq, wq.t()) + lin.bias
        assert torch.equal(m(x), ref)
        wo = FP8Linear.from_linear(lin, s_w, None)
        assert wo.input_scale is None and torch.equal(wo(x), torch.matmul(x, wq.t()) + lin.bias)
        pc = FP8Linear.from_linear(lin, torch.full((16,), sw, dtype=torch.bfloat16), s_x)
        assert pc.weight_scale.shape == (16, 1) and torch.equal(pc(x), ref)


def test_checkpoint_roundtrip(measured, tiny_llama, tmp_path):
    import hqtflow
    from transformers import AutoModelForCausalLM

    out = quantize_cli(measured, tmp_path / "fp8", "--scale-method", "maxabs_pow2")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "float-quantized"
    assert cfg["config_groups"]["group_0"]["weights"]["strategy"] == "tensor"
    assert cfg["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    assert cfg["ignore"] == ["lm_head"]
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (1,)
        assert f.get_tensor("model.layers.0.self_attn.q_proj.input_scale").shape == (1,)
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    m = read_manifest(out, "hqtflow.checkpoint")
    assert m.data["scale_method"] == "maxabs_pow2" and m.data["target"] == "cpu"
    assert m.data["source_digest"] == read_manifest(measured, "hqtflow.measurement").digest()
    assert m.data["skipped"] == {"lm_head": "excluded by allowlist/blocklist"}

    model, tok = hqtflow.load(out)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, FP8Linear)
    # input scale = pow2(bf16(maxabs) / 112), from the measurement
    stats = json.loads((measured / "measure_hooks_maxabs.json").read_text())["Nodes"]
    maxabs = stats["model.layers.0.self_attn.q_proj"]["inputs"][0][0][0]
    raw = torch.tensor(maxabs, dtype=torch.bfloat16) / 112
    assert q.input_scale.item() == 2.0 ** np.ceil(np.log2(raw.item()))
    bf16 = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    ids = torch.tensor([tok.encode("The tower is 324 metres tall, about the same height as an 81-storey building.")])
    with torch.inference_mode():
        assert sqnr(bf16(ids).logits, model(ids).logits) > 15


def test_load_under_inference_mode(measured, tiny_llama, tmp_path):
    """`with torch.inference_mode(): hqtflow.load(...)`, a common pattern: its weights are inference tensors, which
    have no in-place version for the packed-copy check; the FP8 checkpoint and a bf16 model on the packed kernel
    both run, with the logits of a load outside it."""
    from hqtflow.api import load_any

    out = quantize_cli(measured, tmp_path / "fp8", "--scale-method", "maxabs_pow2")
    for source in (out, tiny_llama):
        model, tok, _ = load_any(str(source), dtype="bf16")
        ids = torch.tensor([tok.encode("The tower is 324 metres tall")])
        with torch.inference_mode():
            ref = model(ids).logits
            inside, _, _ = load_any(str(source), dtype="bf16")
            assert torch.equal(inside(ids).logits, ref), source


def test_load_runs_no_random_init_of_the_weights_it_replaces(measured, tmp_path, monkeypatch):
    """hqtflow.load builds the model on the meta device and fills it from the checkpoint: transformers' random
    init_weights (a third of a small model's load, bench/load_checkpoint.py) is not run; the rotary buffers, computed
    in __init__, are the ones from_pretrained builds."""
    import hqtflow
    import transformers.initialization as hf_init
    from transformers import AutoModelForCausalLM

    out = quantize_cli(measured, tmp_path / "fp8")
    calls = []
    for name in ("normal_", "ones_", "zeros_", "copy_"):
        orig = getattr(hf_init, name)
        monkeypatch.setattr(hf_init, name, lambda *a, _o=orig, **k: calls.append(1) or _o(*a, **k))
    model, _ = hqtflow.load(out, verify=False)
    monkeypatch.undo()
    assert calls == []
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)
    buffers = dict(model.named_buffers())
    for name, b in ref.named_buffers():
        if "rotary" in name:
            assert torch.equal(buffers[name], b), name


def test_weight_only_and_per_channel(measured, tmp_path):
    import hqtflow

    out = quantize_cli(measured, tmp_path / "wo", "--weight-only", "--scale-method",
                       "act_maxabs_pow2_weights_pcs_maxabs_pow2")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert cfg["weights"]["strategy"] == "channel" and cfg["input_activations"] is None
    model, _ = hqtflow.load(out)
    q = model.model.layers[1].mlp.down_proj
    assert q.input_scale is None and q.weight_scale.shape == (64, 1)


def test_load_takes_another_tools_checkpoint_and_still_verifies_its_own(measured, tiny_llama, tmp_path):
    """hqtflow.load loads an FP8 checkpoint without hqtflow's manifest (as generate does); one with the manifest is
    verified: tampered or unfinished, it is refused."""
    import shutil

    import hqtflow
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.artifact import MANIFEST, PARTIAL_MARKER

    out = quantize_cli(measured, tmp_path / "fp8")
    foreign = tmp_path / "foreign"
    shutil.copytree(out, foreign)
    (foreign / MANIFEST).unlink()
    (theirs, tok), ours = hqtflow.load(foreign), hqtflow.load(out)[0]
    ids = torch.tensor([tok.encode("The tower is 324 metres tall.")])
    with torch.inference_mode():
        assert torch.equal(theirs(ids).logits, ours(ids).logits)
    with pytest.raises(ArtifactError, match="is not an FP8 checkpoint"):
        hqtflow.load(tiny_llama)
    tampered = tmp_path / "tampered"
    shutil.copytree(out, tampered)
    (tampered / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="tokenizer_config.json"):
        hqtflow.load(tampered)
    (foreign / PARTIAL_MARKER).write_text("pid 1\n")
    with pytest.raises(ArtifactError, match="unfinished output"):
        hqtflow.load(foreign)


def test_load_refuses_a_device_it_cannot_use_and_a_file(measured, tmp_path, monkeypatch):
    """device and dtype are checked as the CLI checks --device and --dtype, in Python's words; a file is not a
    checkpoint directory."""
    import hqtflow
    from hqtflow.errors import ArtifactError, ConfigError

    out = quantize_cli(measured, tmp_path / "fp8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device='cuda': PyTorch .* sees no CUDA GPU here; use device='cpu'\."):
        hqtflow.load(out, device="cuda")
    with pytest.raises(ConfigError, match=r"Unknown device='gpu'; valid values are auto, cpu, cuda\.$"):
        hqtflow.load(out, device="gpu")
    with pytest.raises(ConfigError, match=r"dtype must be auto, bf16, fp16 or fp32, not 'float8'\.$"):
        hqtflow.load(out, dtype="float8")
    with pytest.raises(ArtifactError, match=r"config.json is a file, not a directory\."):
        hqtflow.load(out / "config.json")


def test_load_takes_its_keywords_and_torchs_dtype_names(measured, tmp_path):
    """hqtflow.load's signature is its keywords (and `hqtflow` exports it alone with __version__, importing no torch);
    dtype takes torch's names and dtypes besides bf16/fp16/fp32."""
    import inspect
    import subprocess
    import sys

    import hqtflow

    assert list(inspect.signature(hqtflow.load).parameters) == ["path", "device", "verify", "backend", "dtype"]
    assert hqtflow.__all__ == ["__version__", "load"] and "verify" in hqtflow.load.__doc__
    code = "import sys, hqtflow; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    out = quantize_cli(measured, tmp_path / "fp8")
    for given, dtype in (("bfloat16", torch.bfloat16), (torch.float32, torch.float32), ("float16", torch.float16),
                         ("torch.bfloat16", torch.bfloat16)):
        model, _ = hqtflow.load(out, dtype=given, verify=False)
        assert model.model.norm.weight.dtype == dtype, given


def test_compressed_tensors_loads_it(measured, tmp_path):
    """transformers' compressed-tensors integration reads the checkpoint: same greedy text as hqtflow's runtime."""
    require_compressed_tensors()
    import hqtflow
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    out = quantize_cli(measured, tmp_path / "ct", "--weight-only")
    ours, tok = hqtflow.load(out, dtype="bf16")
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(dequantize=True),
                                                  dtype=torch.bfloat16)
    ids = torch.tensor([tok.encode("It was the first structure to reach a height of")])
    with torch.inference_mode():
        a = ours.generate(ids, max_new_tokens=12, do_sample=False)
        b = theirs.generate(ids, max_new_tokens=12, do_sample=False)
        # weights dequantized by compressed-tensors equal hqtflow's
        wq = theirs.model.layers[0].mlp.up_proj.weight
        torch.testing.assert_close(wq, ours.model.layers[0].mlp.up_proj.dequantized_weight(), rtol=0, atol=0)
    assert torch.equal(a, b)


def test_compressed_tensors_runs_w8a8_identically(measured, tmp_path):
    """compressed-tensors' own runtime (input fake-quant + FP8 weights) gives hqtflow's logits bit for bit with
    power-of-two scales (with arbitrary scales it divides in bf16, hqtflow in fp32 like INC: last-bit differences)."""
    require_compressed_tensors()
    import hqtflow
    from transformers import AutoModelForCausalLM

    out = quantize_cli(measured, tmp_path / "w8a8", "--scale-method", "maxabs_pow2")
    ours, tok = hqtflow.load(out, dtype="bf16")
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ids = torch.tensor([tok.encode("It was the first structure to reach a height of 300 metres")])
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)
        assert torch.equal(ours.generate(ids, max_new_tokens=8, do_sample=False),
                           theirs.generate(ids, max_new_tokens=8, do_sample=False))


def test_scales_only_inc_layout(measured, tmp_path):
    out = quantize_cli(measured, tmp_path / "sc", "--scales-only", "--scale-method", "maxabs_hw", "--scales-for", "gaudi2")
    names = {p.name for p in out.iterdir()}
    assert "measure_hooks_maxabs_MAXABS_HW.json" in names and "measure_hooks_maxabs_MAXABS_HW.npz" in names
    assert "measure_hooks_maxabs.json" in names and "quant_config.json" in names
    js = json.loads((out / "measure_hooks_maxabs_MAXABS_HW.json").read_text())
    assert js["Mode"] == "Scale"
    node = js["Nodes"]["model.layers.0.mlp.up_proj"]
    s_in, s_w = node["inputs"][0], node["params"]["weight"]
    assert s_in in (16.0, 1.0, 2.0**-4, 2.0**-8) and s_w in (16.0, 1.0, 2.0**-4, 2.0**-8)
    assert node["outputs"][0] == s_in * s_w
    inc = json.loads((out / "quant_config.json").read_text())
    assert inc["device_for_scales"] == "GAUDI2" and inc["dump_stats_path"] == str(out.resolve() / "measure")
    m = read_manifest(out, "hqtflow.scales")
    assert m.data["source_digest"] == read_manifest(measured, "hqtflow.measurement").digest()


def test_e5m2(measured, tmp_path):
    cfg = tmp_path / "e5m2.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "maxabs_pow2", "fp8_config": "E5M2"}))
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "ck", "-c", cfg)
    assert r.exit_code == 2 and "E5M2 is supported with --scales-only" in r.stderr
    out = quantize_cli(measured, tmp_path / "sc", "-c", cfg, "--scales-only")
    node = json.loads((out / "measure_hooks_maxabs_MAXABS_POW2.json").read_text())["Nodes"]["model.layers.0.mlp.up_proj"]
    stats = json.loads((measured / "measure_hooks_maxabs.json").read_text())["Nodes"]["model.layers.0.mlp.up_proj"]
    raw = torch.tensor(stats["inputs"][0][0][0], dtype=torch.bfloat16) / (57344 * 0.25)
    assert node["inputs"][0] == 2.0 ** np.ceil(np.log2(raw.item()))


# ---- bad input ---------------------------------------------------------------------------------
def test_other_model_refused(measured, tiny_factory, tmp_path):
    other = tiny_factory("llama", seed=1)
    refused_quantize([other, "-m", measured, "-o", tmp_path / "out"], "was made on a different model", tmp_path, code=3)


def test_missing_statistics_refused(tiny_llama, wiki_text, tmp_path):
    meas = tmp_path / "m"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"mode": "MEASURE", "blocklist": {"names": ["down_proj"]}}))
    assert run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "2", "-c", cfg).exit_code == 0
    refused_quantize(["-m", meas, "-o", tmp_path / "out"], "no input statistics for model.layers.0.mlp.down_proj", tmp_path, code=3)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps({"mode": "QUANTIZE", "ignore_modules_wo_measures": True, "blocklist": {"names": ["lm_head"]}}))
    out = quantize_cli(meas, tmp_path / "out2", "-c", ok)
    assert read_manifest(out, "hqtflow.checkpoint").data["skipped"]["model.layers.0.mlp.down_proj"].startswith("no statistics")


def test_nan_statistics_refused(measured, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(measured, bad)
    js = json.loads((bad / "measure_hooks_maxabs.json").read_text())
    js["Nodes"]["model.layers.1.self_attn.v_proj"]["inputs"] = [[[float("nan")]]]
    (bad / "measure_hooks_maxabs.json").write_text(json.dumps(js))
    (bad / "hqtflow_manifest.json").unlink()  # a foreign dump: only import-hqt reads it
    model = json.loads((measured / "hqtflow_manifest.json").read_text())["data"]["model_path"]
    refused_quantize([model, "-m", bad, "-o", tmp_path / "out"], f"bring them in first with `hqtflow import-hqt {bad}", tmp_path, code=3)
    r = run_cli("import-hqt", bad, "-o", tmp_path / "out")
    assert r.exit_code == 3 and "module model.layers.1.self_attn.v_proj has a non-finite input statistic" in r.stderr, r.output
    assert not (tmp_path / "out").exists()


def test_npz_only_needs_trust_pickle(measured, tmp_path):
    import shutil

    model = json.loads((measured / "hqtflow_manifest.json").read_text())["data"]["model_path"]
    dump = tmp_path / "dump"
    dump.mkdir()
    shutil.copy(measured / "measure_hooks_maxabs.npz", dump)
    r = run_cli("import-hqt", dump, "-o", tmp_path / "out")
    assert r.exit_code == 3 and "its .npz twin is a pickle, opened only with `hqtflow import-hqt --trust-pickle`" in r.stderr
    assert not (tmp_path / "out").exists()
    # quantize's --trust-pickle is about model weights: a foreign dump still goes through import-hqt
    r = run_cli("quantize", model, "-m", dump, "-o", tmp_path / "q", "--trust-pickle")
    assert r.exit_code == 3 and "hqtflow import-hqt" in r.stderr and not (tmp_path / "q").exists(), r.output
    r = run_cli("import-hqt", dump, "-o", tmp_path / "imp", "--trust-pickle", "--model", model)
    assert r.exit_code == 0, r.output
    imp = tmp_path / "imp"
    assert (imp / "measure_hooks_maxabs.npz").read_bytes() == (dump / "measure_hooks_maxabs.npz").read_bytes()
    assert json.loads((imp / "measure_hooks_maxabs.json").read_text()) == json.loads((measured / "measure_hooks_maxabs.json").read_text())
    m = read_manifest(imp, "hqtflow.measurement")
    assert "measure_hooks_maxabs.json" in m.files and m.data["provenance_known"] is False
    r = run_cli("quantize", "-m", imp, "-o", tmp_path / "trusted")  # the model recorded by --model
    assert r.exit_code == 0, r.output
    assert read_manifest(tmp_path / "trusted", "hqtflow.checkpoint").data["provenance_known"] is False


def test_partial_and_bad_method(measured, tmp_path):
    import shutil

    part = tmp_path / "part"
    shutil.copytree(measured, part)
    (part / "measure_hooks_maxabs.npz").unlink()
    refused_quantize(["-m", part, "-o", tmp_path / "out"], "is incomplete: measure_hooks_maxabs.npz", tmp_path, code=3)
    refused_quantize(["-m", measured, "-o", tmp_path / "out", "--scale-method", "maxabs_fast"],
             "'scale_method' has value 'maxabs_fast'", tmp_path, code=2)
    refused_quantize(["-m", measured, "-o", tmp_path / "out", "--scales-for", "tpu"], "valid values are", tmp_path, code=2)
    refused_quantize(["-m", tmp_path / "nope", "-o", tmp_path / "out"], "does not exist", tmp_path, code=3)


@pytest.fixture(scope="module")
def fp16_zeros(tiny_factory, wiki_text, tmp_path_factory):
    """The tiny Llama saved in fp16 with an all-zero Linear (layer 1's o_proj) and an all-zero row (layer 0's
    q_proj, row 0), and its fp16 measurement: (model, measurement)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("fp16")
    model = d / "model"
    shutil.copytree(tiny_factory("llama", dtype="float16"), model)
    t = load_file(model / "model.safetensors")
    t["model.layers.1.self_attn.o_proj.weight"].zero_()
    t["model.layers.0.self_attn.q_proj.weight"][0] = 0
    save_file(t, model / "model.safetensors", metadata={"format": "pt"})
    r = run_cli("measure", model, "-o", d / "m", "--dtype", "fp16", "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output
    return model, d / "m"


def _with_input_statistic(measured, work, value):
    """A copy of `measured` whose layer 0 q_proj input statistic is `value`, its manifest's hashes rewritten."""
    import shutil

    from hqtflow.formats.artifact import MANIFEST, sha256_file

    d = work / f"m_{value}"
    shutil.copytree(measured, d)
    f = d / "measure_hooks_maxabs.json"
    raw = json.loads(f.read_text())
    raw["Nodes"]["model.layers.0.self_attn.q_proj"]["inputs"] = [[[value]]]
    f.write_text(json.dumps(raw))
    man = json.loads((d / MANIFEST).read_text())
    man["files"] = {k: sha256_file(d / k) for k in man["files"]}
    (d / MANIFEST).write_text(json.dumps(man))
    return d


@pytest.mark.parametrize("method", ["maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2"])
def test_fp16_zero_weights_and_statistics_get_fp16_floor(fp16_zeros, method, tmp_path):
    """fp16 checkpoints store fp16 scales: a zero tensor, row or input statistic gets 2^-14 (bf16's 2^-126 would be
    written as 0, which no reader loads), and the zero row's FP8 codes are 0, not -448."""
    import hqtflow
    from safetensors.torch import load_file

    model, measured = fp16_zeros
    out = quantize_cli(_with_input_statistic(measured, tmp_path, 0.0), tmp_path / "ck", "--scale-method", method)
    t = load_file(out / "model.safetensors")
    scales = {k: v for k, v in t.items() if k.endswith("_scale")}
    assert all(v.dtype == torch.float16 and (v >= 2.0**-14).all() for v in scales.values()), scales
    assert t["model.layers.0.self_attn.q_proj.input_scale"].item() == 2.0**-14
    assert t["model.layers.1.self_attn.o_proj.weight_scale"].max().item() == 2.0**-14
    assert (t["model.layers.0.self_attn.q_proj.weight"][0].float() == 0).all()
    assert (t["model.layers.1.self_attn.o_proj.weight"].float() == 0).all()
    fp8, _ = hqtflow.load(out)  # the loader refuses zero scales
    assert fp8.model.layers[1].self_attn.o_proj.weight_scale.min().item() == 2.0**-14


def test_fp16_scale_over_fp16_refused(fp16_zeros, tmp_path):
    """An input statistic of 1e7 gives 2^17, which fp16 cannot hold: one sentence, exit 3, nothing written (the
    checkpoint used to hold an inf input_scale)."""
    model, measured = fp16_zeros
    r = run_cli("quantize", model, "-m", _with_input_statistic(measured, tmp_path, 1e7), "-o", tmp_path / "out",
                "--scale-method", "maxabs_pow2")
    assert r.exit_code == 3 and "Traceback" not in r.output, r.output
    assert r.stderr.strip().endswith("\nError: The measured input maxabs of model.layers.0.self_attn.q_proj gives the "
                                     "input scale 1.31e+05, over 6.55e+04, the largest float16 value; the statistics "
                                     "are corrupt."), r.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_fixed_scale_that_ruins_the_model_warns(measured, tmp_path):
    """hw_aligned_single_scale (128 off Gaudi2) ignores the statistics: the tiny model's weights (|w| < 0.2) all
    quantize below FP8's smallest normal number, so quantize writes the checkpoint with one warning line; unit_scale
    (codes = weights) and the maxabs methods do not warn."""
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "single", "--scale-method", "hw_aligned_single_scale")
    assert r.exit_code == 0, r.output
    warned = [line for line in r.stderr.splitlines() if line.startswith("Warning:")]
    assert warned == ["Warning: hw_aligned_single_scale ignores the statistics: fixed scales put all weights or all "
                      "inputs of 14 of 14 quantized layers (model.layers.0.self_attn.q_proj (weight scale 128) the first) below "
                      "FP8's smallest normal number (0.015625) on cpu, which ruins accuracy; a maxabs method suits this "
                      "model."], r.stderr
    for method in ("unit_scale", "maxabs_pow2"):
        r = run_cli("quantize", "-m", measured, "-o", tmp_path / method, "--scale-method", method)
        assert r.exit_code == 0 and "Warning:" not in r.stderr, r.output
