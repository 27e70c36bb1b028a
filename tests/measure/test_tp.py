"""`--tp N`: ranks spawned with torchrun (gloo on CPU) observe their shards; merged they equal the 1-rank run."""

import json

import numpy as np
import pytest

from conftest import run_cli
from hqtflow.formats.artifact import read_manifest

pytestmark = pytest.mark.slow


def nodes(path):
    return json.loads(path.read_text())["Nodes"]


def test_two_ranks_match_one(tiny_factory, wiki_text, tmp_path):
    """Also: `quantize --scales-only` writes one INC scale file per rank from each rank's weight shard."""
    model = tiny_factory("llama", dtype="float32")
    common = ["--text", wiki_text, "--limit", "4", "--max-length", "32", "--batch-size", "2", "--dtype", "fp32"]
    r1 = run_cli("measure", model, "-o", tmp_path / "tp1", *common)
    assert r1.exit_code == 0, r1.output
    r2 = run_cli("measure", model, "-o", tmp_path / "tp2", "--tp", "2", *common)
    assert r2.exit_code == 0, r2.output

    out = tmp_path / "tp2"
    m = read_manifest(out, "hqtflow.measurement")
    assert m.data["world_size"] == 2 and [r["rank"] for r in m.data["ranks"]] == [0, 1]
    ranks = [json.loads((out / f"measure_hooks_maxabs_{r}_2.json").read_text()) for r in range(2)]
    assert [r["LocalRank"] for r in ranks] == [0, 1]
    one = nodes(tmp_path / "tp1" / "measure_hooks_maxabs.json")
    styles = m.data["ranks"][0]["layers"]
    assert styles["model.layers.0.self_attn.q_proj"]["style"] == "column"
    assert styles["model.layers.0.self_attn.o_proj"]["style"] == "row"
    assert styles["model.layers.0.mlp.down_proj"]["style"] == "row"
    for name, ref in one.items():
        per_rank = [r["Nodes"][name] for r in ranks]
        # weights: the max over shards is the full weight's max, bit for bit
        assert max(p["params"]["weight"][0][0] for p in per_rank) == ref["params"]["weight"][0][0], name
        # activations: equal up to the reduction order the all-reduce introduces (fp32)
        merged_in = max(p["inputs"][0][0][0] for p in per_rank)
        np.testing.assert_allclose(merged_in, ref["inputs"][0][0][0], rtol=1e-4, err_msg=name)
    assert not list(tmp_path.glob(".*")), "no staging leftovers"

    sc = run_cli("quantize", "-m", out, "-o", tmp_path / "scales", "--scales-only", "--scale-method", "maxabs_arbitrary")
    assert sc.exit_code == 0, sc.output
    for rank in range(2):
        js = json.loads((tmp_path / "scales" / f"measure_hooks_maxabs_MAXABS_ARBITRARY_{rank}_2.json").read_text())
        assert js["LocalRank"] == rank and js["Mode"] == "Scale"
        meas = ranks[rank]["Nodes"]
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            # the weight scale comes from this rank's shard: its maxabs / (448 * 0.5), in fp32 here
            expect = meas[name]["params"]["weight"][0][0] / 224
            np.testing.assert_allclose(js["Nodes"][name]["params"]["weight"], expect, rtol=1e-2)
    ck = run_cli("quantize", "-m", out, "-o", tmp_path / "ck")
    assert ck.exit_code == 3 and "2-rank measurement" in ck.stderr and "hqtflow unify -g 01" in ck.stderr


