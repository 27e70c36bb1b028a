"""`hqtflow quantize --disk-offload`: streamed from the safetensors files, equal tensor for tensor to the in-memory path."""

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, refused_quantize, run_cli
from hqtflow.formats.artifact import read_manifest
from hqtflow.quantize import offload

CFG = ROOT / "quantization_config"


def _measure(model, out, wiki_text):
    r = run_cli("measure", model, "-o", out, "--text", wiki_text, "--limit", "4", "--max-length", "64",
                "-c", CFG / "maxabs_measure_include_outputs.json")
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    return _measure(tiny_llama, tmp_path_factory.mktemp("off") / "meas", wiki_text)


def _quantize(meas, out, *extra):
    r = run_cli("quantize", "-m", meas, "-o", out, *extra)
    assert r.exit_code == 0, r.output
    return out


def _tensors(d):
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                assert k not in out, f"{k} is in two shards"
                out[k] = fh.get_tensor(k).clone()
    return out


def _assert_same_checkpoint(a, b):
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8) if ta[k].element_size() == 1 else ta[k],
                           tb[k].view(torch.uint8) if tb[k].element_size() == 1 else tb[k]), k
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (a, b))
    assert ca["quantization_config"] == cb["quantization_config"]
    assert ca == cb
    assert (a / "generation_config.json").is_file() == (b / "generation_config.json").is_file()


@pytest.mark.parametrize("extra", [("--scale-method", "maxabs_pow2"),
                                   ("--weight-only", "--scale-method", "act_maxabs_pow2_weights_pcs_opt_pow2"),
                                   ()])
def test_offload_equals_in_memory(measured, tmp_path, monkeypatch, extra):
    import hqtflow

    ref = _quantize(measured, tmp_path / "ref", *extra)
    monkeypatch.setattr(offload, "DEFAULT_SHARD_SIZE", 40_000)  # several shards for a tiny model
    monkeypatch.setattr(offload, "QUANT_CHUNK_ELEMS", 1000)  # several row blocks per weight
    out = _quantize(measured, tmp_path / "off", *extra, "--disk-offload")
    _assert_same_checkpoint(ref, out)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    from safetensors import safe_open

    total = 0
    for p in shards:
        with safe_open(p, "pt") as fh:
            n = [fh.get_tensor(k).nbytes for k in fh.keys()]
        assert sum(n) <= 40_000 or len(n) <= 4  # one oversized unit (a Linear's tensors) gets its own shard
        total += sum(n)
    assert index["metadata"]["total_size"] == total
    m = read_manifest(out, "hqtflow.checkpoint")
    assert m.data["disk_offload"] is True and m.data["settings"]["disk_offload"] is True
    assert "disk_offload" not in read_manifest(ref, "hqtflow.checkpoint").data
    a, tok = hqtflow.load(ref)
    b, _ = hqtflow.load(out)
    ids = torch.tensor([tok.encode("The tower is 324 metres tall.")])
    with torch.inference_mode():
        assert torch.equal(a(ids).logits, b(ids).logits)


