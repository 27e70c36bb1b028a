"""Fused MoE experts (transformers 5's 3-D `gate_up_proj` / `down_proj`) are quantized expert by expert: unfused into
one Linear pair per expert (the same function as transformers' eager loop, bit for bit), each pair scaled from its own
routed-token statistics, stored per expert in the checkpoint and run by the FP8 runtime."""

import json
import threading
from pathlib import Path

import pytest
import torch

from conftest import run_cli, sqnr
from hqtflow.formats.artifact import MANIFEST


def _eager(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, experts_implementation="eager").eval()


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe"])
def test_unfused_experts_compute_the_eager_loop(tiny_factory, model_type):
    from hqtflow.quantize.experts import Experts, unfuse_experts

    model = _eager(tiny_factory(model_type))
    ids = torch.randint(0, 500, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        fused = dict(model.named_modules())["model.layers.0.mlp.experts"]
        names = unfuse_experts(model)
        out = model(ids).logits
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert torch.equal(out, ref)
    experts = model.get_submodule(names[0])
    assert isinstance(experts, Experts) and experts.num_experts == fused.gate_up_proj.shape[0]
    # views of the fused weights, not copies
    w1 = experts.get_submodule("1.gate_up_proj").weight
    assert w1.untyped_storage().data_ptr() == fused.gate_up_proj.untyped_storage().data_ptr()
    assert torch.equal(w1, fused.gate_up_proj[1]) and torch.equal(experts.get_submodule("2.down_proj").weight, fused.down_proj[2])


def test_an_experts_module_of_another_function_is_refused():
    """An experts class whose forward is not Mixtral's loop (here: a scaled output) is not quantized one by one."""
    from torch import nn

    from hqtflow.errors import ModelError
    from hqtflow.quantize.experts import Experts, _unfused, unfuse_experts

    class Scaled(nn.Module):  # Mixtral's parameters, another function
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(3, 8, 4))
            self.down_proj = nn.Parameter(torch.randn(3, 4, 4))
            self.act_fn = nn.functional.silu

        def forward(self, h, idx, w):
            return 2 * Experts.forward(_unfused(self), h, idx, w)

    holder = nn.Module()
    holder.experts = Scaled()
    with pytest.raises(ModelError, match="does not compute Mixtral's expert loop"):
        unfuse_experts(holder)


@pytest.fixture(scope="module")
def moe(tiny_factory, wiki_text, tmp_path_factory):
    """A tiny Mixtral measured (with Hessians) and quantized, nearest rounding and GPTQ."""
    d = tmp_path_factory.mktemp("moe")
    model = tiny_factory("mixtral")
    r = run_cli("measure", model, "-o", d / "m", "--text", wiki_text, "--limit", "8", "--max-length", "64", "--hessians")
    assert r.exit_code == 0, r.output
    r = run_cli("quantize", model, "-m", d / "m", "-o", d / "q")
    assert r.exit_code == 0, r.output
    return model, d, r.stdout + r.stderr


def _expert_linears(n_layers=2, n_experts=4):
    return [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(n_layers) for e in range(n_experts)
            for p in ("gate_up_proj", "down_proj")]


