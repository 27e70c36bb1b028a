"""`--engine inc`: Neural Compressor's prepare/convert driven by hqtflow (CPU, QDQ), against hqtflow's own engine.

- measure: INC's observers over the same calibration data write the same statistics as hqtflow's (bit for bit for
  the bf16 tiny model), wrapped in the same artifact (manifest, INC config), which hqtflow's quantize accepts.
- run: INC's converted model gives hqtflow's QDQ runtime's logits bit for bit for the power-of-two methods.
- quantize: the checkpoint built from INC's modules equals hqtflow's own checkpoint tensor for tensor (maxabs_pow2).
- the CLI path measure --engine inc -> quantize --engine inc / generate --engine inc, and its refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from hqtflow.errors import HqtflowError
from hqtflow.formats import measurement as mf
from hqtflow.measure.run import MeasureSettings, measure
from hqtflow.quantize.run import QuantizeSettings

POW2_METHODS = ["maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2", "unit_scale"]


def _settings(model: Path, out: Path, text: Path, **kw) -> MeasureSettings:
    return MeasureSettings(output=str(out), model=str(model), text=(str(text),),
                           **{"limit": 4, "max_length": 64, "batch_size": 2, **kw})


@pytest.fixture(scope="module")
def pair(inc, tiny_llama, wiki_text, tmp_path_factory) -> tuple[Path, Path]:
    """(hqtflow engine, INC engine) measurements of the tiny bf16 Llama on the same text windows."""
    from hqtflow.engines import inc as engine

    root = tmp_path_factory.mktemp("engines")
    ours = measure(_settings(tiny_llama, root / "hqtflow", wiki_text), show_progress=False)
    theirs = engine.measure(_settings(tiny_llama, root / "inc", wiki_text), "cpu", show_progress=False)
    return ours, theirs


def _nodes(d: Path) -> dict:
    return mf.read_measurement(d / "measure_hooks_maxabs.json").nodes


def test_inc_measurement_equals_hqtflow(pair):
    ours, theirs = pair
    a, b = _nodes(ours), _nodes(theirs)
    assert a and set(a) == set(b)  # every Linear, lm_head included
    for name in a:
        for x, y in ((a[name].inputs[0], b[name].inputs[0]), (a[name].params["weight"], b[name].params["weight"])):
            assert x.shape == y.shape and np.array_equal(x, y), name
    # the JSON INC wrote holds the same numbers as hqtflow's file, in the same layout
    nodes = lambda d: json.loads((d / "measure_hooks_maxabs.json").read_text())["Nodes"]
    assert nodes(ours) == nodes(theirs)


def test_inc_measurement_artifact(pair):
    from hqtflow.formats.artifact import read_manifest, sha256_file

    ours, theirs = pair
    m = read_manifest(theirs, "hqtflow.measurement")
    d = m.data
    assert d["engine"]["name"] == "inc" and d["engine"]["device"] == "cpu"
    assert d["world_size"] == 1 and d["ranks"][0]["stem"] == "measure_hooks_maxabs"
    assert d["calibration"]["samples"] == 4 and d["calibration"]["tokens"] == 4 * 64
    ref = read_manifest(ours, "hqtflow.measurement")
    assert m.model == ref.model  # the same model fingerprint
    assert d["calibration"]["sources"] == ref.data["calibration"]["sources"]
    assert set(d["ranks"][0]["layers"]) == set(ref.data["ranks"][0]["layers"])
    for name, info in d["ranks"][0]["layers"].items():
        want = ref.data["ranks"][0]["layers"][name]
        assert {k: info[k] for k in ("type", "style", "weight_shape", "input_dim", "output_dim")} == \
            {k: want[k] for k in ("type", "style", "weight_shape", "input_dim", "output_dim")}, name
    files = json.loads((theirs / "hqtflow_manifest.json").read_text())["files"]
    for f in ("measure_hooks_maxabs.json", "measure_hooks_maxabs.npz", "measure_hooks_maxabs_mod_list.json", "quant_config.json"):
        assert files[f] == sha256_file(theirs / f), f
    cfg = json.loads((theirs / "quant_config.json").read_text())
    assert cfg["mode"] == "QUANTIZE" and cfg["dump_stats_path"] == str(theirs.resolve() / "measure")
    assert not any(p.name.startswith(".") for p in theirs.parent.iterdir())  # no partial directory left


def test_progress_counts_a_batch_after_it_ran(inc, tiny_llama, wiki_text, tmp_path, monkeypatch):
    """The bar's tok/s is tokens done over time taken: a batch is counted after its forward (it was counted before,
    so the first update showed its tokens over almost no time: a six-figure rate)."""
    from hqtflow.engines import inc as engine
    from hqtflow.progress import Progress

    forwards, seen = [], []
    monkeypatch.setattr(engine, "_step", lambda device: forwards.append(device))
    monkeypatch.setattr(Progress, "update", lambda self, samples, tokens: seen.append(len(forwards)))
    engine.measure(_settings(tiny_llama, tmp_path / "i", wiki_text), "cpu", show_progress=False)
    assert seen and all(n > i for i, n in enumerate(seen))  # batch i counted after its forward(s)


def test_records_of_different_lengths_give_hqtflows_statistics(inc, tiny_llama, tmp_path):
    """Records of different lengths are batched with windows of their length, never padded: INC's observers see
    what hqtflow's do, bit for bit."""
    from hqtflow.engines import inc as engine

    records = tmp_path / "var.jsonl"
    words = "the quick brown fox jumps over the lazy dog near a river bank".split()
    records.write_text("".join(json.dumps({"text": " ".join(words[: 2 + 2 * i] * (1 + i))}) + "\n" for i in range(5)))
    ours = measure(_settings(tiny_llama, tmp_path / "h", records, batch_size=3, limit=None), show_progress=False)
    theirs = engine.measure(_settings(tiny_llama, tmp_path / "i", records, batch_size=3, limit=None), "cpu",
                            show_progress=False)
    a, b = _nodes(ours), _nodes(theirs)
    assert set(a) == set(b)
    for name in a:
        assert np.array_equal(a[name].inputs[0], b[name].inputs[0]), name


