"""KL-on-logits gate on the real SmolLM2: mean KL(bf16 || FP8) and top-1 agreement of the next-token distribution
on a fixed slice of WikiText-2 *test* (its first 512 tokens, 2 windows of 256), calibrated on WikiText-2 *valid*.

Measured on this slice (CPU kernel backend, 16 x 256 calibration tokens): maxabs_arbitrary KL 0.0465 / top-1
0.908, fp8_dynamic 0.0447 / 0.920, maxabs_pcs_pow2 0.0372 / 0.895 (GPTQ-rounded weights: see test_gptq's output). The gates leave about 25% headroom; longer
slices (bench/accuracy.py --kl) give lower KL (short windows have less context).
"""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.slow

TOKENS, WINDOW = 512, 256


@pytest.fixture(scope="module")
def bf16(smollm2):
    from hqtflow import models

    return models.load_model(smollm2, "bf16")


@pytest.fixture(scope="module")
def setup(smollm2, bf16, data_dir, tmp_path_factory):
    from hqtflow import models
    from hqtflow.accuracy import log_probs, token_windows

    meas = tmp_path_factory.mktemp("gate") / "meas"
    r = run_cli("measure", smollm2, "-o", meas, "--text", data_dir / "wikitext2_valid.txt", "--limit", "16",
                "--max-length", "256", "--batch-size", "8", "--hessians")
    assert r.exit_code == 0, r.output
    tok = models.load_tokenizer(smollm2)
    windows = token_windows(tok, data_dir / "wikitext2_test.txt", TOKENS, WINDOW)
    assert sum(w.shape[1] for w in windows) == TOKENS
    return meas, windows, log_probs(bf16, windows)


def gate(setup, method: str, gptq: bool = False):
    from hqtflow.accuracy import divergence
    from hqtflow.quantize.fp8_linear import set_backend
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

    meas, windows, ref = setup
    model, _ = quantize_in_memory(QuantizeSettings(measurement=str(meas), output="-", scale_method=method, gptq=gptq))
    set_backend(model, "auto")
    return divergence(ref, model, windows)


@pytest.fixture(scope="module")
def gates(setup):
    """gate(setup, method, gptq), each computed once: fp8_dynamic's is shared by three tests."""
    done = {}

    def get(method, gptq=False):
        if (method, gptq) not in done:
            done[method, gptq] = gate(setup, method, gptq)
        return done[method, gptq]

    return get


def test_default_method(gates):
    d = gates(None)  # maxabs_arbitrary, static per-tensor W8A8, lm_head bf16
    print(f"maxabs_arbitrary: mean KL {d.mean_kl:.4f}, top-1 {d.top1:.4f}")
    assert d.mean_kl < 0.06 and d.top1 > 0.88


@pytest.mark.parametrize("method", ["fp8_dynamic", "fp8_dynamic_mse", "maxabs_pcs_pow2"])
def test_dynamic_methods(gates, method):
    d = gates(method)
    print(f"{method}: mean KL {d.mean_kl:.4f}, top-1 {d.top1:.4f}")
    assert d.mean_kl < 0.055 and d.top1 > 0.87


def test_gptq(gates):
    """GPTQ-rounded weights (`quantize --gptq`, same scales) with per-token dynamic activations are closer to bf16
    than the same method's round-to-nearest weights. (The static default gains on 8192 tokens, bench/RESULTS.md,
    but not measurably on this short slice.)"""
    nearest, gptq = gates("fp8_dynamic"), gates("fp8_dynamic", gptq=True)
    print(f"fp8_dynamic: mean KL {nearest.mean_kl:.4f} -> {gptq.mean_kl:.4f} with GPTQ, "
          f"top-1 {nearest.top1:.4f} -> {gptq.top1:.4f}")
    # measured on this slice: 0.0466 -> 0.0407, top-1 0.902 -> 0.918 (on 8192 tokens: 0.0280 -> 0.0179)
    assert gptq.mean_kl < 0.92 * nearest.mean_kl and gptq.top1 > nearest.top1 - 0.005


def test_tuned_checkpoint(setup, gates, bf16, smollm2, data_dir, tmp_path):
    """`hqtflow tune` on SmolLM2 (fp8_dynamic, calibration text WikiText-2 valid) to 85% of the all-quantized KL
    there: the tuned checkpoint keeps a few Linear layers in bf16 and is closer to bf16 on the held-out test slice
    than the same method with every layer quantized."""
    import json

    import hqtflow
    from hqtflow import models
    from hqtflow.accuracy import divergence, log_probs, token_windows
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory

    meas, windows, ref = setup
    calib = token_windows(models.load_tokenizer(smollm2), data_dir / "wikitext2_valid.txt", 256, 128)
    model, _ = quantize_in_memory(QuantizeSettings(measurement=str(meas), output="-", scale_method="fp8_dynamic"))
    full_calib = divergence(log_probs(bf16, calib), model, calib).mean_kl
    target = 0.85 * full_calib
    r = run_cli("tune", "-m", meas, "-o", tmp_path / "tune", "--text", data_dir / "wikitext2_valid.txt",
                "--scale-method", "fp8_dynamic", "--target-kl", str(target), "--tokens", "256", "--window", "128")
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "tune" / "sensitivity.json").read_text())
    # tune measured what this test did (in fp32 on CPUs without native bf16: close, not equal)
    tol = 1e-6 if report["compute_dtype"] == "bf16" else 0.1 * full_calib
    assert abs(report["all_quantized"]["mean_kl"] - full_calib) < tol
    assert report["kept_bf16"] and report["tuned"]["mean_kl"] <= target
    full = gates("fp8_dynamic")
    tuned_model, _ = hqtflow.load(tmp_path / "tune" / "checkpoint", dtype="bf16")  # as `full` computes
    tuned = divergence(ref, tuned_model, windows)
    kept = len(report["kept_bf16"])
    print(f"tuned: {kept} of {report['linear_layers']} Linear layers in bf16; held-out mean KL {full.mean_kl:.4f} -> "
          f"{tuned.mean_kl:.4f}, top-1 {full.top1:.4f} -> {tuned.top1:.4f}")
    assert tuned.mean_kl < full.mean_kl