def test_every_expert_is_quantized_from_its_own_statistics(moe):
    from hqtflow.formats.checkpoint import read_tensors, skeleton_of
    from hqtflow.formats.hf_names import to_model_names
    from hqtflow.formats.measurement import load_measurement
    from hqtflow.scales import linear_scales, scale_method

    model_dir, d, said = moe
    manifest = json.loads((d / "q" / MANIFEST).read_text())["data"]
    assert set(_expert_linears()) <= set(manifest["quantized"]), manifest["quantized"]
    assert not [k for k in manifest["skipped"] if "experts" in k], manifest["skipped"]
    assert f"{len(manifest['quantized'])} modules quantized" in said
    on_disk = read_tensors(d / "q")
    assert not [k for k in on_disk if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]  # no fused copy left
    # the original checkpoint's names: Mixtral's block_sparse_moe.experts.<e>.w1 (gate), w3 (up), w2 (down)
    assert {k for k in on_disk if k.endswith(".weight")} == set(read_tensors(model_dir))
    tensors = to_model_names(skeleton_of(d / "q"), on_disk)
    for e in range(4):  # gate and up: two tensors with the same scales, concatenated they are the expert's gate_up
        disk = f"model.layers.1.block_sparse_moe.experts.{e}"
        assert torch.equal(on_disk[f"{disk}.w1.input_scale"], on_disk[f"{disk}.w3.input_scale"])
        assert torch.equal(on_disk[f"{disk}.w1.weight_scale"], on_disk[f"{disk}.w3.weight_scale"])
        assert torch.equal(tensors[f"model.layers.1.mlp.experts.{e}.gate_up_proj.weight"].view(torch.uint8),
                           torch.cat([on_disk[f"{disk}.w1.weight"], on_disk[f"{disk}.w3.weight"]]).view(torch.uint8))
    meas = load_measurement(d / "m").ranks[0]
    bf16 = _eager(model_dir)
    method = scale_method("maxabs_arbitrary", "cpu")
    input_scales = set()
    for name in _expert_linears():
        container, e, proj = name.rsplit(".", 2)
        w = getattr(bf16.get_submodule(container), proj)[int(e)]
        want = linear_scales(method, meas.nodes[name].inputs[0], w)
        assert tensors[f"{name}.weight"].dtype == torch.float8_e4m3fn and list(tensors[f"{name}.weight"].shape) == list(w.shape)
        assert torch.equal(tensors[f"{name}.weight_scale"].reshape(()), want.weight.reshape(())), name
        assert torch.equal(tensors[f"{name}.input_scale"].reshape(()), want.input.reshape(())), name
        input_scales.add(float(want.input))
    assert len(input_scales) > 4  # each expert saw its own tokens


def test_checkpoint_runs_as_converted_and_close_to_bf16(moe, wiki_text, cpu_kernel_loaded):
    import hqtflow
    from hqtflow.quantize.experts import Experts
    from hqtflow.quantize.fp8_linear import FP8Linear
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

    model_dir, d, _ = moe
    loaded = hqtflow.load(d / "q", backend="qdq", dtype="bf16")[0]
    experts = loaded.get_submodule("model.layers.1.mlp.experts")
    assert isinstance(experts, Experts) and isinstance(experts.get_submodule("3.down_proj"), FP8Linear)
    converted, _ = quantize_in_memory(QuantizeSettings(measurement=str(d / "m"), output=str(d / "unused")))
    converted.eval()
    from hqtflow.models import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids = tok(wiki_text.read_text()[:4000], return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        a, b = loaded(ids).logits, converted(ids).logits
        ref = _eager(model_dir)(ids).logits
    assert torch.equal(a, b)  # the checkpoint is the in-memory conversion
    assert sqnr(ref, a) > 25, sqnr(ref, a)  # FP8 experts and attention vs bf16 on real text
    fast = hqtflow.load(d / "q", backend="cpu", dtype="bf16")[0]
    with torch.no_grad():
        c = fast(ids).logits
    assert sqnr(a, c) > 40, sqnr(a, c)  # the CPU kernel: the reference's function, fp32 sums in another order


def test_fp8_experts_are_batch_invariant(moe, cpu_kernel_loaded):
    """A token's output from the FP8 experts (CPU kernel) does not depend on the other tokens routed with it."""
    import hqtflow

    _, d, _ = moe
    experts = hqtflow.load(d / "q", backend="cpu", dtype="bf16")[0].get_submodule("model.layers.0.mlp.experts")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)])
    w = torch.rand(40, 2, generator=g).bfloat16()
    with torch.no_grad():
        together = experts(x, idx, w)
        for lo, hi in ((0, 1), (5, 12), (20, 40)):
            assert torch.equal(experts(x[lo:hi], idx[lo:hi], w[lo:hi]), together[lo:hi]), (lo, hi)


