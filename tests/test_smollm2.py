"""The real SmolLM2-135M-Instruct: lm-eval local tasks and a text file, and 3 ranks."""

import json

import pytest

from conftest import run_cli
from hqtflow.formats.artifact import read_manifest

pytestmark = pytest.mark.slow


def test_measure_tasks_and_text(smollm2, data_dir, tmp_path):
    out = tmp_path / "m"
    r = run_cli("measure", smollm2, "-o", out, "--tasks", "piqa_local,lambada_openai_local", "--data-dir", data_dir,
                "--text", data_dir / "wikitext2_valid.txt", "--limit", "16", "--max-length", "256", "--batch-size", "8")
    assert r.exit_code == 0, r.output
    m = read_manifest(out, "hqtflow.measurement")
    js = json.loads((out / "measure_hooks_maxabs.json").read_text())["Nodes"]
    assert len(js) == 30 * 7 + 1  # 7 Linear per layer, plus the (tied) lm_head
    kinds = [s["kind"] for s in m.data["calibration"]["sources"]]
    assert kinds == ["text", "lm-eval"]
    results = m.data["calibration"]["sources"][1]["results"]
    assert results["piqa_local"]["acc"] > 0.5  # a real model, not noise
    assert results["lambada_openai_local"]["perplexity"] < 200
    # real activations: the residual stream into the MLP of a trained model has large outliers
    down = [js[f"model.layers.{i}.mlp.down_proj"]["inputs"][0][0][0] for i in range(30)]
    assert all(v > 0 for v in down) and max(down) > 10 * min(down)


def test_tp3(smollm2_tp3):
    out = smollm2_tp3
    m = read_manifest(out, "hqtflow.measurement")
    assert m.data["world_size"] == 3
    for rank in range(3):
        js = json.loads((out / f"measure_hooks_maxabs_{rank}_3.json").read_text())
        assert js["LocalRank"] == rank and len(js["Nodes"]) == 211
    layers = m.data["ranks"][1]["layers"]
    assert layers["model.layers.0.self_attn.k_proj"]["weight_shape"] == [64, 576]  # 3 KV heads / 3 ranks
    assert layers["model.layers.0.mlp.down_proj"]["style"] == "row"


def test_tp2_refused(smollm2, data_dir, tmp_path):
    r = run_cli("measure", smollm2, "-o", tmp_path / "o", "--tp", "2", "--text", data_dir / "wikitext2_valid.txt")
    assert r.exit_code == 4  # a model error
    assert "its 9 attention heads are not divisible by 2" in r.stderr
