"""`hqtflow inspect` on a tiny model: measurement, checkpoint, scales, --compare, bad input, and the HTML report
rendered in headless Chromium."""

import json
import shutil
import subprocess

import pytest

from conftest import ROOT, need, run_cli

CFG = ROOT / "quantization_config"


@pytest.fixture(scope="module")
def arts(tiny_llama, wiki_text, tmp_path_factory):
    base = tmp_path_factory.mktemp("inspect")
    out = {}
    for name, limit in (("meas6", "6"), ("meas2", "2")):
        r = run_cli("measure", tiny_llama, "-o", base / name, "--text", wiki_text, "--limit", limit, "--max-length", "64",
                    "-c", CFG / "maxabs_measure_include_outputs.json")
        assert r.exit_code == 0, r.output
        out[name] = base / name
    r = run_cli("quantize", "-m", out["meas6"], "-o", base / "ck")
    assert r.exit_code == 0, r.output
    out["ck"] = base / "ck"
    out["base"] = base
    return out


def inspect_ok(*args):
    r = run_cli("inspect", *args)
    assert r.exit_code == 0, r.output
    return r.stdout


def test_measurement(arts, tmp_path):
    js = tmp_path / "m.json"
    text = inspect_ok(arts["meas6"], "--json", js, "--top", "3")
    rep = json.loads(js.read_text())
    assert rep["kind"] == "measurement" and "measurement artifact" in text
    s = rep["summary"]
    assert s["nodes"] == 15 and s["nodes_measured"] == 15 and s["nodes_not_measured"] == 0 and s["samples"] == 6
    assert "model.layers.0.self_attn.q_proj" in rep["coverage"]["measured"]
    rg = rep["ranges"]
    assert len(rg["top_input"]) == 3 and len(rg["top_output"]) == 3
    assert rg["top_input"][0]["maxabs"] >= rg["top_input"][1]["maxabs"] >= rg["top_input"][2]["maxabs"] > 0
    assert rg["top_input"][0]["name"] in text and "Largest output maxabs" in text
    # every layer's implied maxabs_pow2 scale: a power of two >= maxabs / (448 * 0.25)
    for layer in rep["layers"]:
        s_in = layer["input_scale_pow2"]
        assert s_in * 448 * 0.25 >= layer["input_maxabs"] * 0.999 and (s_in).hex().startswith("0x1.0000000000000p")
    assert rep["scales"]["method"] == "maxabs_pow2" and "outlier" in rep["rules"]


def test_checkpoint(arts, tmp_path):
    js = tmp_path / "c.json"
    text = inspect_ok(arts["ck"], "--json", js)
    rep = json.loads(js.read_text())
    s = rep["summary"]
    assert rep["kind"] == "checkpoint" and s["nodes_quantized"] == 14 and s["full_scale"] == 448
    assert rep["coverage"]["not_quantized"] == {"lm_head": "excluded by allowlist/blocklist"}
    assert "lm_head: excluded by allowlist/blocklist" in text
    # maxabs_arbitrary with activation backoff 0.25: headroom is 4 everywhere, nothing saturates
    assert rep["scales"]["measured_maxabs_available"] and s["saturating"] == 0 and s["weight_underflow"] == 0
    heads = [r["headroom"] for r in rep["layers"]]
    assert len(heads) == 14 and all(3.9 < h < 4.1 for h in heads)
    we = rep["weight_error"]
    assert we["available"] and len(we["layers"]) == 14
    assert all(0 < r["rel_rms"] < 0.1 and r["sqnr_db"] > 20 for r in we["layers"])
    assert "Weight quantization error" in text and we["layers"][0]["name"] in text
    layer = rep["layers"][0]
    assert 0 < layer["w_occupancy"] <= 0.5 + 1e-6 and layer["w_dtype"] == "float8_e4m3fn"