def _fused_copy(model_dir, out):
    """The model with its weights saved under the model's own names (fused 3-D experts), not the original layout."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    return out


@pytest.mark.parametrize("model_type, layout, extra", [("mixtral", "original", ()),
                                                       ("qwen3_moe", "original", ("--gptq",)),
                                                       ("mixtral", "fused", ()),
                                                       ("mixtral", "original", ("blocklisted",))])
def test_offload_moe_experts_equal_in_memory(tiny_factory, wiki_text, tmp_path, monkeypatch, model_type, layout, extra):
    """MoE experts streamed one expert at a time from the original checkpoint's per-expert matrices (Mixtral's
    block_sparse_moe.experts.<e>.w1/w3/w2, Qwen's gate_proj/up_proj/down_proj, merged as transformers merges
    them) or from fused 3-D tensors, and experts a blocklist keeps fused gathered into their 3-D tensors: the same
    checkpoint as the in-memory path, tensor for tensor."""
    if extra == ("blocklisted",):
        cfg = tmp_path / "q.json"
        cfg.write_text(json.dumps({"mode": "QUANTIZE", "blocklist": {"types": ["MixtralExperts"], "names": ["lm_head"]}}))
        extra = ("-c", str(cfg))
    model = tiny_factory(model_type)
    if layout == "fused":
        model = _fused_copy(model, tmp_path / "fused")
    meas = tmp_path / "meas"
    r = run_cli("measure", model, "-o", meas, "--text", wiki_text, "--limit", "4", "--max-length", "64",
                *(("--hessians",) if "--gptq" in extra else ()))
    assert r.exit_code == 0, r.output
    ref = _quantize(meas, tmp_path / "ref", *extra)
    monkeypatch.setattr(offload, "QUANT_CHUNK_ELEMS", 1000)
    out = _quantize(meas, tmp_path / "off", *extra, "--disk-offload")
    _assert_same_checkpoint(ref, out)
    per_expert = any(re.search(r"\.experts\.3\.(w1|gate_proj)\.weight$", k) for k in _tensors(out))  # original names
    assert per_expert == ("-c" not in extra)


EXPERTS = "model.layers.0.block_sparse_moe.experts"
DAMAGES = {  # what is done to a tiny Mixtral's tensors (Mixtral's own names: w1 gate, w3 up, w2 down)
    "gate and up split at another row": (lambda t: t.update({
        f"{EXPERTS}.1.w1.weight": torch.cat([t[f"{EXPERTS}.1.w1.weight"], t[f"{EXPERTS}.1.w3.weight"]])[:80].clone(),
        f"{EXPERTS}.1.w3.weight": torch.cat([t[f"{EXPERTS}.1.w1.weight"], t[f"{EXPERTS}.1.w3.weight"]])[80:].clone()}),
        r"\[96, 64\] at entry 0 and \[80, 64\]|\[80, 112\] rows"),
    "a weight under two names": (lambda t: t.update({"model.layers.0.mlp.gate.weight":
                                                     t["model.layers.0.block_sparse_moe.gate.weight"] + 1}),
                                 "holds a weight twice, as model.layers.0.block_sparse_moe.gate.weight and "
                                 "model.layers.0.mlp.gate.weight"),
    "a tensor the model has no place for": (lambda t: t.update({"model.foo.bar": torch.zeros(3)}),
                                            r"no place for 1 weights \(model.foo.bar\)"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_moe_sources_are_refused_by_both_paths(tiny_factory, tmp_path, damage):
    """A source model whose tensors do not fit its config is refused in one sentence by the in-memory loader
    (transformers' own conversion errors, held back in its load report, named) and by --disk-offload's planner alike:
    both once took such a model (offload wrote gate and up re-split at the right row, dropped unknown tensors, and
    the two paths kept different copies of a weight stored twice)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hqtflow import models
    from hqtflow.errors import ModelError

    change, message = DAMAGES[damage]
    model = tmp_path / "m"
    shutil.copytree(tiny_factory("mixtral"), model)
    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=message):
        models.load_model(model, "bf16")
    with pytest.raises(ModelError, match=message):
        offload.plan_offload(model, [], dtype="bf16", weight_only=False, per_channel=False)