def test_gptq_rounds_each_expert_with_its_own_hessian(moe):
    from hqtflow.formats.checkpoint import read_tensors
    from hqtflow.formats.hessians import Hessians

    model_dir, d, _ = moe
    h = Hessians(d / "m" / "hessians.safetensors")
    meas = json.loads((d / "m" / MANIFEST).read_text())["data"]
    tokens = meas["calibration"]["tokens"]
    for layer in range(2):
        routed = [h.tokens[h.modules[f"model.layers.{layer}.mlp.experts.{e}.gate_up_proj"]] for e in range(4)]
        assert sum(routed) == 2 * tokens, routed  # top-2: every token counted by two experts
        for e in range(4):
            down = h.modules[f"model.layers.{layer}.mlp.experts.{e}.down_proj"]
            assert h.tokens[down] == routed[e]
    r = run_cli("quantize", model_dir, "-m", d / "m", "-o", d / "gptq", "--gptq")
    assert r.exit_code == 0, r.output
    a, b = read_tensors(d / "q"), read_tensors(d / "gptq")
    name = "model.layers.0.block_sparse_moe.experts.2.w2.weight"
    assert a[name].shape == b[name].shape and not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8))


def test_an_expert_no_token_reached_stays_in_high_precision(tiny_factory, wiki_text, tmp_path):
    """Top-1 routing over 8 experts and 4 calibration tokens: the experts that saw none keep bf16, listed; the
    checkpoint still loads and runs."""
    import hqtflow

    model = tiny_factory("mixtral", num_local_experts=8, num_experts_per_tok=1)
    r = run_cli("measure", model, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "1", "--max-length", "4")
    assert r.exit_code == 0, r.output
    nodes = set(json.loads((tmp_path / "m" / "measure_hooks_maxabs_mod_list.json").read_text()))
    unrouted = {n for n in _expert_linears(2, 8) if n not in nodes}
    assert unrouted, "every expert was reached: the case is not exercised"
    r = run_cli("quantize", model, "-m", tmp_path / "m", "-o", tmp_path / "q")
    assert r.exit_code == 0, r.output
    skipped = json.loads((tmp_path / "q" / MANIFEST).read_text())["data"]["skipped"]
    assert {k for k, v in skipped.items() if "no calibration token was routed" in v} == unrouted
    loaded = hqtflow.load(tmp_path / "q", backend="qdq")[0]
    name = sorted(unrouted)[0]
    assert type(loaded.get_submodule(name)).__name__ == "Linear"
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.tensor([[1, 2, 3, 4, 5]])).logits).all()


def test_export_of_moe_experts(moe, tmp_path):
    import hqtflow

    _, d, _ = moe
    r = run_cli("export", d / "q", "--format", "inc", "-o", tmp_path / "inc")
    assert r.exit_code != 0 and "MoE experts quantized one by one" in r.stderr and "Traceback" not in r.output, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "inc").exists()
    r = run_cli("export", d / "q", "--format", "fp8", "-o", tmp_path / "fp8")
    assert r.exit_code == 0 and "MoE" not in r.stdout + r.stderr, r.output  # the original names: nothing to say
    from hqtflow.formats.checkpoint import read_tensors

    exported = read_tensors(tmp_path / "fp8")
    assert exported["model.layers.0.block_sparse_moe.experts.3.w3.weight_scale"].shape == ()  # AutoFP8's scalars
    ids = torch.tensor([[5, 9, 13, 2, 77, 31]])
    with torch.no_grad():
        a = hqtflow.load(d / "q", backend="qdq", dtype="bf16")[0](ids).logits
        b = hqtflow.load(tmp_path / "fp8", backend="qdq", dtype="bf16")[0](ids).logits
    assert torch.equal(a, b)  # per-tensor bf16 scales are exact in float32


def test_engine_serves_fp8_experts_batch_invariantly(moe, cpu_kernel_loaded):
    """The serving engine on the FP8 MoE checkpoint: each request's greedy tokens and logprobs are the same alone and
    decoded together with the others, and equal a full recompute of the FP8 model."""
    import hqtflow
    from hqtflow.runtime.engine import Engine, SamplingParams

    _, d, _ = moe
    model, tok = hqtflow.load(d / "q", backend="cpu", dtype="auto")  # the kernel's dtype: bf16 or fp32 by machine
    prompts = [tok(p)["input_ids"] for p in ("The tower is", "In 1990 the band released their second album , which", "A")]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    eng = Engine(model, tok, max_batch_size=4).start()
    try:
        alone = [eng.generate(x, params) for x in prompts]
        together: list = [None] * len(prompts)
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, eng.generate(prompts[i], params)))
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        eng.stop()
    for x, a, b in zip(prompts, alone, together):
        assert [(e.token.id, e.token.logprob) for e in a] == [(e.token.id, e.token.logprob) for e in b]
        tokens = [e.token.id for e in a]
        with torch.inference_mode():
            ref = model(torch.tensor([x + tokens[:-1]]), use_cache=False).logits[0, len(x) - 1:]
        assert tokens == ref.argmax(-1).tolist()