def test_checkpoint_sources_gone(arts, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(arts["ck"], ck)
    m = json.loads((ck / "hqtflow_manifest.json").read_text())
    m["data"]["source_measurement"] = str(tmp_path / "gone-meas")
    m["data"]["model_path"] = str(tmp_path / "gone-model")
    (ck / "hqtflow_manifest.json").write_text(json.dumps(m))
    js = tmp_path / "c.json"
    text = inspect_ok(ck, "--json", js)
    rep = json.loads(js.read_text())
    assert not rep["scales"]["measured_maxabs_available"] and not rep["weight_error"]["available"]
    assert any("is gone" in n for n in rep["notes"]) and any("unavailable" in n for n in rep["notes"])
    assert "skipped" in text and "(not computed: see the Note below)" in text and "gone-model is unavailable" in text
    assert rep["summary"]["nodes_quantized"] == 14  # the weight checks still run
    assert all("w_zero_fraction" in r for r in rep["layers"])


def test_scales(arts, tmp_path):
    r = run_cli("quantize", "-m", arts["meas6"], "-o", tmp_path / "sc", "--scales-only", "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    js = tmp_path / "s.json"
    inspect_ok(tmp_path / "sc", "--json", js)
    rep = json.loads(js.read_text())
    assert rep["kind"] == "scales" and rep["summary"]["nodes_quantized"] == 14
    assert rep["scales"]["measured_maxabs_available"] and rep["summary"]["saturating"] == 0
    assert all(r["headroom"] >= 1 for r in rep["layers"]) and rep["weight_error"]["available"]


def test_compare(arts, tmp_path):
    js = tmp_path / "cmp.json"
    text = inspect_ok(arts["meas2"], "--compare", arts["meas6"], "--json", js, "--top", "5")
    rep = json.loads(js.read_text())
    c = rep["compare"]
    assert c["common"] == 15 and c["only_in_this"] == [] and c["only_in_other"] == []
    assert len(c["largest_changes"]) == 5 and "Compared with" in text
    # more calibration data can only raise a running max
    for node in c["nodes"]:
        for stat in ("input", "output", "weight"):
            assert node[stat]["ratio"] >= 1.0
        assert node["weight"]["ratio"] == 1.0
    logs = [abs(x["log2_ratio"]) for x in c["largest_changes"]]
    assert logs == sorted(logs, reverse=True) and logs[0] > 0
    # the text says what only --json showed: every weight equal, and the range of each other statistic's ratios
    lo, hi = c["ratio_ranges"]["input"]
    assert c["ratio_ranges"]["weight"] == [1.0, 1.0] and 1.0 <= lo <= hi
    assert f"Ratios (other / this): input {lo:.3f}-{hi:.3f}, " in text and ", weight equal" in text
    # nodes only in one: drop a node from a copy's statistics (re-hash via a fresh manifest is not needed: edit the
    # copy's rank layers and JSON, then update the file hash in its manifest)
    from hqtflow.formats.artifact import sha256_file

    cp = tmp_path / "m2"
    shutil.copytree(arts["meas2"], cp)
    f = cp / "measure_hooks_maxabs.json"
    raw = json.loads(f.read_text())
    raw["Nodes"].pop("lm_head")
    f.write_text(json.dumps(raw))
    man = json.loads((cp / "hqtflow_manifest.json").read_text())
    man["files"]["measure_hooks_maxabs.json"] = sha256_file(f)
    (cp / "hqtflow_manifest.json").write_text(json.dumps(man))
    r = run_cli("inspect", cp, "--compare", arts["meas6"], "--json", js)
    assert r.exit_code == 0, r.output
    assert json.loads(js.read_text())["compare"]["only_in_other"] == ["lm_head"]


def test_bad_input(arts, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(arts["meas2"], partial)
    (partial / "measure_hooks_maxabs.json").unlink()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "hqtflow_manifest.json").write_text(json.dumps({"_type": "hqtflow.eval", "_version": 1}))
    nomanifest = tmp_path / "nomanifest"
    nomanifest.mkdir()
    js = tmp_path / "out.json"
    cases = [
        ((tmp_path / "missing",), "does not exist"),
        ((nomanifest,), "no hqtflow_manifest.json"),
        ((partial,), "is incomplete"),
        ((foreign,), "'hqtflow.eval'"),
        ((arts["meas2"], "--compare", arts["ck"]), "same kind"),
        ((arts["meas2"], "--top", "0"), "--top"),
        ((arts["meas2"], "--html", tmp_path / "no" / "dir" / "r.html"), "Cannot write"),
    ]
    for args, msg in cases:
        r = run_cli("inspect", *args, "--json", js)
        assert r.exit_code == (2 if "--top" in args else 3), (args, r.output)  # artifact errors, the usage one aside
        err = r.stderr.strip()
        assert msg in err and err.startswith("Error: ") and len(err.splitlines()) == 1, (args, err)
        assert not js.exists()


def _chromium(url: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'chrome-profile'}"]
    return subprocess.run([shutil.which("chromium"), *flags, *extra, url], capture_output=True, text=True, timeout=90)


def test_html_in_browser(arts, tmp_path):
    need(shutil.which("chromium") is not None, "chromium is not installed (apt-get install -y chromium)")
    page = tmp_path / "report.html"
    inspect_ok(arts["meas2"], "--compare", arts["meas6"], "--html", page)
    html = page.read_text()
    assert 'src="data:image/png;base64,' in html and "http://" not in html and "https://" not in html
    url = page.resolve().as_uri()
    dom = _chromium(url, tmp_path, "--virtual-time-budget=3000", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    out = dom.stdout
    assert 'data-images="2"' in out and 'data-images-ok="true"' in out, out[:500]
    assert 'id="nodes-measured">15<' in out and 'id="artifact-kind">measurement<' in out
    assert 'id="compare-common">15<' in out and 'id="outlier-table"' in out
    shot = tmp_path / "shot.png"
    r = _chromium(url, tmp_path, "--window-size=1200,1600", f"--screenshot={shot}")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[0] >= 1000 and img.shape[1] >= 1000
    assert float(img[..., :3].std()) > 0.05  # not a blank page
    # checkpoint page too: its key figure and charts
    page2 = tmp_path / "ck.html"
    inspect_ok(arts["ck"], "--html", page2)
    out2 = _chromium(page2.resolve().as_uri(), tmp_path, "--virtual-time-budget=3000", "--dump-dom").stdout
    assert 'data-images-ok="true"' in out2 and 'id="nodes-quantized">14<' in out2 and 'id="weight-error"' in out2


def test_rules_on_synthetic_values():
    import torch

    from hqtflow.inspection import _headroom, _outliers, _pow2_flags, _weight_stats

    vals = {f"model.layers.{i}.mlp.down_proj": 1.0 for i in range(5)} | {"model.layers.5.mlp.down_proj": 100.0,
                                                                        "model.layers.0.self_attn.q_proj": 50.0}
    out = _outliers(vals, "input")
    assert [o["name"] for o in out] == ["model.layers.5.mlp.down_proj"] and out[0]["ratio"] == 100.0
    _, flags = _pow2_flags({"a": {"input": 0.0}, "b": {"input": 1e-9}, "c": {"input": 1e6}, "d": {"input": 3.0}})
    assert {(f["name"], f["flag"]) for f in flags} == {("a", "zero"), ("b", "tiny"), ("c", "huge")}
    rows = _headroom({"a": {"input_scale": 0.001}, "b": {"input_scale": 0.01}, "c": {"input_scale": 10.0}},
                     {"a": {"input": 1.0}, "b": {"input": 1.0}, "c": {"input": 1.0}}, 448.0)
    assert {r["name"]: r["flag"] for r in rows} == {"a": "saturates", "b": None, "c": "underflow"}
    w = torch.randn(16, 32)
    good = _weight_stats((w / (w.abs().max() / 448)).to(torch.float8_e4m3fn), torch.tensor([w.abs().max() / 448]), 448.0)
    assert good["flag"] is None and good["occupancy"] == 1.0
    big = torch.tensor([w.abs().max() * 1e4])  # a weight scale so large that almost every value rounds to 0
    bad = _weight_stats((w / big).to(torch.float8_e4m3fn), big, 448.0)
    assert bad["flag"] == "underflow" and bad["zero_fraction"] > 0.5 and bad["smallest_normal"] == pytest.approx(2**-6 * float(big))


def test_file_size_limit_is_a_resource_error(arts, tmp_path):
    """inspect --json/--html under a file-size limit (ulimit -f, a full disk's stand-in) exits 6 with the sentence
    every other stage gives, and leaves no report or temp file behind."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # CPython ignores SIGXFSZ: a write fails with EFBIG
    try:
        r = run_cli("inspect", arts["meas2"], "--json", tmp_path / "r.json", "--html", tmp_path / "r.html")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert r.exit_code == 6, r.output
    assert r.stderr.startswith("Error: cannot write (File too large): free some disk space"), r.stderr
    assert not list(tmp_path.iterdir())


def test_source_model_of_pickles_needs_trust_pickle(tiny_llama, arts, tmp_path):
    """inspect loads a checkpoint's source model for the weight error; a model whose weights are only pickles was
    refused naming --trust-pickle, which inspect did not have. Without it the weight error is left out with the
    sentence the other commands give; with it the pickled model is loaded and the weight error computed."""
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    ck = tmp_path / "ck"
    shutil.copytree(arts["ck"], ck)
    m = json.loads((ck / "hqtflow_manifest.json").read_text())
    m["data"]["model_path"], m["model"] = str(model), None  # the checkpoint's source: the pickled copy
    (ck / "hqtflow_manifest.json").write_text(json.dumps(m))
    js = tmp_path / "c.json"
    text = inspect_ok(ck, "--json", js)
    rep = json.loads(js.read_text())
    assert not rep["weight_error"]["available"]
    assert f"{model / 'pytorch_model.bin'} is a pickle, and loading it runs whatever it holds: pass --trust-pickle" in text
    inspect_ok(ck, "--json", js, "--trust-pickle")
    rep = json.loads(js.read_text())
    assert rep["weight_error"]["available"] and len(rep["weight_error"]["layers"]) == 14
