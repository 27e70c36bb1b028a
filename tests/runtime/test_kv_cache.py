"""FP8 KV cache: KV statistics in the measurement, k/v scales in the checkpoint, the FP8 static cache at run time."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import assert_same_decode, count_skeletons, decode_to_the_last_slot, emulated_capture, run_cli
from hqtflow.formats.measurement import KV_FILE
from hqtflow.measure.kv import KVStats
from hqtflow.scales import dequantize, quantize


@pytest.fixture(scope="module")
def artifacts(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv")
    assert run_cli("measure", tiny_llama, "-o", out / "m", "--text", wiki_text, "--limit", "4").exit_code == 0
    r = run_cli("quantize", "-m", out / "m", "-o", out / "fp8", "--kv-cache", "fp8")
    assert r.exit_code == 0, r.stdout + r.stderr
    return out


def test_observer_cache_sees_what_is_cached_without_padding(tiny_llama):
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    ids = torch.randint(5, 500, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding in row 1
    stats = KVStats(model)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, past_key_values=stats.cache(mask), use_cache=True)
        plain = DynamicCache()
        model(input_ids=ids, attention_mask=mask, past_key_values=plain, use_cache=True)
    valid = mask[:, None, :, None].bool()
    assert sorted(stats.maxabs) == list(range(model.config.num_hidden_layers))
    for i, layer in enumerate(plain.layers):
        k = layer.keys.masked_fill(~valid, 0).abs().amax().item()
        v = layer.values.masked_fill(~valid, 0).abs().amax().item()
        assert stats.maxabs[i] == [k, v]
    names = stats.layers()
    assert list(names) == [f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)]


def test_scales_in_the_checkpoint(artifacts, tmp_path):
    stats = json.loads((artifacts / "m" / KV_FILE).read_text())["layers"]
    cfg = json.loads((artifacts / "fp8" / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                      "group_size": None, "strategy": "tensor"}
    with safe_open(artifacts / "fp8" / "model.safetensors", "pt") as f:
        for name, kv in stats.items():
            for x in "kv":  # maxabs_arbitrary's activation rule, as for Linear inputs: maxabs / (448 * backoff 0.25)
                expect = (torch.tensor(kv[x]).to(torch.bfloat16) / 112.0).float()
                assert torch.equal(f.get_tensor(f"{name}.{x}_scale"), expect.reshape(()))
    # --disk-offload writes the same tensors
    r = run_cli("quantize", "-m", artifacts / "m", "-o", tmp_path / "off", "--kv-cache", "fp8", "--disk-offload")
    assert r.exit_code == 0, r.stdout + r.stderr
    with safe_open(artifacts / "fp8" / "model.safetensors", "pt") as a, safe_open(tmp_path / "off" / "model.safetensors", "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    assert json.loads((tmp_path / "off" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]


def test_fp8_cache_layer_stores_qdq_values(artifacts):
    from hqtflow.evaluate import load_any
    from hqtflow.runtime.kv_cache import FP8StaticCache, kv_scales

    model, _, _ = load_any(str(artifacts / "fp8"), backend="qdq")
    scales = kv_scales(model)
    assert len(scales) == model.config.num_hidden_layers and all(k.dtype == torch.float32 for k, _ in scales)
    cache = FP8StaticCache(model.config, 16, scales)
    k = torch.randn(2, 2, 3, 8, dtype=torch.bfloat16) * 2
    v = torch.randn(2, 2, 3, 8, dtype=torch.bfloat16)
    keys, values = cache.layers[0].update(k, v)
    assert cache.layers[0].keys.dtype == torch.float8_e4m3fn and keys.dtype == torch.bfloat16
    s_k, s_v = scales[0]
    assert torch.equal(keys[:, :, :3], dequantize(quantize(k, s_k), s_k, torch.bfloat16))
    assert torch.equal(values[:, :, :3], dequantize(quantize(v, s_v), s_v, torch.bfloat16))
    assert not keys[:, :, 3:].any()


def test_decode_with_fp8_kv_cache(artifacts):
    """The FP8 KV cache moves the next-token distribution only a little, and the static decoder decodes through it.

    Teacher-forced on prompt + the high-precision greedy tokens, KL(high-precision cache || FP8 cache) per position
    (measured at most 8e-5 here). A random tiny model's next-token distribution is nearly uniform (entropy ~6.2 nats
    of ln 512), so its greedy tokens are no measure of closeness: the decoder's own prefill must give the token the
    same FP8-cache forward picks."""
    from hqtflow.evaluate import load_any
    from hqtflow.runtime.kv_cache import FP8StaticCache, kv_scales
    from hqtflow.runtime.static_decode import StaticDecoder

    model, _, _ = load_any(str(artifacts / "fp8"), backend="qdq")
    ids = torch.randint(5, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    hp = StaticDecoder(model, max_length=40).generate(ids, 16).tokens
    fp8 = StaticDecoder(model, max_length=40, kv_cache="fp8").generate(ids, 16).tokens
    seq = torch.cat([ids, hp], 1)
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=seq).logits.float(), -1)
        cache = FP8StaticCache(model.config, seq.shape[1], kv_scales(model))
        q = torch.log_softmax(model(input_ids=seq, past_key_values=cache).logits.float(), -1)
    kl = (ref.exp() * (ref - q)).sum(-1)
    assert 0 < kl.max() < 1e-3, kl.max()  # quantized (not a no-op), and close
    assert fp8.shape == hp.shape and torch.equal(fp8[:, 0], q[:, ids.shape[1] - 1].argmax(-1))


def test_fp8_cache_graph_capture_leaves_the_cache_as_the_eager_step_does(artifacts, monkeypatch):
    """The FP8 cache's layer advances its write counter in place too: with CUDA-graph capture emulated on the CPU
    (eager warm-ups, a recording that runs nothing, replays), the graphed decode equals the eager one, cache included."""
    import hqtflow.runtime.cuda_graphs as cuda_graphs
    from hqtflow.evaluate import load_any
    from hqtflow.runtime.static_decode import StaticDecoder

    monkeypatch.setattr(cuda_graphs, "capture", emulated_capture)
    model, _, _ = load_any(str(artifacts / "fp8"), backend="qdq")
    ids = torch.randint(5, 500, (2, 10), generator=torch.Generator().manual_seed(3))
    eager = decode_to_the_last_slot(StaticDecoder(model, max_length=20, kv_cache="fp8", cuda_graph=False), ids, 10)
    graphed = StaticDecoder(model, max_length=20, kv_cache="fp8", cuda_graph=True)
    assert_same_decode(decode_to_the_last_slot(graphed, ids, 10), eager)
    assert graphed.graph_failed is None and graphed._graphs


def test_cli_kv_cache_paths(artifacts, tiny_llama, wiki_text, tmp_path):
    r = run_cli("generate", artifacts / "fp8", "--engine", "static", "--kv-cache", "fp8", "--max-new-tokens", "6")
    assert r.exit_code == 0 and r.stdout.strip(), r.stdout + r.stderr
    r = run_cli("generate", artifacts / "fp8", "--kv-cache", "fp8", "--max-new-tokens", "6")  # the serving engine's
    assert r.exit_code == 0 and r.stdout.strip(), r.stdout + r.stderr
    r = run_cli("generate", artifacts / "fp8", "--kv-cache", "fp8", "--engine", "transformers")
    assert r.exit_code == 2 and "--engine static" in r.stderr
    r = run_cli("generate", artifacts / "fp8", "--kv-cache", "int4", "--engine", "static")
    assert r.exit_code == 2 and "bf16 or fp8" in r.stderr
    plain = tmp_path / "plain"
    assert run_cli("quantize", "-m", artifacts / "m", "-o", plain).exit_code == 0
    r = run_cli("generate", plain, "--engine", "static", "--kv-cache", "fp8")
    assert r.exit_code == 2 and "--kv-cache fp8" in r.stderr
    # a measurement without KV statistics (a foreign HQT dump: only its JSON/npz files)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for p in (artifacts / "m").iterdir():
        if p.name.startswith("measure_hooks_maxabs"):
            (foreign / p.name).write_bytes(p.read_bytes())
    assert run_cli("import-hqt", foreign, "-o", tmp_path / "imported").exit_code == 0
    r = run_cli("quantize", tiny_llama, "-m", tmp_path / "imported", "-o", tmp_path / "x", "--kv-cache", "fp8")
    assert r.exit_code == 3 and "no KV-cache statistics" in r.stderr and not (tmp_path / "x").exists()
    r = run_cli("quantize", "-m", artifacts / "m", "-o", tmp_path / "y", "--kv-cache", "fp8", "--scales-only")
    assert r.exit_code == 2 and "--scales-only" in r.stderr


# attention with fused projections, the name of its attention module, and the engines that run it (the serving
# engine refuses Falcon's attention, which does not go through transformers' attention interface)
FUSED = {"phi3": ("model.layers.{}.self_attn", ("serve", "static")),  # qkv_proj
         "falcon": ("transformer.h.{}.self_attention", ("static",)),  # query_key_value
         "gpt_neox": ("gpt_neox.layers.{}.attention", ("serve", "static")),  # query_key_value
         "gpt_bigcode": ("transformer.h.{}.attn", ("serve", "static"))}  # c_attn


@pytest.mark.parametrize("model_type", FUSED)
def test_fused_qkv_projection(model_type, tiny_factory, wiki_text, tmp_path):
    """Attention that projects q, k and v in one Linear (Phi-3's qkv_proj, Falcon's and GPT-NeoX's query_key_value,
    GPT-BigCode's c_attn): its KV statistics were keyed layer0/layer1 (only k_proj named an attention module) and
    quantize --kv-cache fp8 refused them as naming modules the model lacks. They are taken from what the attention
    module caches, so a fused projection is measured, scaled (k/v scales on the attention module) and served the same."""
    attention, engines = FUSED[model_type]
    path = tiny_factory(model_type)
    assert run_cli("measure", path, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2").exit_code == 0
    stats = json.loads((tmp_path / "m" / KV_FILE).read_text())["layers"]
    assert sorted(stats) == [attention.format(i) for i in range(2)]
    r = run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "fp8", "--kv-cache", "fp8")
    assert r.exit_code == 0, r.stdout + r.stderr
    with safe_open(tmp_path / "fp8" / "model.safetensors", "pt") as f:
        assert {k for k in f.keys() if k.endswith(("k_scale", "v_scale"))} == {f"{n}.{x}_scale" for n in stats for x in "kv"}
    for engine in engines:
        r = run_cli("generate", tmp_path / "fp8", "--engine", engine, "--kv-cache", "fp8", "--max-new-tokens", "4")
        assert r.exit_code == 0, (engine, r.stdout + r.stderr)


def test_latent_attention_has_no_fp8_kv_cache(tiny_factory, wiki_text, tmp_path):
    """DeepSeek's multi-head latent attention caches a compressed latent (and its rotary part), not keys and values:
    measure recorded its maxabs as layer0/layer1 and quantize --kv-cache fp8 refused those names after measuring
    (exit 3). Measure records no KV statistics for it; quantize --kv-cache fp8 and generate --kv-cache fp8 refuse it
    in one sentence naming the architecture (exit 2), writing nothing."""
    path = tiny_factory("deepseek_v3")
    assert run_cli("measure", path, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2").exit_code == 0
    assert not (tmp_path / "m" / KV_FILE).exists()
    r = run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "fp8", "--kv-cache", "fp8")
    assert r.exit_code == 2 and not (tmp_path / "fp8").exists(), r.output
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: --kv-cache fp8 cannot be used with deepseek_v3: its multi-head latent attention caches a compressed "
        "latent, not keys and values, which hqtflow's FP8 KV cache does not hold; quantize with --kv-cache bf16.")
    assert run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "bf16kv").exit_code == 0
    r = run_cli("generate", tmp_path / "bf16kv", "--engine", "static", "--kv-cache", "fp8", "--max-new-tokens", "2")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "cannot be used with deepseek_v3: its multi-head latent attention" in r.stderr, r.stderr
    assert r.stderr.strip().endswith("not keys and values; give --kv-cache bf16."), r.stderr


def test_a_model_without_attention_has_no_fp8_kv_cache():
    """A pure Mamba: no layer caches keys and values, so kv_scales refuses it by name instead of asking for a
    quantize --kv-cache fp8 that would write no scales."""
    from transformers import AutoModelForCausalLM, MambaConfig

    from hqtflow.models import kv_cache_refusal
    from hqtflow.runtime.kv_cache import kv_scales

    with torch.device("meta"):
        mamba = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                                             state_size=4, expand=2))
    assert kv_cache_refusal(mamba).startswith("no layer of it caches keys and values")
    with pytest.raises(ValueError, match=r"^The FP8 KV cache cannot be used with mamba: no layer of it caches keys "
                                         r"and values .*; give --kv-cache bf16\.$"):
        kv_scales(mamba)


def test_hybrid_with_recurrent_layers_has_no_fp8_kv_cache(tiny_factory, wiki_text, tmp_path):
    """Nemotron-H's Mamba layer (layer 0) keeps a recurrent state, not keys and values: quantize --kv-cache fp8
    scaled its attention layer only, then generate --kv-cache fp8 refused the checkpoint for lacking layer 0's
    scales and told the user to quantize it with --kv-cache fp8, as they had. Measure records no KV statistics for
    it, and quantize --kv-cache fp8 refuses it naming the architecture and the layer (exit 2), writing nothing."""
    config = tmp_path / "blocklist.json"  # (its 3-D experts are not measured: kept in high precision)
    config.write_text(json.dumps({"method": "HOOKS", "mode": "MEASURE", "observer": "maxabs",
                                  "blocklist": {"types": ["NemotronHExperts"], "names": []}}))
    r = run_cli("measure", tiny_factory("nemotron_h"), "-c", config, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2")
    assert r.exit_code == 0 and not (tmp_path / "m" / KV_FILE).exists(), r.output
    r = run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "fp8", "--kv-cache", "fp8")
    assert r.exit_code == 2 and not (tmp_path / "fp8").exists(), r.output
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: --kv-cache fp8 cannot be used with nemotron_h: its layer 0 caches no keys and values (a Mamba or other "
        "recurrent layer keeps a state), which hqtflow's FP8 KV cache does not hold; quantize with --kv-cache bf16.")


def test_static_fp8_kv_cache_refuses_sliding_window_layers_in_one_sentence(tiny_factory, wiki_text, tmp_path):
    """Gemma 2's local layers: generate --engine static --kv-cache fp8 ended in FP8StaticCache's ValueError traceback
    (exit 1) at the first step, since the decoder checked only the scales when it was made. Refused there now, in
    one sentence (exit 2) naming the engine that holds both kinds of layer, which runs it."""
    path = tiny_factory("gemma2")
    assert run_cli("measure", path, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "fp8", "--kv-cache", "fp8").exit_code == 0
    r = run_cli("generate", tmp_path / "fp8", "--engine", "static", "--kv-cache", "fp8", "--max-new-tokens", "2")
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.stderr.strip().splitlines()[-1] == (
        "Error: The static decoder's FP8 KV cache holds full-attention layers only, and this gemma2 has "
        "sliding-window layers; the serving engine's (--engine serve) holds both.")
    r = run_cli("generate", tmp_path / "fp8", "--engine", "serve", "--kv-cache", "fp8", "--max-new-tokens", "2")
    assert r.exit_code == 0, r.output


def _other_measurement(artifacts, tmp_path):
    """A copy of the measurement (A) and a valid other one (B: its KV statistics doubled, its manifest rehashed)."""
    import shutil

    from hqtflow.formats.artifact import MANIFEST, sha256_file

    a, b = tmp_path / "A", tmp_path / "B"
    shutil.copytree(artifacts / "m", a)
    shutil.copytree(artifacts / "m", b)
    kv = json.loads((b / KV_FILE).read_text())
    kv["layers"] = {n: {x: s * 2 for x, s in v.items()} for n, v in kv["layers"].items()}
    (b / KV_FILE).write_text(json.dumps(kv))
    stem = json.loads((b / MANIFEST).read_text())["data"]["ranks"][0]["stem"]
    ranks = json.loads((b / f"{stem}.json").read_text())
    ranks["NumSamples"] += 1
    (b / f"{stem}.json").write_text(json.dumps(ranks))
    m = json.loads((b / MANIFEST).read_text())
    m["files"] = {rel: sha256_file(b / rel) for rel in m["files"]}
    (b / MANIFEST).write_text(json.dumps(m))
    return a, b, stem


def test_kv_statistics_are_the_hashed_ones_when_the_measurement_is_replaced_after_loading(artifacts, tmp_path):
    """quantize --kv-cache fp8 reads the KV statistics after loading the measurement: another run's --overwrite
    replacing it meanwhile is refused (the bytes parsed are the bytes hashed), never B's scales under A's manifest."""
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.measurement import load_measurement

    a, b, _ = _other_measurement(artifacts, tmp_path)
    meas = load_measurement(a)
    a.rename(tmp_path / "A.old")
    b.rename(a)  # as StagingDir.commit replaces an output
    with pytest.raises(ArtifactError, match=f"{KV_FILE} does not match its manifest hash"):
        meas.kv_stats()


def test_rank_files_are_parsed_from_the_bytes_hashed(artifacts, tmp_path, monkeypatch):
    """A rank file replaced right after the manifest's check of the other files is refused, not parsed unchecked."""
    from hqtflow.errors import ArtifactError
    from hqtflow.formats import measurement
    from hqtflow.formats.measurement import load_measurement

    a, b, stem = _other_measurement(artifacts, tmp_path)
    real = measurement.verify_files

    def verify_then_replace(manifest, **kw):
        real(manifest, **kw)
        (a / f"{stem}.json").write_bytes((b / f"{stem}.json").read_bytes())

    monkeypatch.setattr(measurement, "verify_files", verify_then_replace)
    with pytest.raises(ArtifactError, match=f"{stem}.json does not match its manifest hash"):
        load_measurement(a)


def test_kv_statistics_outside_the_manifest_refused(artifacts, tmp_path):
    """A KV statistics file the manifest does not list (dropped into a measurement without one) is never read by
    quantize --kv-cache fp8: refused in one sentence, exit 3, as an unlisted Hessian file is."""
    import shutil

    from conftest import refused_quantize
    from hqtflow.formats.artifact import MANIFEST

    plain = tmp_path / "plain"  # a measurement that carries no KV statistics
    shutil.copytree(artifacts / "m", plain)
    m = json.loads((plain / MANIFEST).read_text())
    del m["files"][KV_FILE]
    (plain / MANIFEST).write_text(json.dumps(m))
    refused_quantize(["-m", plain, "-o", tmp_path / "out", "--kv-cache", "fp8"],
                     "is not listed in the measurement's manifest", tmp_path, 3)


@pytest.mark.parametrize("offload", [False, True])
def test_quantize_with_kv_cache_builds_the_skeleton_once(tiny_kv, tmp_path, monkeypatch, offload):
    """quantize --kv-cache fp8 built the model's meta skeleton for planning, again to check the FP8 KV cache can hold
    the model, and (--disk-offload) a third time for the k/v scales: one, the job's, serves all three now.
    --disk-offload's writer builds its own besides (the tensors' layout as loading gives them: fused experts, in the
    measured dtype), as without --kv-cache."""
    calls = count_skeletons(monkeypatch)
    r = run_cli("quantize", "-m", tiny_kv[0], "-o", tmp_path / "o", "--kv-cache", "fp8", *["--disk-offload"] * offload)
    assert r.exit_code == 0, r.output
    assert calls == ["run.py:plan_job", *["offload.py:plan_offload"] * offload], calls


def test_every_fp8_kv_cache_user_refuses_in_the_same_words(tiny_factory):
    """The static decoder, perplexity (eval's check) and FP8StaticCache each checked the FP8 KV cache on their own,
    FP8StaticCache and perplexity in other words than the decoder's (no architecture, no way out). One helper
    (kv_cache.fp8_kv_refusal) decides for all three now: a model without k/v scales gets kv_scales' sentence
    from each, one with sliding-window layers the decoder's sentence, naming its own cache and what holds them."""
    from transformers import AutoModelForCausalLM

    from hqtflow.errors import HqtflowError
    from hqtflow.eval_run import check_fp8_kv
    from hqtflow.models import attention_modules
    from hqtflow.runtime.kv_cache import FP8StaticCache, fp8_kv_refusal, kv_scales
    from hqtflow.runtime.static_decode import StaticDecoder

    def refusal(make, kind=ValueError) -> str:
        with pytest.raises(kind) as e:
            make()
        return str(e.value)

    gemma = AutoModelForCausalLM.from_pretrained(tiny_factory("gemma2"))
    unscaled = refusal(lambda: kv_scales(gemma))
    assert unscaled.startswith("This model has no KV-cache scales") and unscaled.endswith("--kv-cache fp8`.")
    assert fp8_kv_refusal(gemma) == unscaled == refusal(lambda: StaticDecoder(gemma, kv_cache="fp8"))
    assert refusal(lambda: check_fp8_kv(gemma, perplexity=True), HqtflowError) == unscaled
    for name in attention_modules(gemma).values():
        for x in "kv":
            gemma.get_submodule(name).register_buffer(f"{x}_scale", torch.tensor(0.5))
    assert fp8_kv_refusal(gemma) is None and len(kv_scales(gemma)) == gemma.config.num_hidden_layers
    check_fp8_kv(gemma, perplexity=False)  # the serving engine's cache (log-likelihoods) holds them
    sliding = "FP8 KV cache holds full-attention layers only, and this gemma2 has sliding-window layers; "
    assert refusal(lambda: StaticDecoder(gemma, kv_cache="fp8")) == (
        f"The static decoder's {sliding}the serving engine's (--engine serve) holds both.")
    assert refusal(lambda: check_fp8_kv(gemma, perplexity=True), HqtflowError) == f"Perplexity's {sliding}give --kv-cache bf16."
    assert refusal(lambda: check_fp8_kv(gemma, perplexity=True, key="eval.kv_cache"), HqtflowError) == (
        f"Perplexity's {sliding}set eval.kv_cache to bf16 in the recipe.")
    assert refusal(lambda: FP8StaticCache(gemma.config, 8, kv_scales(gemma))) == (
        f"This static {sliding}the serving engine's (hqtflow.runtime.engine) holds both.")
