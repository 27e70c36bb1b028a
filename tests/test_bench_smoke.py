"""The benchmarks run (their small versions): CI keeps them from rotting. Timing is never asserted."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_accuracy_smoke(smollm2, data_dir, tmp_path):
    out = tmp_path / "acc.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "accuracy.py"), "--smoke", "--model", str(smollm2),
                        "--data-dir", str(data_dir), "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "maxabs_arbitrary" in r.stdout and "Δ ppl" in r.stdout
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"bf16", "maxabs_arbitrary"}
    # a real model stays a real model in FP8
    assert res["maxabs_arbitrary"]["wikitext"]["perplexity"] < 1.2 * res["bf16"]["wikitext"]["perplexity"]