def test_routers_run_on_the_kernel_batch_invariantly(moe, cpu_kernel_loaded):
    """transformers' routers call `F.linear` on a plain weight; on the "cpu" backend that product runs on the kernel,
    so a token's routing weights do not depend on the tokens beside it, and equal `F.linear`'s up to the sums' order."""
    import hqtflow
    from hqtflow.quantize.bf16_linear import kernel_dtype
    from hqtflow.quantize.fp8_linear import set_backend

    _, d, _ = moe
    dtype = "bf16" if kernel_dtype() == torch.bfloat16 else "fp32"
    model = hqtflow.load(d / "q", backend="cpu", dtype=dtype)[0]
    router = model.get_submodule("model.layers.0.mlp.gate")
    assert router.hqtflow_packed is not None
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(5)).to(kernel_dtype())
    with torch.no_grad():
        together = router(x)
        for lo, hi in ((0, 1), (3, 11), (11, 37)):
            for a, b in zip(router(x[lo:hi]), together):
                assert torch.equal(a, b[lo:hi]), (lo, hi)
        set_backend(model, "qdq")  # back to transformers' own forward
        assert "forward" not in router.__dict__
        ref = router(x)
    torch.testing.assert_close(together[0].float(), ref[0].float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(together[2], ref[2]) or (together[2] != ref[2]).float().mean() < 0.05


def test_scales_only_and_a_container_blocklisted_by_name_keep_the_experts_fused(moe, tmp_path):
    """INC's scale files have no entry for fused experts: --scales-only lists them as kept, never as quantized; a
    blocklist name that matches the experts module (not its per-expert children) keeps them fused too."""
    model_dir, d, _ = moe
    r = run_cli("quantize", model_dir, "-m", d / "m", "-o", tmp_path / "so", "--scales-only")
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "so" / MANIFEST).read_text())["data"]
    assert not [n for n in data["quantized"] if "experts" in n]
    assert {k for k, v in data["skipped"].items() if "INC's scale files" in v} == {
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    cfg = tmp_path / "q.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "blocklist": {"names": ["lm_head", r"layers\.1\.mlp\.experts$"]}}))
    r = run_cli("quantize", model_dir, "-m", d / "m", "-o", tmp_path / "bl", "-c", cfg)
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "bl" / MANIFEST).read_text())["data"]
    assert data["skipped"]["model.layers.1.mlp.experts"] == "excluded by blocklist"
    assert not [n for n in data["quantized"] if "layers.1.mlp.experts" in n]
    assert "model.layers.0.mlp.experts.0.gate_up_proj" in data["quantized"]
    import hqtflow
    from hqtflow.quantize.experts import Experts

    model = hqtflow.load(tmp_path / "bl", backend="qdq")[0]  # one layer's experts per expert, the other's fused
    assert isinstance(model.get_submodule("model.layers.0.mlp.experts"), Experts)
    assert not isinstance(model.get_submodule("model.layers.1.mlp.experts"), Experts)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 1, 4, 1, 5]])).logits).all()