def test_weight_files_are_those_transformers_reads(tiny_factory, tmp_path):
    """Another .safetensors file beside model.safetensors (or beside an index's shards) is not part of the model for
    any reader (transformers ignores it; --disk-offload read it and its tensors won); an index naming a missing
    shard is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hqtflow.errors import ModelError
    from hqtflow.formats.safetensors_files import weight_files

    model = tmp_path / "m"
    shutil.copytree(tiny_factory("mixtral"), model)
    key = f"{EXPERTS}.1.w1.weight"
    save_file({key: torch.zeros_like(load_file(model / "model.safetensors")[key])}, model / "zz-old.safetensors")
    assert weight_files(model) == [model / "model.safetensors"]
    plan = offload.plan_offload(model, [], dtype="bf16", weight_only=False, per_channel=False)
    assert {e.file.name for u in plan.units for e, _ in u.parts or ()} == {"model.safetensors"}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {key: "model-00002.safetensors"}}))
    assert weight_files(model) == [model / "model.safetensors"]  # transformers prefers it to an index
    (model / "model.safetensors").rename(model / "model-00001.safetensors")
    with pytest.raises(ModelError, match="maps weights to model-00002.safetensors, which is not in"):
        offload.plan_offload(model, [], dtype="bf16", weight_only=False, per_channel=False)


def test_tensor_in_two_shards_names_both_files(tiny_llama, tmp_path):
    """A tensor stored in two shards is refused naming the two files (it named the tensor twice), by both paths."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hqtflow import models
    from hqtflow.errors import ModelError

    model = tmp_path / "m"
    shutil.copytree(tiny_llama, model, ignore=shutil.ignore_patterns("*.safetensors"))
    t = load_file(tiny_llama / "model.safetensors")
    keys = sorted(t)
    key = keys[0]
    save_file({k: t[k] for k in keys[: len(keys) // 2]}, model / "model-00001-of-00002.safetensors")
    save_file({k: t[k] for k in [key, *keys[len(keys) // 2:]]}, model / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + (i >= len(keys) // 2)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    both = f"{key} is in both model-00001-of-00002.safetensors and model-00002-of-00002.safetensors"
    with pytest.raises(ModelError, match=both):
        models.load_model(model)
    with pytest.raises(ModelError, match=both):
        offload.plan_offload(model, [], dtype="bf16", weight_only=False, per_channel=False)


@pytest.mark.parametrize("extra, unit", [(("--disk-offload",), "B"), ((), "layer")])
def test_quantize_shows_progress(measured, tmp_path, monkeypatch, extra, unit):
    """Both paths show a bar (on a terminal): bytes written (--disk-offload) or layers converted (in memory)."""
    import hqtflow.progress

    class Shown(hqtflow.progress.Progress):
        def __init__(self, enabled=True):
            super().__init__(True)

    monkeypatch.setattr(hqtflow.progress, "Progress", Shown)
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "out", *extra)
    assert r.exit_code == 0, r.output
    assert re.search(rf"quantize: 100%.*{unit}", r.stderr), r.stderr


def test_hub_cache_shards_and_tensors_transformers_drops(tiny_factory, tmp_path):
    """What transformers loads without a word must plan for --disk-offload and load in memory: a sharded model in
    the hub cache's layout (each shard a symlink into ../../blobs), the rotary inv_freq buffers older checkpoints
    store, a tied lm_head stored beside its embedding; and a model whose conversion mapping joins several tensors
    into one (Nemotron-H's experts) is no weight stored twice."""
    import os

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from hqtflow import models

    src = tiny_factory("llama", tie_word_embeddings=True)
    tensors = load_file(src / "model.safetensors")
    tensors.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)},
                   **{"lm_head.weight": tensors["model.embed_tokens.weight"].clone()})
    snapshot, blobs = tmp_path / "hub" / "snapshots" / "abc", tmp_path / "hub" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2], "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, blobs / f"blob-{name}", metadata={"format": "pt"})
        os.symlink(Path("../../blobs") / f"blob-{name}", snapshot / name)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: n for n, ks in shards.items() for k in ks}}))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            os.symlink(f, snapshot / f.name)
    assert models.resolve_model(str(snapshot)) == snapshot
    models.load_model(snapshot, "bf16")
    for names in ([], ["lm_head"]):
        offload.plan_offload(snapshot, names, dtype="bf16", weight_only=False, per_channel=False)
    cfg = AutoConfig.for_model("nemotron_h", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, hybrid_override_pattern="E*", num_hidden_layers=2,
                               layers_block_type=["moe", "full_attention"], n_routed_experts=4, moe_intermediate_size=32,
                               moe_shared_expert_intermediate_size=32, vocab_size=512, mamba_num_heads=4,
                               mamba_head_dim=16, ssm_state_size=16, n_groups=1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "nemotron_h")
    models.load_model(tmp_path / "nemotron_h", "bf16")  # its experts' up_proj were "a weight stored twice"


