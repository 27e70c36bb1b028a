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
