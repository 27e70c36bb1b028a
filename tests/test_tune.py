"""`hqtflow tune` on the tiny Llama: sensitivity per layer, the smallest bf16 prefix meeting the target, a
QUANT_CONFIG Neural Compressor's FP8Config accepts, and a checkpoint that runs the same mix."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "meas"
    assert run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "4", "--max-length", "64").exit_code == 0
    return out


def tune(measured, out, text, *extra):
    r = run_cli("tune", "-m", measured, "-o", out, "--text", text, "--tokens", "96", "--window", "48", *extra)
    assert r.exit_code == 0, r.output
    return json.loads((out / "sensitivity.json").read_text())


def test_tune(measured, wiki_text, tmp_path, inc):
    import hqtflow
    from hqtflow.quantize.fp8_linear import FP8Linear

    loose = tune(measured, tmp_path / "loose", wiki_text, "--target-kl", "1e6")
    assert loose["kept_bf16"] == [] and len(loose["sensitivity"]) == loose["linear_layers"] > 0
    kl_all = loose["all_quantized"]["mean_kl"]
    assert kl_all > 0 and all(v >= 0 for v in loose["sensitivity"].values())
    target = kl_all / 3
    r = tune(measured, tmp_path / "tight", wiki_text, "--target-kl", str(target))
    kept = r["kept_bf16"]
    assert kept and r["tuned"]["mean_kl"] <= target
    # the kept layers are a prefix of the sensitivity order (most sensitive first)
    assert kept == list(r["sensitivity"])[: len(kept)]
    cfg = json.loads((tmp_path / "tight" / "quant_config.json").read_text())
    assert [f"^{n.replace('.', chr(92) + '.')}$" for n in kept] == cfg["blocklist"]["names"][-len(kept):]
    assert "lm_head" in cfg["blocklist"]["names"]  # the starting config's own entries stay
    config = inc.FP8Config(**cfg)  # INC accepts it unchanged
    assert config.mode == "QUANTIZE" and config.blocklist["names"] == cfg["blocklist"]["names"]
    model, tok = hqtflow.load(tmp_path / "tight" / "checkpoint", backend="qdq")
    for n in kept:
        assert type(model.get_submodule(n)) is torch.nn.Linear
    assert isinstance(model.get_submodule(list(r["sensitivity"])[-1]), FP8Linear)
    manifest = json.loads((tmp_path / "tight" / "hqtflow_manifest.json").read_text())
    assert manifest["_type"] == "hqtflow.tune" and manifest["data"]["kept_bf16"] == kept
    # inspect shows the sensitivity chart, most sensitive first, kept layers starred
    out = run_cli("inspect", tmp_path / "tight", "--json", tmp_path / "t.json")
    assert out.exit_code == 0, out.output
    rows = [ln for ln in out.stdout.splitlines() if ln.strip().endswith("#") or "#" in ln]
    assert rows and rows[0].strip().startswith("* " + kept[0])
    assert json.loads((tmp_path / "t.json").read_text())["kept_bf16"] == kept
    out = run_cli("inspect", tmp_path / "tight", "--html", tmp_path / "t.html")
    assert out.exit_code == 2 and "do not apply" in out.stderr


def test_tune_refusals(measured, wiki_text, tmp_path):
    r = run_cli("tune", "-m", measured, "-o", tmp_path / "x", "--text", wiki_text)
    assert r.exit_code == 2 and "needs a target" in r.stderr
    r = run_cli("tune", "-m", measured, "-o", tmp_path / "x", "--text", wiki_text, "--target-kl", "-1")
    assert r.exit_code == 2 and "must be positive" in r.stderr
    r = run_cli("tune", "-m", measured, "-o", tmp_path / "x", "--text", tmp_path / "none.txt", "--target-kl", "0.1")
    assert r.exit_code == 5 and "does not exist" in r.stderr  # calibration data
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "short.txt").write_text("hello world short")
    (tmp_path / "empty.txt").write_text("")
    for name, message in (("bin.txt", "is not UTF-8 text"), ("short.txt", "has fewer than 48 tokens"),
                          ("empty.txt", "is empty")):  # unusable data, as measure and eval refuse theirs
        r = run_cli("tune", "-m", measured, "-o", tmp_path / "x", "--text", tmp_path / name, "--target-kl", "0.1",
                    "--tokens", "96", "--window", "48")
        assert r.exit_code == 5 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    r = run_cli("tune", "-m", measured, "-o", tmp_path / "x", "--text", wiki_text, "--target-kl", "0.1", "--window", "0")
    assert r.exit_code == 2 and "--window must be >= 2, not 0" in r.stderr
    assert not (tmp_path / "x").exists()


def test_tune_gptq(tiny_llama, measured, wiki_text, tmp_path):
    """--gptq: sensitivities and the checkpoint with GPTQ-rounded weights; a measurement without Hessians is refused."""
    from hqtflow.formats.artifact import read_manifest

    meas = tmp_path / "meas"
    r = run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "4", "--max-length", "64", "--hessians")
    assert r.exit_code == 0, r.output
    plain = tune(measured, tmp_path / "plain", wiki_text, "--target-kl", "1e6")
    g = tune(meas, tmp_path / "g", wiki_text, "--target-kl", "1e6", "--gptq")
    assert g["weight_rounding"] == "gptq" and plain["weight_rounding"] == "nearest"
    assert g["sensitivity"] != plain["sensitivity"]
    assert read_manifest(tmp_path / "g" / "checkpoint", "hqtflow.checkpoint").data["weight_rounding"] == "gptq"
    r = run_cli("tune", "-m", measured, "-o", tmp_path / "x", "--text", wiki_text, "--target-kl", "1", "--gptq")
    assert r.exit_code == 3 and "--hessians" in r.stderr and not (tmp_path / "x").exists()