def test_moe_experts_fused_on_disk(tiny_factory, wiki_text, tmp_path):
    """GraniteMoE keeps its experts as 3-D tensors on disk under other names (`input_linear`, renamed by transformers
    to the experts' `gate_up_proj`): --disk-offload finds them (it once refused the model) and writes the in-memory
    path's checkpoint, which stores the experts under hqtflow's own per-expert names (there are no others), and
    says that transformers and vLLM cannot load them."""
    model = tiny_factory("granitemoe")
    meas = tmp_path / "meas"
    r = run_cli("measure", model, "-o", meas, "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output
    outs = []
    for extra in ((), ("--disk-offload",)):
        r = run_cli("quantize", "-m", meas, "-o", tmp_path / f"q{len(outs)}", *extra)
        assert r.exit_code == 0 and "Note: the MoE experts (model.layers.0.block_sparse_moe.experts and others) are " \
            "stored one by one under hqtflow's own names" in r.stdout, r.output
        outs.append(tmp_path / f"q{len(outs)}")
    _assert_same_checkpoint(*outs)
    assert "model.layers.1.block_sparse_moe.experts.3.gate_up_proj.weight" in _tensors(outs[1])
    assert read_manifest(outs[1], "hqtflow.checkpoint").data["notes"]


def test_offload_single_shard_default(measured, tmp_path):
    out = _quantize(measured, tmp_path / "off", "--disk-offload")
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    _assert_same_checkpoint(_quantize(measured, tmp_path / "ref"), out)


@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_offload_tied_embeddings(tiny_factory, wiki_text, tmp_path, monkeypatch, quantize_lm_head):
    model = tiny_factory("llama", tie_word_embeddings=True)
    meas = _measure(model, tmp_path / "m", wiki_text)
    extra = ()
    if quantize_lm_head:
        cfg = tmp_path / "all.json"
        cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "maxabs_pow2"}))
        extra = ("-c", cfg)
    ref = _quantize(meas, tmp_path / "ref", *extra)
    monkeypatch.setattr(offload, "DEFAULT_SHARD_SIZE", 50_000)
    out = _quantize(meas, tmp_path / "off", *extra, "--disk-offload")
    _assert_same_checkpoint(ref, out)
    keys = _tensors(out)
    assert ("lm_head.weight" in keys) == quantize_lm_head
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is (not quantize_lm_head)


def test_offload_refuses_low_memory(measured, tmp_path, monkeypatch):
    from hqtflow import hardware

    monkeypatch.setattr(hardware, "available_memory_bytes", lambda: 10 * 2**20)
    refused_quantize(["-m", measured, "-o", tmp_path / "out", "--disk-offload"], "Not enough free memory for --disk-offload", tmp_path, code=6)


@pytest.mark.parametrize("extra", [("--disk-offload",), ()])
def test_refuses_low_disk(measured, tmp_path, monkeypatch, extra):
    from hqtflow import hardware

    seen = []
    monkeypatch.setattr(hardware, "free_disk_bytes", lambda p: seen.append(p) or 1000)
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "out", *extra)
    assert r.exit_code == 6 and f"Error: Not enough free disk space in {tmp_path.resolve()}" in r.stderr, r.stderr
    assert seen == [tmp_path.resolve()] and list(tmp_path.iterdir()) == []  # the in-memory path's stage is gone


@pytest.mark.parametrize("extra", [("--disk-offload",), ()])
def test_free_disk_needed_is_the_checkpoint_size(measured, tmp_path, monkeypatch, extra):
    """Both paths ask for the checkpoint's size: its safetensors files exactly, the tokenizer and config files as
    large as the model's, and SMALL_FILES_BYTES for the index and manifest (a 64 MiB margin refused small disks)."""
    from hqtflow import hardware
    from hqtflow.formats import checkpoint

    ref = _quantize(measured, tmp_path / "ref", *extra)
    written = sum(f.stat().st_size for f in ref.iterdir())
    tensors = sum(f.stat().st_size for f in ref.glob("*.safetensors"))
    asked = []

    def free(p):
        asked.append(1)
        return written + checkpoint.SMALL_FILES_BYTES

    monkeypatch.setattr(hardware, "free_disk_bytes", free)
    _quantize(measured, tmp_path / "out", *extra)
    assert asked
    with pytest.raises(Exception):  # one byte of tensors less is refused: the tensor bytes are counted exactly
        monkeypatch.setattr(hardware, "free_disk_bytes", lambda p: tensors - 1)
        _quantize(measured, tmp_path / "out2", *extra)


def test_memory_estimate_names_the_largest_step(measured, tmp_path, monkeypatch):
    """The estimate is the largest step's temporaries (5 bytes an element of a bf16 weight for maxabs: the
    finiteness check) plus a row block and MEMORY_MARGIN; not 3x the largest tensor in float32 (a copied embedding)."""
    from hqtflow import hardware

    seen = []
    monkeypatch.setattr(hardware, "available_memory_bytes", lambda: seen.append(1) or 10 * 2**20)
    r = run_cli("quantize", "-m", measured, "-o", tmp_path / "out", "--disk-offload")
    assert r.exit_code == 6 and seen
    n = 128 * 64  # the tiny Llama's largest Linear (its MLP's)
    need = 5 * n + offload.BLOCK_BYTES * offload.QUANT_CHUNK_ELEMS + offload.MEMORY_MARGIN
    assert f"about {hardware.byte_size(need)} is needed (the largest step, " in r.stderr, r.stderr
    assert f"{n / 1e6:.1f}M elements x 5 bytes, plus 64.0 MiB)" in r.stderr, r.stderr


