"""Architectures hqtflow cannot take whole are refused up front in one sentence, or what it keeps in high precision
is said: never a measurement that passed layers over, nor a checkpoint silently missing quantized layers (stop 48's
sweep of 21 architectures)."""

import json

from conftest import run_cli
from hqtflow.formats.artifact import MANIFEST


def test_conv1d_models_are_refused_before_calibrating(tiny_factory, wiki_text, tmp_path):
    """GPT-2's projections are transformers' Conv1D: measure used to exit 0 having measured the lm_head alone."""
    gpt2 = tiny_factory("gpt2")
    r = run_cli("measure", gpt2, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "1", "--max-length", "16")
    assert r.exit_code == 4 and "Conv1D" in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "m").exists()
    r = run_cli("measure", gpt2, "-o", tmp_path / "m", "--text", wiki_text, "--tp", "2")  # before any rank is spawned
    assert r.exit_code == 4 and "no tensor-parallel plan for 'gpt2'" in r.stderr, r.output


def test_fused_experts_kept_in_high_precision_are_listed(tiny_factory, wiki_text, tmp_path):
    """Fused MoE experts a config blocklists by type stay in bf16 in hqtflow's checkpoint: the manifest and the
    summary say so (they were once left out of both). `tests/quantize/test_experts.py` has them quantized."""
    model = tiny_factory("mixtral")
    r = run_cli("measure", model, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2", "--max-length", "16")
    assert r.exit_code == 0, r.output
    cfg = tmp_path / "q.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "maxabs_hw",
                               "blocklist": {"types": ["MixtralExperts"], "names": ["lm_head"]}}))
    r = run_cli("quantize", model, "-m", tmp_path / "m", "-o", tmp_path / "q", "-c", cfg)
    assert r.exit_code == 0, r.output
    data = json.loads((tmp_path / "q" / MANIFEST).read_text())["data"]
    experts = {k: v for k, v in data["skipped"].items() if k.endswith("mlp.experts")}
    assert len(experts) == 2 and all("blocklist" in v for v in experts.values()), data["skipped"]
    assert not [n for n in data["quantized"] if "experts" in n]
    assert f"{len(data['skipped'])} kept in high precision" in r.stdout + r.stderr


def test_gemma2_and_gpt_oss_end_to_end(tiny_factory, wiki_text, tmp_path):
    """Gemma 2 (soft-capped attention scores) and gpt-oss (attention sinks; experts with biases, which hqtflow does
    not quantize) go measure -> quantize -> generate, the engine's greedy text that of transformers' generate on the
    same checkpoint. gpt-oss's experts are refused by name with the blocklist that keeps them in high precision, and
    kept so with it (listed in the manifest)."""
    for model_type in ("gemma2", "gpt_oss"):
        model, out = tiny_factory(model_type), tmp_path / model_type
        measure = ["measure", model, "-o", out / "m", "--text", wiki_text, "--limit", "2", "--max-length", "32"]
        if model_type == "gpt_oss":
            r = run_cli(*measure)
            assert r.exit_code == 4 and '{"blocklist": {"types": ["GptOssExperts"]}}' in r.stderr, r.output
            assert "Traceback" not in r.output and not (out / "m").exists()
            cfg = tmp_path / "blocklist.json"
            cfg.write_text(json.dumps({"mode": "MEASURE", "blocklist": {"types": ["GptOssExperts"]}}))
            measure += ["-c", cfg]
        r = run_cli(*measure)
        assert r.exit_code == 0, r.output
        r = run_cli("quantize", "-m", out / "m", "-o", out / "q")
        assert r.exit_code == 0, r.output
        data = json.loads((out / "q" / MANIFEST).read_text())["data"]
        assert any("self_attn.q_proj" in n for n in data["quantized"])
        if model_type == "gpt_oss":
            assert [n for n in data["skipped"] if n.endswith("mlp.experts")] == ["model.layers.0.mlp.experts",
                                                                                 "model.layers.1.mlp.experts"]
        texts = [run_cli("generate", out / "q", "-p", "The tower is", "--max-new-tokens", "8", *engine)
                 for engine in ((), ("--engine", "transformers"))]
        assert all(t.exit_code == 0 for t in texts) and texts[0].stdout == texts[1].stdout, [t.output for t in texts]


def test_experts_of_another_layout_are_never_passed_over(tiny_factory, wiki_text, tmp_path):
    """Nemotron-H's experts hold 3-D weights without a gate (up_proj, down_proj): measure passed them over without a
    word (they are no Linear and not Mixtral's fused layout). Now refused with the blocklist that keeps them in high
    precision; with it, quantize lists them as kept."""
    model = tiny_factory("nemotron_h")
    measure = ["measure", model, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2", "--max-length", "16"]
    r = run_cli(*measure)
    assert r.exit_code == 4 and "NemotronHExperts holds 3-D weights (up_proj, down_proj)" in r.stderr, r.output
    assert '{"blocklist": {"types": ["NemotronHExperts"]}}' in r.stderr and not (tmp_path / "m").exists()
    cfg = tmp_path / "blocklist.json"
    cfg.write_text(json.dumps({"mode": "MEASURE", "blocklist": {"types": ["NemotronHExperts"]}}))
    r = run_cli(*measure, "-c", cfg)
    assert r.exit_code == 0, r.output
    r = run_cli("quantize", "-m", tmp_path / "m", "-o", tmp_path / "q")
    assert r.exit_code == 0, r.output
    skipped = json.loads((tmp_path / "q" / MANIFEST).read_text())["data"]["skipped"]
    assert "3-D weights" in skipped["model.layers.0.mixer.experts"], skipped