def test_a_rank_error_is_its_sentence_and_exit_code(tiny_llama, wiki_text, tmp_path, capfd):
    """An error only the ranks meet (here a config selecting no module of the loaded model) is the rank's own sentence
    and exit code, without torchrun's traceback and report (exit 2 and 40 lines of them before); a model without
    its tokenizer is refused before any rank starts."""
    import shutil

    cfg = tmp_path / "none.json"
    cfg.write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs", "allowlist": {"names": ["^no_such_module$"]}}))
    common = ["--text", wiki_text, "--limit", "2", "--max-length", "32", "--tp", "2"]
    capfd.readouterr()
    r = run_cli("measure", tiny_llama, "-o", tmp_path / "m", "-c", cfg, *common)
    err = capfd.readouterr().err + r.stderr
    assert r.exit_code == 2, err
    assert "The config selects no module of this model" in err
    assert "Measurement with --tp 2 failed: a rank stopped on the error named above (exit code 2: usage/config)." in err
    assert "Traceback" not in err and "ChildFailedError" not in err and "Root Cause" not in err, err
    assert not (tmp_path / "m").exists()
    bare = tmp_path / "no-tokenizer"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / f, bare / f)
    r = run_cli("measure", bare, "-o", tmp_path / "m2", *common)
    err = capfd.readouterr().err + r.stderr
    assert r.exit_code == 4 and "Cannot load a tokenizer" in err and "a rank stopped" not in err, err


def test_user_started_torchrun(tiny_llama, wiki_text, tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "user"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "hqtflow",
           "measure", str(tiny_llama), "-o", str(out), "--tp", "2", "--text", str(wiki_text), "--limit", "2",
           "--max-length", "32"]
    r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert read_manifest(out, "hqtflow.measurement").data["world_size"] == 2
    assert (out / "measure_hooks_maxabs_1_2.json").is_file()


def test_user_torchrun_world_must_match(tiny_llama, wiki_text, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    r = run_cli("measure", tiny_llama, "-o", tmp_path / "o", "--text", wiki_text, "--tp", "1")
    assert r.exit_code == 2 and "torchrun started 2 ranks but --tp is 1" in r.stderr


def test_moe_experts_under_two_ranks_unify_to_one(tiny_factory, wiki_text, tmp_path):
    """transformers shards fused experts too (gate_up `packed_colwise`, down `rowwise`; from 5.25 its plan keeps them
    whole on every rank): each expert node records how, so per-channel statistics unified from two ranks have the
    1-rank run's shapes and values (fp32: the same sums)."""
    from conftest import ROOT
    from hqtflow.formats.measurement import load_measurement

    model = tiny_factory("mixtral", dtype="float32")
    common = ["--text", wiki_text, "--limit", "4", "--max-length", "32", "--dtype", "fp32",
              "-c", ROOT / "quantization_config" / "maxabs_per_channel_measure.json"]
    assert run_cli("measure", model, "-o", tmp_path / "one", *common).exit_code == 0
    r = run_cli("measure", model, "-o", tmp_path / "two", "--tp", "2", *common)
    assert r.exit_code == 0, r.output
    layers = read_manifest(tmp_path / "two", "hqtflow.measurement").data["ranks"][1]["layers"]
    gu, down = layers["model.layers.1.mlp.experts.2.gate_up_proj"], layers["model.layers.1.mlp.experts.2.down_proj"]
    if gu["style"] == "replicated":  # transformers 5.25 on: its plan keeps Mixtral's experts whole on every rank
        assert (gu["packed_parts"], gu["weight_shape"], gu["global_weight_shape"]) == (1, [192, 64], [192, 64])
        assert (down["style"], down["weight_shape"], down["global_weight_shape"]) == ("replicated", [64, 96], [64, 96])
    else:
        assert (gu["style"], gu["packed_parts"], gu["weight_shape"], gu["global_weight_shape"]) == ("column", 2, [96, 64], [192, 64])
        assert (down["style"], down["weight_shape"], down["global_weight_shape"]) == ("row", [64, 48], [64, 96])
    r = run_cli("unify", "-g", "01", "-m", tmp_path / "two", "-o", tmp_path / "merged")
    assert r.exit_code == 0, r.output
    a, b = load_measurement(tmp_path / "one").ranks[0].nodes, load_measurement(tmp_path / "merged").ranks[0].nodes
    experts = [n for n in a if ".experts." in n]
    assert len(experts) == 16 and set(a) == set(b)
    for name in experts:
        np.testing.assert_array_equal(np.asarray(a[name].params["weight"]), np.asarray(b[name].params["weight"]))
        np.testing.assert_allclose(np.asarray(a[name].inputs[0]), np.asarray(b[name].inputs[0]), rtol=1e-5, err_msg=name)
