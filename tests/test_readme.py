"""The README a newcomer follows: its shape, and every command of its `bash` blocks run for real on SmolLM2.

The walk-through runs in a scratch copy of the repository's layout (Makefile, recipes, configs, `../shared/data`),
so the user's own `out/` is never touched. `make demo` runs the Makefile's real target with `BIN` pointing at a
shim that runs this checkout's hqtflow (the venv it would create already exists here); `make test` is only
dry-run (`make -n`), since running the suite from inside the suite would recurse.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DATA_DIR, ROOT, need

README = ROOT / "README.md"
BLOCK = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def bash_blocks() -> list[str]:
    return BLOCK.findall(README.read_text())


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    commands = [ln.split("#")[0].strip() for b in bash_blocks() for ln in b.splitlines() if ln.split("#")[0].strip()]
    assert commands[:2] == ["make demo", "make test"]
    for heading in ("## Prerequisites", "## What next after `make demo`", "## Stage reference", "## Exit codes"):
        assert heading in text
    assert ".venv" in text and "python3.11" in text.lower().replace("python 3.11", "python3.11")


def test_readme_commands_name_real_options():
    """Every `hqtflow CMD --option` in the README is an option that command has (checked against its --help)."""
    from typer.main import get_command

    from hqtflow.cli import app

    root = get_command(app)
    text = "\n".join(bash_blocks()).replace("\\\n", " ")
    checked = 0
    for line in text.splitlines():
        line = line.split("#")[0]
        m = re.search(r"\bhqtflow ([a-z-]+)(?: (fp8|bf16))?(.*)", line)
        if not m:
            continue
        cmd = root.commands[m.group(1)]
        if m.group(2):
            cmd = cmd.commands[m.group(2)]
        known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
        for opt in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", m.group(3)):
            assert opt in known, f"README: `hqtflow {m.group(1)}` has no option {opt}"
            checked += 1
    assert checked >= 20



def test_readme_names_every_command_and_the_cli_pipeline():
    """`hqtflow --help` lists no command the README leaves out, and its summary chains the stages as the README does."""
    from typer.main import get_command

    from hqtflow.cli import app

    text = README.read_text()
    for name in get_command(app).commands:
        assert f"hqtflow {name}" in text, f"README does not name `hqtflow {name}`"
    pipeline = " ".join(re.search(r"^```\n(measure .*?)\n```", text, re.M).group(1).split())
    assert pipeline in " ".join(app.info.help.split()), (pipeline, app.info.help)

def test_the_readme_eval_max_length_example_does_what_it_says(tiny_kv, tmp_path):
    """The README's worked `eval --max-length` example, run on the tiny FP8 checkpoint in place of SmolLM2's (the
    walk-through runs it on SmolLM2): perplexity over --ppl-windows windows of --max-length tokens."""
    import json
    import shlex

    from conftest import run_cli

    lines = [ln for b in bash_blocks() for ln in b.splitlines() if ln.startswith("hqtflow eval") and "--max-length" in ln]
    assert len(lines) == 1, lines
    args = [str(tiny_kv[1]) if a == "out/smollm2/fp8" else a.replace("../shared/data", str(DATA_DIR))
            for a in shlex.split(lines[0].split("#")[0])[2:]]
    r = run_cli("eval", *args, "--report", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    ppl = json.loads((tmp_path / "r.json").read_text())["results"]["fp8"]["wikitext"]
    given = lambda flag: int(args[args.index(flag) + 1])  # noqa: E731
    assert (ppl["windows"], ppl["window"]) == (given("--ppl-windows"), given("--max-length")) and ppl["window"] < 512


def _shim(bin_dir: Path) -> None:
    bin_dir.mkdir()
    exe = bin_dir / "hqtflow"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hqtflow "$@"\n')
    exe.chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)


def _run_block(script: str, cwd: Path, env: dict, timeout: int) -> tuple[int, str]:
    p = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return -9, out + f"\n[timed out after {timeout} s]"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # a background server the block left behind
        except ProcessLookupError:
            pass
    return p.returncode, out


@pytest.mark.slow
def test_every_readme_command_runs(tmp_path, smollm2):
    need((DATA_DIR / "wikitext2_valid.txt").is_file(), f"shared data not found at {DATA_DIR}")
    need(shutil.which("make") is not None and shutil.which("curl") is not None, "make and curl are needed")
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(ROOT / name, repo / name)
    for name in ("recipes", "quantization_config"):
        shutil.copytree(ROOT / name, repo / name)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "data").symlink_to(DATA_DIR.resolve())
    bin_dir = tmp_path / "bin"
    _shim(bin_dir)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

    blocks = bash_blocks()
    assert blocks, "the README has no bash blocks"
    for i, block in enumerate(blocks):
        script = re.sub(r"^make demo\b", f"make demo BIN={bin_dir}", block, flags=re.M)
        script = re.sub(r"^make test\b", f"make -n test BIN={bin_dir}", script, flags=re.M)
        rc, out = _run_block(script, repo, env, timeout=1500 if "make demo" in block else 900)
        assert rc == 0, f"README block {i} failed (exit {rc}):\n{block}\n--- output ---\n{out[-6000:]}"
        if "make demo" in block:
            assert (repo / "out/smollm2/fp8/hqtflow_manifest.json").is_file()
            assert "wikitext2" in out and "piqa_local" in out, "make demo printed no eval table"
            rc, again = _run_block(script, repo, env, timeout=900)
            assert rc == 0 and again.count("up to date") == 3, again[-3000:]
            assert "wikitext2" in again, "make demo run twice does not print the table again"
        if "hqtflow serve" in block:
            assert '"generated_text"' in out and '"chat.completion"' in out and '"tool_calls"' in out, out[-3000:]
        if "hqtflow unify" in block:
            assert (repo / "out/m3to1/hqtflow_manifest.json").is_file()
            assert (repo / "out/fp8-from-m3/hqtflow_manifest.json").is_file()