def test_offload_not_with_scales_only(measured, tmp_path):
    refused_quantize(["-m", measured, "-o", tmp_path / "out", "--disk-offload", "--scales-only"],
             "cannot be combined with --scales-only", tmp_path, code=2)


def test_resource_estimates(measured, tiny_llama):
    p = offload.plan_offload(tiny_llama, ["model.layers.0.mlp.up_proj"], dtype="bf16", weight_only=False,
                             per_channel=False)
    # the up_proj weight becomes 1 byte per element; everything else is copied in bf16
    n_up = 128 * 64
    n_all = sum(t.numel() for t in _tensors(tiny_llama).values())
    assert p.total_bytes == n_up + 2 + 2 + 2 * (n_all - n_up)
    # bf16 copies are written from the mapped file (no memory); the quantized weight: 5 bytes an element (maxabs),
    # 20 for an OPT weight scale, 5 + 2 when the source is another dtype
    unit = next(u for u in p.units if u.kind == "quant")
    block = offload.BLOCK_BYTES * offload.QUANT_CHUNK_ELEMS
    assert offload.step_memory(unit, hp_dtype=torch.bfloat16)[0] == 5 * n_up + block
    assert offload.step_memory(unit, hp_dtype=torch.bfloat16, opt_weight=True)[0] == 20 * n_up + block
    assert all(offload.step_memory(u, hp_dtype=torch.bfloat16)[0] == 0 for u in p.units if u.kind == "copy")
    p32 = offload.plan_offload(tiny_llama, ["model.layers.0.mlp.up_proj"], dtype="fp32", weight_only=False,
                               per_channel=False)
    copy = next(u for u in p32.units if u.kind == "copy")
    assert offload.step_memory(copy, hp_dtype=torch.bfloat16)[0] == 4 * copy.weight.numel  # cast: a copy


def test_side_files_are_the_sources_byte_for_byte(tiny_llama, wiki_text, tmp_path):
    """Both writers and export copy the tokenizer, chat template and generation config files as they are: a tokenizer
    without a pad token keeps none in the checkpoint (load_tokenizer sets one at load time), and generate runs."""
    import shutil

    import hqtflow
    from hqtflow.models import side_files

    src = tmp_path / "nopad"
    shutil.copytree(tiny_llama, src)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            raw = json.loads((src / name).read_text())
            raw.pop("pad_token", None)
            (src / name).write_text(json.dumps(raw, indent=3))  # an indent save_pretrained would not write
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    (src / "tokenizer.model.v3").write_bytes(b"a tokenizer file under another name")  # Mistral's, say
    appledouble = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        "  # macOS' `._` twins: never carried
    for name in ("._tokenizer.model", "._tokenizer.json", "additional_chat_templates/._tool_use.jinja"):
        (src / name).write_bytes(appledouble)
    meas = _measure(src, tmp_path / "m", wiki_text)
    ref = _quantize(meas, tmp_path / "ref")
    off = _quantize(meas, tmp_path / "off", "--disk-offload")
    assert not [*ref.rglob("._*"), *off.rglob("._*")]
    (ref / "._tokenizer.model").write_bytes(appledouble)  # one beside the checkpoint is not exported either
    r = run_cli("export", ref, "-f", "fp8", "-o", tmp_path / "exp")
    assert r.exit_code == 0, r.output
    assert not list((tmp_path / "exp").rglob("._*"))
    names = [p.relative_to(src) for p in side_files(src)]
    assert {Path("tokenizer_config.json"), Path("additional_chat_templates/tool_use.jinja"),
            Path("tokenizer.model.v3")} <= set(names)
    for out in (ref, off, tmp_path / "exp"):
        for n in names:
            assert (out / n).read_bytes() == (src / n).read_bytes(), (out, n)
        assert "pad_token" not in json.loads((out / "tokenizer_config.json").read_text())
    _, tok = hqtflow.load(off)
    assert tok.pad_token == tok.eos_token
    r = run_cli("generate", off, "-p", "The tower is", "--max-new-tokens", "4")
    assert r.exit_code == 0 and r.stdout.strip(), r.output