def test_lm_eval_calibration_inc(inc, tiny_llama, data_dir, tmp_path):
    """The lm-eval source through INC's observers: the same requests (padded batches of choices) and task results
    as hqtflow's engine, and statistics equal within a bf16 rounding."""
    from hqtflow.engines import inc as engine

    kw = dict(model=str(tiny_llama), tasks=("piqa_local",), data_dir=str(data_dir), limit=3, batch_size=4)
    ours = measure(MeasureSettings(output=str(tmp_path / "h"), **kw), show_progress=False)
    theirs = engine.measure(MeasureSettings(output=str(tmp_path / "i"), **kw), "cpu", show_progress=False)
    cal = lambda d: json.loads((d / "hqtflow_manifest.json").read_text())["data"]["calibration"]
    a, b = cal(ours), cal(theirs)
    assert b["samples"] == a["samples"] == 6 and b["tokens"] == a["tokens"] > 0
    assert b["sources"][0]["kind"] == "lm-eval"
    assert b["sources"][0]["results"]["piqa_local"]["acc"] == a["sources"][0]["results"]["piqa_local"]["acc"]
    na, nb = _nodes(ours), _nodes(theirs)
    assert set(na) == set(nb)
    for name in na:
        x, y = float(na[name].inputs[0].max()), float(nb[name].inputs[0].max())
        assert abs(x / y - 1) <= 2.0**-7, (name, x, y)


@pytest.mark.parametrize("method", POW2_METHODS)
def test_inc_runtime_logits_equal_hqtflow_qdq(method, pair):
    from hqtflow.engines import inc as engine
    from hqtflow.quantize.fp8_linear import set_backend
    from hqtflow.quantize.run import quantize_in_memory

    ours, theirs = pair
    qmodel, _ = engine.load_run(None, theirs, device="cpu", scale_method=method)
    assert engine.patched_linears(qmodel)
    ref, _ = quantize_in_memory(QuantizeSettings(measurement=str(ours), output="-", scale_method=method))
    set_backend(ref, "qdq")
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = qmodel(input_ids=ids).logits, ref(input_ids=ids).logits
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


