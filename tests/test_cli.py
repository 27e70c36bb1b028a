"""The CLI answers at once (heavy libraries are imported lazily) and maps user errors to exit code 2."""

import subprocess
import sys

from conftest import run_cli


def test_help_imports_nothing_heavy():
    code = ("import sys; from hqtflow.cli import app; "
            "heavy = [m for m in ('torch', 'transformers', 'lm_eval', 'numpy') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    r = subprocess.run([sys.executable, "-m", "hqtflow", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "measure" in r.stdout


def test_version():
    from hqtflow import __version__

    r = run_cli("version")
    assert r.exit_code == 0 and r.stdout.strip() == __version__


def test_model_commands(tmp_path, monkeypatch):
    r = run_cli("model", "prepare", "llama-9000")
    assert r.exit_code == 2 and "Unknown embedded model 'llama-9000'" in r.stderr
    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path))
    r = run_cli("model", "path", "smollm2")
    assert r.exit_code == 2 and "not prepared yet" in r.stderr
