"""The benchmarks' command lines and headers (fast: nothing is timed; tests/test_bench_smoke.py runs them)."""

import importlib.util
import re
import subprocess
import sys

import pytest

from conftest import ROOT

# every CPU bench prints the machine it ran on, one shared line
MACHINE_BENCHES = ("accuracy", "decode", "engine_vs_transformers", "fp8_cuda", "forward", "fp8_linear", "kv_cache_ppl", "measure_overhead", "moe_experts",
                   "paged_attention", "quantize_offload")


def test_machine_line_has_the_cpu_flags_and_the_load():
    from hqtflow.hardware import machine_line

    assert re.fullmatch(r"CPU flags: .+; \d+ CPUs; load average [\d.]+ [\d.]+ [\d.]+ \(1/5/15 min\)", machine_line())


@pytest.mark.parametrize("bench", MACHINE_BENCHES)
def test_every_bench_prints_the_machine_line(bench):
    source = (ROOT / "bench" / f"{bench}.py").read_text()
    assert "machine_line()" in source


@pytest.mark.parametrize("bench,last_words", [("kv_cache_ppl", "--windows 8"), ("moe_experts", "measured in one run")])
def test_help_is_the_whole_description(bench, last_words):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / f"{bench}.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and last_words in r.stdout, r.stdout


def test_offload_throughput_without_time_left_is_not_a_number():
    """A run no longer than the import baseline's process leaves no time to divide by: n/a, not 198719488 GB/s."""
    spec = importlib.util.spec_from_file_location("quantize_offload", ROOT / "bench" / "quantize_offload.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._gbs(None, 6) == "   n/a" and bench._gbs(1.5, 6) == "  1.50"
    assert bench.net_throughput(1e9, wall_s=2.0, base_s=2.5) is None and bench.net_throughput(1e9, 3.0, 2.0) == 1.0


def test_run_cuda_sh_fails_when_a_step_fails(tmp_path):
    """bench/run_cuda.sh: a failing step's exit status was lost in its `| tee` (exit 0); the default serve step without
    TOKENIZER/TEXT is refused before anything runs; positional arguments (the docs showed `1b,8b`) are refused."""
    import os

    def run(*args, **env):
        env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": os.environ["PATH"], **env}
        return subprocess.run(["bash", str(ROOT / "bench" / "run_cuda.sh"), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    failing = run(STEPS="tests", PYTHON="false")
    assert failing.returncode == 1 and "failed: tests" in failing.stderr
    assert run(STEPS="tests", PYTHON="true").returncode == 0
    no_tokenizer = run(PYTHON="true", OUT=str(tmp_path / "refused"))
    assert no_tokenizer.returncode == 2 and "The serve step needs TOKENIZER" in no_tokenizer.stderr
    assert not (tmp_path / "refused").exists()
    refused = run("1b,8b", STEPS="bench", PYTHON="true")
    assert refused.returncode == 2 and "takes no arguments" in refused.stderr
    fake = tmp_path / "fake_python"  # a pytest that fails: its summary is the log's last lines, after any bench output
    fake.write_text("#!/bin/sh\necho 'FAILED tests/x.py::test_y'\necho '1 failed, 2 passed in 1.0s'\nexit 1\n")
    fake.chmod(0o755)
    summary = run(STEPS="tests", PYTHON=str(fake))
    assert summary.returncode == 1 and summary.stdout.splitlines()[-3:] == [
        "tests:", "FAILED tests/x.py::test_y", "1 failed, 2 passed in 1.0s"], summary.stdout
    usage = (ROOT / "bench" / "run_cuda.sh").read_text()
    assert "TOKENIZER=DIR TEXT=FILE bash bench/run_cuda.sh" in usage
    assert "bench/run_cuda.sh 1b" not in (ROOT / "bench" / "RESULTS.md").read_text()


def test_decode_picks_the_fastest_high_precision_engine_per_batch(monkeypatch):
    """RESULTS' figures (bf16 static 14.6 / 100.4, fp32 static 18.7 / 80.1 tok/s at b1 / b8): fp32 at batch 1, bf16 at
    batch 8 (one pick for all batches took fp32 and divided b8 by 80.1, a 1.61x where the fastest gives 1.29x)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # decode.py imports bench/checkpoint.py
    spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "bench" / "decode.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = {"bf16 static": {1: 14.6, 8: 100.4}, "fp32 static": {1: 18.7, 8: 80.1}}
    assert bench.fastest_per_batch(results, ["bf16 static", "fp32 static"], [1, 8]) == {1: "fp32 static", 8: "bf16 static"}


def test_output_checks_fail_a_wrong_path_loudly():
    """bench/checks.py: an FP8 output close to the high-precision one passes; a wrong one exits with a sentence (no
    ratio). serve_load's agreement counts streams whose first 4 greedy tokens match."""
    import sys as _sys

    _sys.path.insert(0, str(ROOT / "bench"))
    from checks import require_sqnr, require_top5

    torch = pytest.importorskip("torch")
    ref = torch.randn(64, 256)
    assert require_sqnr("ok", ref, ref + 0.01 * torch.randn_like(ref)) > 30
    with pytest.raises(SystemExit, match="computes the wrong thing"):
        require_sqnr("wrong", ref, torch.randn_like(ref))
    assert require_top5("ok", ref, ref) == 1.0
    with pytest.raises(SystemExit, match="top 5 at only"):
        require_top5("wrong", ref, -ref)
    spec = importlib.util.spec_from_file_location("serve_load_bench", ROOT / "bench" / "serve_load.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.agreement([[1, 2, 3, 4, 5], [1, 2]], [[1, 2, 3, 4, 9], [1, 3]]) == 0.5