def test_inc_checkpoint_equals_hqtflow_checkpoint(pair, tmp_path):
    from safetensors.torch import load_file

    from hqtflow.engines import inc as engine
    from hqtflow.formats.artifact import read_manifest
    from hqtflow.quantize.run import quantize

    ours, theirs = pair
    a = engine.quantize(QuantizeSettings(measurement=str(theirs), output=str(tmp_path / "inc"), scale_method="maxabs_pow2"))
    b = quantize(QuantizeSettings(measurement=str(ours), output=str(tmp_path / "hq"), scale_method="maxabs_pow2"))
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(ta) == set(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)), k
    ma, mb = read_manifest(a, "hqtflow.checkpoint"), read_manifest(b, "hqtflow.checkpoint")
    assert ma.data["engine"]["name"] == "inc"
    assert ma.data["quantized"] == mb.data["quantized"] and ma.data["skipped"] == mb.data["skipped"]
    assert json.loads((a / "config.json").read_text())["quantization_config"] == \
        json.loads((b / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("method", ["maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2"])
def test_inc_scale_files_equal_hqtflow(method, pair, tmp_path):
    """quantize --engine inc --scales-only: the scale files INC wrote, laid out as hqtflow's engine lays out its own,
    with the same scales."""
    from hqtflow.engines import inc as engine
    from hqtflow.formats.artifact import read_manifest
    from hqtflow.quantize.run import quantize

    ours, theirs = pair
    s = dict(scale_method=method, scales_only=True)
    a = engine.quantize(QuantizeSettings(measurement=str(theirs), output=str(tmp_path / "inc"), **s))
    b = quantize(QuantizeSettings(measurement=str(ours), output=str(tmp_path / "hq"), **s))
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    stem = f"measure_hooks_maxabs_{method.upper()}"
    ja, jb = (json.loads((d / f"{stem}.json").read_text()) for d in (a, b))
    assert ja["Mode"] == jb["Mode"] == "Scale" and set(ja["Nodes"]) == set(jb["Nodes"])
    assert ja["Nodes"] == jb["Nodes"]
    ma = read_manifest(a, "hqtflow.scales")
    assert ma.data["engine"]["name"] == "inc" and ma.data["world_size"] == 1
    assert set(ma.data["files"]) == set(read_manifest(b, "hqtflow.scales").data["files"])
    cfg = json.loads((a / "quant_config.json").read_text())
    assert cfg["mode"] == "QUANTIZE" and cfg["use_qdq"] and cfg["dump_stats_path"] == str(a.resolve() / "measure")


def test_cli_inc_end_to_end(inc, tiny_llama, wiki_text, tmp_path, monkeypatch):
    import tempfile

    meas, ckpt, tmp = tmp_path / "m", tmp_path / "fp8", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # INC's FP8Config temp files: none may stay behind
    r = run_cli("measure", tiny_llama, "-o", meas, "--engine", "inc", "--device", "cpu", "--text", wiki_text,
                "--limit", "4", "--max-length", "64", "--batch-size", "2")
    assert r.exit_code == 0, r.output
    assert "Wrote" in r.stdout and (meas / "hqtflow_manifest.json").is_file()
    r = run_cli("quantize", "-m", meas, "-o", ckpt, "--engine", "inc", "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    assert "FP8 checkpoint, maxabs_pow2" in r.stdout
    # INC at load vs hqtflow's QDQ runtime on the checkpoint INC's modules made: the same greedy tokens
    r1 = run_cli("generate", tiny_llama, "--engine", "inc", "-m", meas, "--scale-method", "maxabs_pow2",
                 "--max-new-tokens", "8", "-p", "The city")
    r2 = run_cli("generate", ckpt, "--backend", "qdq", "--dtype", "bf16", "--max-new-tokens", "8", "-p", "The city")
    assert r1.exit_code == 0 and r2.exit_code == 0, (r1.output, r2.output)
    assert r1.stdout.strip() and r1.stdout == r2.stdout
    # hqtflow's own quantize reads the INC-engine measurement too
    r = run_cli("quantize", "-m", meas, "-o", tmp_path / "own", "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    assert list(tmp.iterdir()) == []


def test_cli_eval_and_serve_inc(pair, data_dir, tmp_path, monkeypatch):
    from hqtflow.runtime import server

    _, theirs = pair
    model = json.loads((theirs / "hqtflow_manifest.json").read_text())["data"]["model_path"]
    report = tmp_path / "eval.json"
    r = run_cli("eval", model, "--engine", "inc", "-m", theirs, "--scale-method", "maxabs_pow2",
                "--ppl-file", data_dir / "wikitext2_test.txt", "--ppl-windows", "1", "--report", report)
    assert r.exit_code == 0, r.output
    results = json.loads(report.read_text())["results"]
    assert set(results) == {"bf16", "fp8"}  # the bf16 model itself is the baseline
    ppl = {k: v["wikitext"]["perplexity"] for k, v in results.items()}
    assert ppl["fp8"] != ppl["bf16"] and abs(ppl["fp8"] / ppl["bf16"] - 1) < 0.1, ppl
    # the scale method from a QUANT_CONFIG, given with -c or in the environment (eval ignored both before)
    cfg = tmp_path / "pow2.json"
    cfg.write_text(json.dumps({"mode": "QUANTIZE", "scale_method": "maxabs_pow2", "blocklist": {"names": ["lm_head"]}}))
    for i, (args, env) in enumerate(((("-c", cfg), None), ((), str(cfg)))):
        if env:
            monkeypatch.setenv("QUANT_CONFIG", env)
        out = tmp_path / f"eval{i}.json"
        r = run_cli("eval", model, "--engine", "inc", "-m", theirs, *args, "--no-baseline",
                    "--ppl-file", data_dir / "wikitext2_test.txt", "--ppl-windows", "1", "--report", out)
        assert r.exit_code == 0, r.output
        assert json.loads(out.read_text())["results"]["fp8"]["wikitext"]["perplexity"] == ppl["fp8"]
    monkeypatch.delenv("QUANT_CONFIG")

    served = {}
    monkeypatch.setattr(server, "_run", lambda app, sock: served.update(app=app))
    server._serve(None, model, server.ServeSettings(), kind="fp8", measurement=str(theirs), backend="auto",
                  dtype="auto", inc_device="cpu", scale_method="maxabs_pow2")
    assert served["app"] is not None
    with pytest.raises(HqtflowError, match="no KV-cache scales .* serve it with --kv-cache bf16"):  # create_app's refusal, worded
        server._serve(None, model, server.ServeSettings(kv_cache="fp8"), kind="fp8", measurement=str(theirs),
                      backend="auto", dtype="auto", inc_device="cpu", scale_method="maxabs_pow2")
    with pytest.raises(HqtflowError, match="serve fp8 MODEL -m DIR"):
        server._serve(None, model, server.ServeSettings(), kind="bf16", measurement=str(theirs), backend="auto",
                      dtype="auto", inc_device="cpu")
    assert "--engine" in run_cli("serve", "fp8", "--help").stdout


@pytest.mark.parametrize("args,message", [
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--scale-method", "maxabs_hw"], "cannot run maxabs_hw on CPU"),
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--scale-method", "maxabs_pow2_opt_weight"], "torch.hpu"),
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--scales-only", "--scale-method", "unit_scale"], "writes no scale file for unit_scale"),
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--disk-offload"], "--disk-offload is not implemented with --engine inc"),
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--device", "hpu"], "habana_frameworks.torch"),
    (["quantize", "-m", "{m}", "-o", "{o}", "--device", "cpu"], "use it with --engine inc"),
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "tensorrt"], "--engine must be hqtflow or inc, not 'tensorrt'"),
    (["generate", "--engine", "inc"], "give its measurement with -m"),
    (["generate", "-m", "{m}"], "quantize at load with --engine inc"),
    (["eval", "-c", "maxabs_quant", "--ppl-file", "{t}"], "quantize at load with --engine inc"),
    (["generate", "--engine", "inc", "-m", "{m}", "--backend", "cpu"], "--backend sets hqtflow's FP8 runtime"),
    (["eval", "--engine", "inc", "-m", "{m}", "--dtype", "fp32", "--ppl-file", "{t}"], "--dtype sets hqtflow's FP8 runtime"),
    (["eval", "--engine", "inc", "-m", "{m}"], "Nothing to evaluate"),
    (["measure", "-o", "{o}", "--engine", "inc", "--text", "{t}", "--tp", "2"], "measures on one card"),
    # INC's own tracebacks before: a method INC lacks, a per-channel measure without INC's shape run
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--scale-method", "fp8_dynamic"],
     "fp8_dynamic is hqtflow's own (compressed-tensors FP8_DYNAMIC), which INC does not have; run it with hqtflow's"),
    (["generate", "--engine", "inc", "-m", "{m}", "--scale-method", "smoothquant_opt"], "3.10 does not have"),
    (["measure", "{x}", "-o", "{o}", "--engine", "inc", "--text", "{t}", "-c", "maxabs_per_channel_measure"],
     "per-channel observer needs a shape run"),
    # silently CPU scales recorded for a Gaudi2 before
    (["quantize", "-m", "{m}", "-o", "{o}", "--engine", "inc", "--scales-only", "--scales-for", "gaudi2",
      "--scale-method", "maxabs_pow2"], "computes scales for the CPU, not GAUDI2"),
])
def test_cli_refusals(pair, tiny_llama, wiki_text, tmp_path, args, message):
    _, theirs = pair
    filled = [a.format(m=theirs, o=tmp_path / "out", t=wiki_text, x=tiny_llama) for a in args]
    r = run_cli(*filled)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_generate_inc_from_an_fp32_measurement(inc, tiny_llama, wiki_text, tmp_path):
    """A measurement made in fp32 runs under INC in the config's hp_dtype (bf16): the model around INC's modules runs
    in it too (an fp32 model gave attention fp32 queries and bf16 values: a RuntimeError, exit 1)."""
    meas = tmp_path / "m"
    r = run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "2", "--max-length", "32",
                "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    r = run_cli("generate", tiny_llama, "--engine", "inc", "--device", "cpu", "-m", meas, "--scale-method",
                "maxabs_pow2", "-p", "hi", "--max-new-tokens", "2")
    assert r.exit_code == 0 and r.stdout.strip(), r.output