def test_transformers_loads_the_moe_checkpoint(moe, tmp_path):
    """transformers' compressed-tensors integration reads the MoE checkpoint (the original per-expert names, which its
    conversion mapping merges into fused experts): its dequantized experts are hqtflow's, expert for expert, and so
    are its logits with the eager expert loop."""
    import importlib.util

    import hqtflow
    from conftest import need
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    need(importlib.util.find_spec("compressed_tensors") is not None, "compressed-tensors is not installed")
    model_dir, d, _ = moe
    r = run_cli("quantize", model_dir, "-m", d / "m", "-o", tmp_path / "wo", "--weight-only")
    assert r.exit_code == 0, r.output
    ours = hqtflow.load(tmp_path / "wo", backend="qdq", dtype="bf16")[0]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "wo", quantization_config=CompressedTensorsConfig(dequantize=True),
                                                  dtype=torch.bfloat16, experts_implementation="eager").eval()
    for layer in range(2):
        fused = theirs.model.layers[layer].mlp.experts
        for e in range(4):
            mine = ours.get_submodule(f"model.layers.{layer}.mlp.experts.{e}")
            assert torch.equal(fused.gate_up_proj[e], mine.gate_up_proj.dequantized_weight())
            assert torch.equal(fused.down_proj[e], mine.down_proj.dequantized_weight())
    ids = torch.tensor([[5, 9, 13, 2, 77, 31, 8, 100, 4, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=0, atol=0)


def test_a_foreign_moe_checkpoint_with_gate_and_up_scaled_apart(moe, tmp_path):
    """A checkpoint made elsewhere (llm-compressor's layout: per-expert w1/w3/w2, each with its own scales) loads:
    gate and up with different weight scales become one per-channel scale, their input scales (one input) the
    larger, as vLLM does."""
    import shutil

    from safetensors.torch import save_file

    from hqtflow.formats.checkpoint import load_checkpoint, read_tensors

    _, d, _ = moe
    out = tmp_path / "foreign"
    shutil.copytree(d / "q", out)
    (out / MANIFEST).unlink()
    t = read_tensors(out)
    e0 = "model.layers.0.block_sparse_moe.experts.0"
    t[f"{e0}.w3.weight_scale"] = t[f"{e0}.w3.weight_scale"] * 2
    t[f"{e0}.w1.input_scale"] = t[f"{e0}.w3.input_scale"] * 1.5
    save_file({k: v.contiguous() for k, v in t.items()}, out / "model.safetensors")
    model = load_checkpoint(out)
    gu = model.get_submodule("model.layers.0.mlp.experts.0.gate_up_proj")
    half = gu.out_features // 2
    assert gu.per_channel and gu.weight_scale.shape == (2 * half, 1)
    want = torch.cat([t[f"{e0}.w1.weight"].float() * t[f"{e0}.w1.weight_scale"].float(),
                      t[f"{e0}.w3.weight"].float() * t[f"{e0}.w3.weight_scale"].float()])
    assert torch.equal(gu.dequantized_weight().float(), want.to(gu.hp_dtype).float())
    assert torch.equal(gu.input_scale, t[f"{e0}.w1.input_scale"].reshape(1))
    other = model.get_submodule("model.layers.0.mlp.experts.1.gate_up_proj")
    assert not other.per_channel  # equal scales stay one per tensor
    from hqtflow.errors import ArtifactError

    for edit, message in ((lambda t: t.__setitem__(f"{e0}.w3.weight", t[f"{e0}.w3.weight"].bfloat16()), "differ in dtype"),
                          (lambda t: t.__setitem__(f"{e0}.w3.weight", t[f"{e0}.w3.weight"][:, :5].contiguous()), "differ in dtype or shape"),
                          (lambda t: t.pop(f"{e0}.w3.weight"), "expert 0 of model.layers.0.mlp.experts has only 1 of the 2 `weight`"),
                          (lambda t: t.__setitem__("model.layers.0.mlp.experts.0.gate_up_proj.weight_scale",
                                                   t[f"{e0}.w1.weight_scale"].clone()), "both whole and in parts"),
                          (lambda t: t.__setitem__("model.layers.0.mlp.gate.weight", t["model.layers.0.block_sparse_moe.gate.weight"].clone()),
                           "two tensors are the model's model.layers.0.mlp.gate.weight")):
        bad = dict(t)
        edit(bad)
        save_file({k: v.contiguous() for k, v in bad.items()}, out / "model.safetensors")
        with pytest.raises(ArtifactError, match=message):
            load_checkpoint(out)
        r = run_cli("generate", out, "-p", "a", "--max-new-tokens", "1")
        assert r.exit_code != 0 and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1, r.output


def _blockwise_fp8(model_dir, out, block: int):
    """`model_dir` (its original per-expert names) as a DeepSeek/Qwen-style FP8 checkpoint made elsewhere: AutoFP8's
    `quant_method: fp8`, [block, block] weight blocks with `weight_scale_inv`, dynamic activations."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    t = load_file(out / "model.safetensors")
    for k in [k for k in t if re.search(r"(self_attn\.[qkvo]_proj|experts\.\d+\.(gate|up|down)_proj)\.weight$", k)]:
        w = t[k].float()
        rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
        pad = torch.zeros(rows * block, cols * block)
        pad[: w.shape[0], : w.shape[1]] = w
        s = pad.reshape(rows, block, cols, block).abs().amax(dim=(1, 3)) / 448
        full = s.repeat_interleave(block, 0).repeat_interleave(block, 1)[: w.shape[0], : w.shape[1]]
        t[k] = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        t[k.replace(".weight", ".weight_scale_inv")] = s
    save_file(t, out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(cfg))
    return t


def test_a_foreign_blockwise_moe_checkpoint(tiny_factory, tmp_path):
    """Qwen3-MoE FP8 as Qwen and DeepSeek publish it (block-wise weights, `weight_scale_inv`, per-expert gate_proj/
    up_proj/down_proj): each expert's gate and up join into one FP8 Linear whose dequantized weight is theirs, block
    for block; blocks that would straddle gate and up are refused in one sentence."""
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.checkpoint import load_checkpoint
    from hqtflow.quantize.fp8_linear import FP8Linear

    src = tiny_factory("qwen3_moe")  # moe_intermediate_size 48: 3 blocks of 16 rows each for gate and up
    t = _blockwise_fp8(src, tmp_path / "fp8", 16)
    model = load_checkpoint(tmp_path / "fp8")
    gu = model.get_submodule("model.layers.1.mlp.experts.5.gate_up_proj")
    assert isinstance(gu, FP8Linear) and gu.block_size == (16, 16) and gu.activation == "dynamic_group"
    disk = "model.layers.1.mlp.experts.5"

    def dq(name):
        w, s = t[f"{name}.weight"].float(), t[f"{name}.weight_scale_inv"]
        return w * s.repeat_interleave(16, 0).repeat_interleave(16, 1)[: w.shape[0], : w.shape[1]]

    want = torch.cat([dq(f"{disk}.gate_proj"), dq(f"{disk}.up_proj")]).to(gu.hp_dtype)
    assert torch.equal(gu.dequantized_weight(), want)
    ref = _eager(src)
    ids = torch.tensor([[5, 9, 13, 2, 77, 31, 8, 100]])
    with torch.no_grad():
        assert sqnr(ref(ids).logits, model(ids).logits) > 20
    _blockwise_fp8(src, tmp_path / "fp8-32", 32)
    with pytest.raises(ArtifactError, match=r"gate and up have \[48, 48\] rows, not whole blocks of 32"):
        load_checkpoint(tmp_path / "fp8-32")


def test_a_damaged_moe_checkpoint_is_refused(moe, tmp_path):
    """What once loaded from an edited MoE checkpoint: gate and up of an expert re-split at another row (the merged
    shape right), a router stored in FP8 (it ran as FP8 bytes; export raised a KeyError), a weight file the manifest
    does not list. A .safetensors file beside model.safetensors is not part of the checkpoint (transformers ignores
    it; hqtflow once read it and its tensors replaced the hash-checked ones)."""
    import hashlib
    import shutil

    from safetensors.torch import load_file, save_file

    import hqtflow
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.checkpoint import load_checkpoint

    _, d, _ = moe
    experts = "model.layers.0.block_sparse_moe.experts"
    ck = tmp_path / "ck"
    shutil.copytree(d / "q", ck)
    original = load_file(ck / "model.safetensors")
    save_file({f"{experts}.1.w1.weight": torch.zeros_like(original[f"{experts}.1.w1.weight"])}, ck / "zz-extra.safetensors")
    model = hqtflow.load(ck, backend="qdq")[0]  # verified; the stray file not read
    assert torch.equal(model.get_submodule("model.layers.0.mlp.experts.1.gate_up_proj").weight[:96].view(torch.uint8),
                       original[f"{experts}.1.w1.weight"].view(torch.uint8))

    def damaged(change) -> Path:
        out = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d / "q", out)
        tensors = dict(original)
        change(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        manifest = json.loads((out / MANIFEST).read_text())  # hashes rewritten: the deeper checks must catch it
        manifest["files"]["model.safetensors"] = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
        (out / MANIFEST).write_text(json.dumps(manifest))
        return out

    gate_up = torch.cat([original[f"{experts}.1.w1.weight"], original[f"{experts}.1.w3.weight"]])
    resplit = damaged(lambda t: t.update({f"{experts}.1.w1.weight": gate_up[:80].clone(),
                                          f"{experts}.1.w3.weight": gate_up[80:].clone()}))
    with pytest.raises(ArtifactError, match=r"gate_up_proj parts of \[80, 112\] rows; the model's config gives each 96"):
        load_checkpoint(resplit)
    router = "model.layers.0.block_sparse_moe.gate.weight"
    fp8_router = damaged(lambda t: t.update({router: t[router].to(torch.float8_e4m3fn)}))
    with pytest.raises(ArtifactError, match="mlp.gate.weight is stored in torch.float8_e4m3fn but is not the weight of a Linear"):
        load_checkpoint(fp8_router)
    r = run_cli("export", fp8_router, "--format", "fp8", "-o", tmp_path / "ex")
    assert r.exit_code == 3 and "is not the weight of a Linear" in r.stderr and "Traceback" not in r.output, r.output
    e5m2 = damaged(lambda t: t.update({k: t[k].float().to(torch.float8_e5m2) for k in
                                       (f"{experts}.1.w1.weight", f"{experts}.1.w3.weight")}))
    r = run_cli("export", e5m2, "--format", "fp8", "-o", tmp_path / "ex")  # once copied through into an E4M3 layout
    assert r.exit_code == 3 and "holds float8_e5m2 weights" in r.stderr, r.output
    manifest = json.loads((ck / MANIFEST).read_text())
    del manifest["files"]["model.safetensors"]
    (ck / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="model.safetensors is not in its manifest"):
        hqtflow.load(ck)


def test_expert_statistics_that_cannot_be_the_models_are_refused(moe, tmp_path):
    """A measurement (hashes rewritten after the edit) with statistics for an expert the layer does not have is
    refused (it was ignored); an expert's down_proj without statistics while its gate_up_proj has some (a config
    that excluded it when measuring, or an edit) stays in bf16 with that reason, not "no token was routed to it"."""
    import hashlib
    import shutil

    model_dir, d, _ = moe
    stem, experts = "measure_hooks_maxabs", "model.layers.0.mlp.experts"

    def edited(fn):
        m = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d / "m", m)
        raw = json.loads((m / f"{stem}.json").read_text())
        fn(raw["Nodes"])
        (m / f"{stem}.json").write_text(json.dumps(raw))
        manifest = json.loads((m / MANIFEST).read_text())
        manifest["files"] = {k: hashlib.sha256((m / k).read_bytes()).hexdigest() for k in manifest["files"]}
        (m / MANIFEST).write_text(json.dumps(manifest))
        return m

    extra = edited(lambda n: n.update({f"{experts}.7.{p}": n[f"{experts}.0.{p}"] for p in ("gate_up_proj", "down_proj")}))
    r = run_cli("quantize", model_dir, "-m", extra, "-o", tmp_path / "out")
    assert r.exit_code == 3 and f"statistics for expert 7 of {experts}, which has 4 experts" in r.stderr, r.output
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()
    half = edited(lambda n: n.pop(f"{experts}.2.down_proj"))
    r = run_cli("quantize", model_dir, "-m", half, "-o", tmp_path / "out")
    assert r.exit_code == 0, r.output
    skipped = json.loads((tmp_path / "out" / MANIFEST).read_text())["data"]["skipped"]
    assert skipped[f"{experts}.2.down_proj"] == "MoE expert projection without statistics (not measured; its gate_up_proj was)"
