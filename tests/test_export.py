"""`hqtflow import-hqt` (foreign HQT/INC measurement files -> artifact -> quantize) and `hqtflow export`
(hqtflow checkpoint -> AutoFP8/vLLM fp8 layout, compressed-tensors per-channel/per-tensor)."""

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT, need, run_cli
from hqtflow.errors import EXIT_CODES
from hqtflow.formats.artifact import read_manifest

CFG = ROOT / "quantization_config"


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("ex") / "meas"
    r = run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "4", "--max-length", "64")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def checkpoint(measured, tmp_path_factory):
    out = tmp_path_factory.mktemp("ex") / "fp8"
    r = run_cli("quantize", "-m", measured, "-o", out, "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    return out


def _tensors(d):
    with safe_open(d / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ---- import-hqt --------------------------------------------------------------------------------
def test_import_hqt_then_quantize(measured, tiny_llama, tmp_path):
    gaudi = tmp_path / "gaudi"
    gaudi.mkdir()
    for p in measured.iterdir():
        if p.name.startswith("measure_hooks_maxabs"):
            shutil.copy(p, gaudi / p.name)
    (gaudi / "measure_hooks_maxabs_MAXABS_HW.json").write_text(json.dumps({"Mode": "Scale", "Nodes": {}}))
    out = tmp_path / "imported"
    r = run_cli("import-hqt", gaudi, "-o", out, "--model", tiny_llama)
    assert r.exit_code == 0, r.output
    m = read_manifest(out, "hqtflow.measurement")
    assert m.data["provenance_known"] is False and m.data["world_size"] == 1 and m.data["observer"] == "maxabs"
    assert m.data["ranks"][0]["stem"] == "measure_hooks_maxabs" and m.data["ranks"][0]["layers"] == {}
    assert m.data["scale_files"] == ["measure_hooks_maxabs_MAXABS_HW.json"]
    assert m.model["id"] == read_manifest(measured, "hqtflow.measurement").model["id"]
    ck = tmp_path / "ck"
    r = run_cli("quantize", "-m", out, "-o", ck, "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    # the same scales as quantizing from the original measurement
    ref = tmp_path / "ref"
    assert run_cli("quantize", "-m", measured, "-o", ref, "--scale-method", "maxabs_pow2").exit_code == 0
    a, b = _tensors(ck), _tensors(ref)
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    # without --model, quantize needs the MODEL argument
    bare = tmp_path / "bare"
    assert run_cli("import-hqt", gaudi, "-o", bare).exit_code == 0
    r = run_cli("quantize", "-m", bare, "-o", tmp_path / "x")
    assert r.exit_code == 3 and "pass the MODEL argument" in r.stderr
    assert run_cli("quantize", tiny_llama, "-m", bare, "-o", tmp_path / "y").exit_code == 0


def test_import_hqt_refuses(measured, tmp_path):
    def refused(src, message):
        r = run_cli("import-hqt", src, "-o", tmp_path / "out")
        assert r.exit_code in set(EXIT_CODES.values()), r.output  # usage (2) or artifact (3)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "out").exists()

    js = json.loads((measured / "measure_hooks_maxabs.json").read_text())
    two = tmp_path / "two"
    two.mkdir()
    (two / "measure_hooks_maxabs_0_2.json").write_text(json.dumps({**js, "LocalRank": 0}))
    refused(two, "rank(s) 1 are missing")
    (two / "measure_hooks_maxabs_1_2.json").write_text("{not json")
    refused(two, "is not an HQT measurement file")
    (two / "measure_hooks_maxabs_1_2.json").write_text(json.dumps({**js, "LocalRank": 1}))
    r = run_cli("import-hqt", two, "-o", tmp_path / "ok2")
    assert r.exit_code == 0, r.output
    d = read_manifest(tmp_path / "ok2", "hqtflow.measurement").data
    assert d["world_size"] == 2 and [x["stem"] for x in d["ranks"]] == ["measure_hooks_maxabs_0_2", "measure_hooks_maxabs_1_2"]
    npz = tmp_path / "npz"
    npz.mkdir()
    shutil.copy(measured / "measure_hooks_maxabs.npz", npz)
    refused(npz, "opened only with `hqtflow import-hqt --trust-pickle`")
    refused(tmp_path / "nope", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, "holds no HQT/INC measurement files")


# ---- export --fp8 ------------------------------------------------------------------------------
def test_export_fp8_layout(checkpoint, tmp_path):
    out = tmp_path / "vllm"
    r = run_cli("export", checkpoint, "--format", "fp8", "-o", out)
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    src, t = _tensors(checkpoint), _tensors(out)
    n = "model.layers.0.self_attn.q_proj"
    assert t[f"{n}.weight"].dtype == torch.float8_e4m3fn
    for k in ("weight_scale", "input_scale"):
        assert t[f"{n}.{k}"].dtype == torch.float32 and t[f"{n}.{k}"].shape == ()
    assert not any(k.endswith(("k_scale", "v_scale")) for k in t)  # the checkpoint measured no KV cache
    import hqtflow

    ours, _ = hqtflow.load(checkpoint)
    for name, mod in ours.named_modules():
        if hasattr(mod, "dequantized_weight"):
            w = t[f"{name}.weight"].float() * t[f"{name}.weight_scale"]  # vLLM's dequantization
            assert torch.equal(w.to(torch.bfloat16), mod.dequantized_weight()), name
            assert t[f"{name}.input_scale"].item() == mod.input_scale.item()
    assert torch.equal(t["lm_head.weight"], src["lm_head.weight"])
    assert (out / "tokenizer.json").is_file() and read_manifest(out, "hqtflow.export").data["format"] == "fp8"


def test_export_fp8_loads_back_identically(checkpoint, tmp_path):
    """hqtflow's loader reads the AutoFP8 layout: the same logits as the source checkpoint, bit for bit."""
    import hqtflow
    from hqtflow.formats.checkpoint import load_checkpoint

    out = tmp_path / "vllm"
    assert run_cli("export", checkpoint, "--format", "fp8", "-o", out).exit_code == 0
    ours, tok = hqtflow.load(checkpoint, dtype="bf16")  # load_checkpoint's default: the checkpoint's own dtype
    theirs = load_checkpoint(out)
    ids = torch.tensor([tok.encode("The tower is 324 metres tall")])
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_generate_runs_exports(checkpoint, tmp_path):
    """`generate` takes hqtflow's own fp8 and compressed-tensors exports (the same text as the source checkpoint);
    an INC-layout export is refused as an artifact this runtime does not run."""
    want = run_cli("generate", checkpoint, "-p", "The tower is", "--max-new-tokens", "6", "--backend", "qdq")
    assert want.exit_code == 0, want.output
    for fmt in ("fp8", "compressed-tensors"):
        out = tmp_path / fmt
        assert run_cli("export", checkpoint, "--format", fmt, "-o", out).exit_code == 0
        got = run_cli("generate", out, "-p", "The tower is", "--max-new-tokens", "6", "--backend", "qdq")
        assert got.exit_code == 0 and got.stdout == want.stdout, (fmt, got.output)
    (out / "config.json").write_text((out / "config.json").read_text() + " ")  # a damaged export is still caught
    r = run_cli("generate", out, "-p", "x")
    assert r.exit_code == 3 and "Error: " in r.stderr, r.output


def test_export_fp8_refuses(checkpoint, tmp_path):
    r = run_cli("export", checkpoint, "--format", "gguf", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "valid values are fp8, compressed-tensors" in r.stderr
    r = run_cli("export", checkpoint, "--format", "fp8", "--per-channel", "-o", tmp_path / "o")
    assert r.exit_code == 2 and "one scale per tensor" in r.stderr
    (tmp_path / "not_a_checkpoint").mkdir()
    r = run_cli("export", tmp_path / "not_a_checkpoint", "--format", "fp8", "-o", tmp_path / "o")
    assert r.exit_code == 3 and "no config.json" in r.stderr


# ---- export --format compressed-tensors --per-channel ------------------------------------------
def test_export_per_channel_and_back(checkpoint, tmp_path):
    import hqtflow
    from hqtflow.formats.checkpoint import load_checkpoint

    pc = tmp_path / "pc"
    r = run_cli("export", checkpoint, "--format", "compressed-tensors", "--per-channel", "-o", pc)
    assert r.exit_code == 0, r.output
    g = json.loads((pc / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert g["weights"]["strategy"] == "channel" and g["input_activations"]["strategy"] == "tensor"
    src, t = _tensors(checkpoint), _tensors(pc)
    ours, _ = hqtflow.load(checkpoint)
    for name, mod in ours.named_modules():
        if not hasattr(mod, "dequantized_weight"):
            continue
        q, s = t[f"{name}.weight"], t[f"{name}.weight_scale"]
        assert q.dtype == torch.float8_e4m3fn and s.shape == (mod.out_features, 1) and s.dtype == torch.bfloat16
        w = q.float() * s.float()
        ref = mod.dequantized_weight().float()
        # each channel's maxabs maps to (at most) 448, and every value is within FP8 rounding of hqtflow's
        assert float((ref.abs().amax(1, keepdim=True) / s.float()).max()) <= 448
        assert torch.all((w - ref).abs() <= ref.abs() * 2.0 ** -4 + s.float() * 2.0 ** -9), name
        assert torch.equal(t[f"{name}.input_scale"], src[f"{name}.input_scale"])
    back = tmp_path / "pt"
    r = run_cli("export", pc, "--format", "compressed-tensors", "--per-tensor", "-o", back)
    assert r.exit_code == 0, r.output
    tb = _tensors(back)
    for name, mod in load_checkpoint(back).named_modules():
        if hasattr(mod, "dequantized_weight"):
            assert tb[f"{name}.weight_scale"].shape == (1,)
            w, ref = mod.dequantized_weight().float(), t[f"{name}.weight"].float() * t[f"{name}.weight_scale"].float()
            assert torch.all((w - ref).abs() <= ref.abs() * 2.0 ** -4 + tb[f"{name}.weight_scale"].float() * 2.0 ** -9)


def test_export_per_channel_transformers_same_text(checkpoint, tmp_path):
    """transformers + compressed-tensors run the per-channel export with the same greedy text as hqtflow."""
    need(importlib.util.find_spec("compressed_tensors") is not None, "compressed-tensors is not installed")
    from transformers import AutoModelForCausalLM

    from hqtflow import models
    from hqtflow.formats.checkpoint import load_checkpoint

    pc = tmp_path / "pc"
    assert run_cli("export", checkpoint, "--format", "compressed-tensors", "--per-channel", "-o", pc).exit_code == 0
    ours, tok = load_checkpoint(pc), models.load_tokenizer(pc)
    theirs = AutoModelForCausalLM.from_pretrained(pc, dtype=torch.bfloat16)
    assert "CompressedTensors" in type(theirs.config.quantization_config).__name__ or \
        theirs.config.quantization_config.get("quant_method") == "compressed-tensors"
    ids = torch.tensor([tok.encode("It was the first structure to reach a height of 300 metres")])
    with torch.inference_mode():
        a = ours.generate(ids, max_new_tokens=10, do_sample=False)
        b = theirs.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(a, b)


# ---- export --format inc (Neural Compressor save(format="huggingface")) -------------------------
INC_RUN_SPECIFIC = {"dump_stats_path", "_json_file", "recalc_scales"}  # INC records its own run's paths / settings


def _inc_saved(inc, measured, model_dir, work, method):
    """What INC itself saves: convert() the bf16 model from the same measurement (`method`, QDQ, lm_head blocklisted
    like hqtflow's default), then save(format="huggingface"). A few seconds on CPU."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(measured, work / "meas")  # INC writes its scale files next to the measurement
    cfg = json.loads((work / "meas" / "quant_config.json").read_text())
    cfg.update(dump_stats_path=str(work / "meas" / "measure"), scale_method=method, use_qdq=True,
               blocklist={"names": ["lm_head"], "types": []})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    qmodel = inc.convert(model, inc.FP8Config(**cfg))
    inc.save(qmodel, str(work / "saved"), format="huggingface")
    return work / "saved"


@pytest.fixture(scope="module")
def inc_reference(inc, measured, tiny_llama, tmp_path_factory):
    return _inc_saved(inc, measured, tiny_llama, tmp_path_factory.mktemp("inc"), "maxabs_pow2")


@pytest.mark.parametrize("method", ["maxabs_pow2", "maxabs_arbitrary"])
def test_export_inc_layout_matches_inc(inc, measured, tiny_llama, wiki_text, checkpoint, inc_reference, method,
                                      tmp_path):
    """Byte for byte what INC saves, input scales included: INC stores 1 / bf16(1 / s), not s, for a scale s that is
    no power of two (maxabs_arbitrary, hqtflow's default method)."""
    if method != "maxabs_pow2":  # (a calibration whose input scales include some with 1 / bf16(1 / s) != s)
        measured, checkpoint = tmp_path / "m32", tmp_path / "ck"
        assert run_cli("measure", tiny_llama, "-o", measured, "--text", wiki_text, "--limit", "4",
                       "--max-length", "32").exit_code == 0
        assert run_cli("quantize", "-m", measured, "-o", checkpoint, "--scale-method", method).exit_code == 0
        inc_reference = _inc_saved(inc, measured, tiny_llama, tmp_path, method)
    out = tmp_path / "inc"
    r = run_cli("export", checkpoint, "--format", "inc", "-o", out)
    assert r.exit_code == 0, r.output
    ours, theirs = _tensors(out), _tensors(inc_reference)
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    n = "model.layers.0.self_attn.k_proj"  # GQA: [out 32, in 64] in hqtflow, transposed by INC
    assert theirs[f"{n}.weight"].dtype == torch.float8_e4m3fn and theirs[f"{n}.weight"].shape == (64, 32)
    for s in ("quant_input.scale", "quant_input.scale_inv", "dequant_weights.scale"):
        assert theirs[f"{n}.{s}"].dtype == torch.bfloat16 and theirs[f"{n}.{s}"].shape == ()
    for k in ours:  # same dtype, shape and bytes
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
        assert torch.equal(ours[k].reshape(-1).view(torch.uint8), theirs[k].reshape(-1).view(torch.uint8)), k
    if method == "maxabs_arbitrary":  # the case exercised: INC's saved input scale is not the measured one
        measured_scales = _tensors(checkpoint)
        assert any(not torch.equal(v, measured_scales[k.replace("quant_input.scale", "input_scale")].to(v.dtype))
                   for k, v in theirs.items() if k.endswith("quant_input.scale"))
        return
    cfg, ref = json.loads((out / "config.json").read_text()), json.loads((inc_reference / "config.json").read_text())
    assert set(ref) <= set(cfg)
    q, qr = cfg["quantization_config"], ref["quantization_config"]
    assert q.keys() == qr.keys()
    assert {k: v for k, v in q.items() if k not in INC_RUN_SPECIFIC} == \
        {k: v for k, v in qr.items() if k not in INC_RUN_SPECIFIC}
    assert q["mode"] == "LOAD" and q["world_size"] == -1 and q["use_qdq"] == "True" and q["blocklist"]["names"] == ["lm_head"]
    assert json.loads((out / "quantization_config.json").read_text()) == q  # INC writes it beside config.json
    assert json.loads((inc_reference / "quantization_config.json").read_text()) == qr
    assert (out / "tokenizer.json").is_file() and read_manifest(out, "hqtflow.export").data["format"] == "inc"


def test_export_inc_loads_in_inc(inc, checkpoint, tmp_path):
    """INC's own loader rebuilds the model from hqtflow's export on CPU; its logits equal hqtflow's runtime bit for
    bit once the rotary inv_freq is float32 again (INC's loader casts the whole model, buffers included, to bf16)."""
    import hqtflow

    out = tmp_path / "inc"
    assert run_cli("export", checkpoint, "--format", "inc", "-o", out).exit_code == 0
    theirs = inc.load(str(out), format="huggingface", device="cpu")
    ours, tok = hqtflow.load(checkpoint, dtype="bf16")  # INC computes in bf16
    patched = {n for n, m in theirs.named_modules() if type(m).__name__ == "PatchedLinear"}
    assert patched == set(read_manifest(out, "hqtflow.export").data["quantized"])
    r = run_cli("generate", out, "-p", "x")  # INC's layout runs in INC, not in hqtflow's runtime
    assert r.exit_code == 3 and "runs in Neural Compressor" in r.stderr, r.output
    manifest = out / "hqtflow_manifest.json"  # a format this hqtflow does not know is named, not taken for INC's
    manifest.write_text(manifest.read_text().replace('"format": "inc"', '"format": "mxfp4"'))
    r = run_cli("generate", out, "-p", "x")
    assert r.exit_code == 3 and "the export format 'mxfp4', which this hqtflow does not know" in r.stderr, r.output
    assert type(theirs.lm_head) is torch.nn.Linear
    ids = torch.tensor([tok.encode("The tower is 324 metres tall")])
    with torch.inference_mode():
        a, b = ours(ids).logits, theirs(ids).logits
    assert torch.allclose(a.float(), b.float(), atol=0.05), (a.float() - b.float()).abs().max()
    for name, buf in ours.named_buffers():
        if name.endswith("inv_freq"):
            parent, _, attr = name.rpartition(".")
            assert theirs.get_buffer(name).dtype == torch.bfloat16  # INC's cast
            theirs.get_submodule(parent).register_buffer(attr, buf.clone(), persistent=False)
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


def test_export_inc_per_channel_and_refusals(inc, measured, checkpoint, tmp_path):
    from hqtflow import models
    from hqtflow.formats.checkpoint import load_checkpoint

    # a per-channel source is re-quantized to one scale per tensor; INC still loads it and runs close to hqtflow
    pc = tmp_path / "pc"
    assert run_cli("export", checkpoint, "--format", "compressed-tensors", "--per-channel", "-o", pc).exit_code == 0
    out = tmp_path / "inc"
    r = run_cli("export", pc, "--format", "inc", "-o", out)
    assert r.exit_code == 0, r.output
    assert "re-quantized to one scale per tensor" in r.output
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["scale_method"] == "maxabs_arbitrary" and q["blocklist"]["names"] == ["lm_head"]
    t = _tensors(out)
    assert all(v.shape == () for k, v in t.items() if k.endswith(".scale") or k.endswith(".scale_inv"))
    # the same per-tensor weights as `--format compressed-tensors --per-tensor` (same re-quantization)
    pt = tmp_path / "pt"
    assert run_cli("export", pc, "--format", "compressed-tensors", "--per-tensor", "-o", pt).exit_code == 0
    tp = _tensors(pt)
    for name in read_manifest(out, "hqtflow.export").data["quantized"]:
        assert torch.equal(t[f"{name}.weight"].t().view(torch.uint8), tp[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(t[f"{name}.dequant_weights.scale"], tp[f"{name}.weight_scale"].reshape(()))
    theirs = inc.load(str(out), format="huggingface", device="cpu")
    ours = load_checkpoint(pt)
    for name, buf in ours.named_buffers():  # undo INC's bf16 cast of the rotary buffers (see above)
        if name.endswith("inv_freq"):
            parent, _, attr = name.rpartition(".")
            theirs.get_submodule(parent).register_buffer(attr, buf.clone(), persistent=False)
    ids = torch.tensor([models.load_tokenizer(pt).encode("It was the first structure to reach a height of 300 metres")])
    with torch.inference_mode():
        a, b = ours(ids).logits.float(), theirs(ids).logits.float()
    # non-power-of-two scales: INC quantizes with 1 / bf16(1 / s), within 2^-8 of s, so close but not bit-exact
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.999, (a - b).abs().max()
    # weight-only checkpoints and --per-channel/--per-tensor are refused, nothing written
    wo = tmp_path / "wo"
    assert run_cli("quantize", "-m", measured, "-o", wo, "--weight-only").exit_code == 0
    r = run_cli("export", wo, "--format", "inc", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "weight-only" in r.stderr and not (tmp_path / "x").exists()
    r = run_cli("export", checkpoint, "--format", "inc", "--per-tensor", "-o", tmp_path / "x")
    assert r.exit_code == 2 and "one scale per tensor" in r.stderr and not (tmp_path / "x").exists()


def test_no_written_file_but_the_manifest_names_the_source_model(tiny_llama, checkpoint, tmp_path):
    """The checkpoint and its exports are the files users upload: their config.json had gained transformers'
    `"_name_or_path": "<the source folder>"` (the user's home path), which save_pretrained does not write. Only the
    manifests record input paths (documented)."""
    from hqtflow.formats.artifact import MANIFEST

    cfg = json.loads((checkpoint / "config.json").read_text())
    source = json.loads((tiny_llama / "config.json").read_text())
    assert not [k for k in cfg if k.startswith("_") and k not in source]
    dirs = [checkpoint]
    for fmt in ("fp8", "compressed-tensors"):
        assert run_cli("export", checkpoint, "--format", fmt, "-o", tmp_path / fmt).exit_code == 0
        dirs.append(tmp_path / fmt)
    leaks = [f for d in dirs for f in d.rglob("*") if f.is_file() and f.name != MANIFEST
             and str(tiny_llama).encode() in f.read_bytes()]
    assert leaks == []
