"""The model fingerprint (hqtflow.models.fingerprint): what decides that a model is the one an artifact was made on."""

import json
import os
import shutil

from hqtflow import models


def _copy(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    return model


def _scale_last_row(model):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    name = max(n for n in tensors if n.endswith("down_proj.weight"))
    tensors[name][-1] *= 16
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})


def test_fingerprint_hashes_the_whole_weights_and_the_tokenizer_files(tiny_llama, tmp_path, monkeypatch):
    """A weight changed anywhere (the last row of the last layer) is another model; a tokenizer, chat template or
    generation config changed is the same model (`id`: quantize takes its measurement) with other files (`run`
    redoes its stages)."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    first = models.fingerprint(model)
    assert first["scheme"] == models.FINGERPRINT_SCHEME and models.fingerprint(model) == first
    _scale_last_row(model)
    weights = models.fingerprint(model)
    assert weights["id"] != first["id"] and weights["weights_sha256"] != first["weights_sha256"]
    assert (weights["config_sha256"], weights["weights_header_sha256"]) == (first["config_sha256"], first["weights_header_sha256"])
    for name in ("chat_template.jinja", "generation_config.json", "tokenizer_config.json"):
        assert name in models.MODEL_SIDE_FILES
        before = models.fingerprint(model)
        path = model / name
        path.write_text(path.read_text() + "\n" if path.is_file() else json.dumps({"bos_token_id": 1}))
        after = models.fingerprint(model)
        assert after["id"] == before["id"] and after["files_sha256"] != before["files_sha256"], name
        assert models.same_model(before, after)


def test_weight_digests_are_cached_until_the_file_changes(tiny_llama, tmp_path, monkeypatch):
    """A weight file's digest is read from the cache while its path, size and mtime hold: stages do not reread an
    unchanged model; a rewritten file is hashed again."""
    from hqtflow.formats import artifact

    model = _copy(tiny_llama, tmp_path, monkeypatch)
    first = models.fingerprint(model)
    assert list((tmp_path / "cache" / "digests").glob("*.json"))
    hashed = []
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda p, *a: hashed.append(p.name) or real(p, *a))
    assert models.fingerprint(model) == first and "model.safetensors" not in hashed
    weights = model / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert models.fingerprint(model) == first and "model.safetensors" in hashed


def test_each_side_file_is_hashed_once_per_fingerprint(tiny_llama, tmp_path, monkeypatch):
    """files_sha256 and calibration_files_sha256 share one digest per side file (the tokenizer, chat template and
    generation config were each read twice)."""
    from collections import Counter

    from hqtflow.formats import artifact

    model = _copy(tiny_llama, tmp_path, monkeypatch)
    (model / "chat_template.jinja").write_text("{{ messages }}")
    first = models.fingerprint(model)  # the weights' digests cached
    hashed = Counter()
    real = artifact.sha256_file
    monkeypatch.setattr(artifact, "sha256_file", lambda p, *a: hashed.update([p.name]) or real(p, *a))
    assert models.fingerprint(model) == first
    side = [f.name for f in models.side_files(model)]
    assert {"tokenizer_config.json", "chat_template.jinja"} <= set(side)
    assert hashed == Counter(side)


def test_a_weight_file_rewritten_in_place_with_its_mtime_put_back_is_hashed_again(tiny_llama, tmp_path, monkeypatch):
    """Same path, inode, size and mtime (restored as `touch -d` does) but other bytes: the ctime, which no user sets,
    tells the cached digest stale, so the fingerprint names another model."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    first = models.fingerprint(model)
    weights = model / "model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:  # in place: the same inode and size
        f.seek(st.st_size - 2)
        flipped = bytes(255 - b for b in f.read(2))  # the last weight's bytes, changed
        f.seek(st.st_size - 2)
        f.write(flipped)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = weights.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    assert models.fingerprint(model)["id"] != first["id"]


def test_an_older_fingerprint_is_checked_by_config_and_weight_headers(tiny_llama, tmp_path, monkeypatch):
    """A v1 artifact's fingerprint (hqtflow <= 0.4.0: sampled bytes, no `scheme`) names this model when its config
    and weight headers agree, all it can still tell; another model's is refused."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    fp = models.fingerprint(model)
    older = {"id": "0123456789abcdef", "config_sha256": fp["config_sha256"], "weights_sample_sha256": "0" * 64,
             "weights_header_sha256": fp["weights_header_sha256"], "model_type": "llama"}
    assert models.same_model(older, fp)
    assert not models.same_model({**older, "config_sha256": "1" * 64}, fp)
    assert not models.same_model({**older, "weights_header_sha256": "1" * 64}, fp)
    assert not models.same_model({**fp, "id": "0123456789abcdef"}, fp)


def test_a_fingerprint_recorded_before_calibration_files_sha256_is_still_current(tiny_llama, tmp_path, monkeypatch):
    """`run`'s currency checks: a measurement's or checkpoint's fingerprint written before hqtflow recorded
    calibration_files_sha256 is the model's when all it has agrees (it redid every stage after an upgrade)."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    fp = models.fingerprint(model)
    older = {k: v for k, v in fp.items() if k != "calibration_files_sha256"}
    assert models.same_fingerprint(older, fp) and models.same_calibration_model(older, fp)
    assert models.same_fingerprint(fp, fp) and models.same_calibration_model(fp, fp)
    other = {**older, "files_sha256": "1" * 64}  # its tokenizer or chat template since changed: not current
    assert not models.same_fingerprint(other, fp) and not models.same_calibration_model(other, fp)


STRAY = {"._model.safetensors": b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(range(256)) * 16,
         "consolidated.safetensors": b"\x10\0\0\0\0\0\0\0not json at all!"}


def test_a_stray_unreadable_safetensors_file_is_not_part_of_the_fingerprint(tiny_llama, tmp_path, monkeypatch):
    """A `.safetensors` file transformers does not load (macOS' `._model.safetensors`, a garbage
    `consolidated.safetensors`) whose header cannot be read leaves the fingerprint as it was: it crashed it
    (MemoryError, JSONDecodeError), after measure's calibration."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    clean = models.fingerprint(model)
    for name, content in STRAY.items():
        (model / name).write_bytes(content)
        assert models.weight_files(model) == [model / "model.safetensors"]
        assert models.fingerprint(model) == clean, name


def test_appledouble_twins_are_no_weight_files(tiny_llama, tmp_path, monkeypatch):
    """A folder with neither model.safetensors nor an index has every *.safetensors as its weights: macOS'
    `._weights.safetensors` twin was one of them, and resolve_model refused the model as damaged (its header is no
    safetensors header). `._*` files are left out (formats.APPLEDOUBLE), as side_files leaves them out."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    (model / "model.safetensors").rename(model / "weights.safetensors")
    (model / "._weights.safetensors").write_bytes(STRAY["._model.safetensors"])
    assert models.weight_files(model) == [model / "weights.safetensors"]
    assert models.resolve_model(str(model)) == model
    assert models.content_files(model) == [model / "weights.safetensors"]


def test_a_stray_safetensors_file_is_ignored_by_measure(tiny_llama, tmp_path, monkeypatch, wiki_text):
    """measure (a MemoryError traceback after calibration) takes the model; quantize's check is the fingerprint above."""
    from conftest import run_cli

    model = _copy(tiny_llama, tmp_path, monkeypatch)
    for name, content in STRAY.items():
        (model / name).write_bytes(content)
    r = run_cli("measure", model, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output


def test_measure_fingerprints_the_model_before_calibrating(tiny_llama, tmp_path, monkeypatch, wiki_text):
    """A model the fingerprint cannot be taken of is refused before the model is loaded, not after calibration."""
    from conftest import run_cli
    from hqtflow.errors import ModelError

    model = _copy(tiny_llama, tmp_path, monkeypatch)

    def unreadable(path):
        raise ModelError(f"Cannot fingerprint {path}.")

    def loaded(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "fingerprint", unreadable)
    monkeypatch.setattr(models, "load_model", loaded)
    r = run_cli("measure", model, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 4 and "Cannot fingerprint" in r.stderr, r.output


def test_the_model_path_artifacts_record_is_normalised(tiny_llama, tmp_path, monkeypatch, wiki_text):
    """`measure ../w/tiny` recorded `/.../w/../w/tiny`: `..` is now folded (os.path.abspath; a symlinked folder is
    recorded as the user named it), by measure and by import-hqt."""
    from conftest import run_cli
    from hqtflow.formats.artifact import read_manifest

    (tmp_path / "w").mkdir()
    shutil.copytree(tiny_llama, tmp_path / "w" / "tiny")
    monkeypatch.chdir(tmp_path / "w")
    r = run_cli("measure", "../w/tiny", "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output
    assert read_manifest(tmp_path / "m", "hqtflow.measurement").data["model_path"] == str(tmp_path / "w" / "tiny")
    (tmp_path / "dump").mkdir()
    shutil.copy(tmp_path / "m" / "measure_hooks_maxabs.json", tmp_path / "dump")
    r = run_cli("import-hqt", tmp_path / "dump", "-o", tmp_path / "i", "--model", "../w/tiny")
    assert r.exit_code == 0, r.output
    assert read_manifest(tmp_path / "i", "hqtflow.measurement").data["model_path"] == str(tmp_path / "w" / "tiny")


def test_a_model_with_only_pickled_weights_needs_trust_pickle(tiny_llama, tmp_path, monkeypatch, wiki_text):
    """pytorch_model.bin (torch.save) was loaded without a word; loading a pickle runs what it holds, so measure and
    generate refuse it in one sentence (exit 4) naming the file, --trust-pickle and the conversion; with the flag
    measure runs."""
    import torch
    from safetensors.torch import load_file

    from conftest import run_cli

    model = _copy(tiny_llama, tmp_path, monkeypatch)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    args = ["measure", model, "-o", tmp_path / "m", "--text", wiki_text, "--limit", "2", "--max-length", "32"]
    for argv in (args, ["generate", model, "-p", "x", "--max-new-tokens", "1"]):
        r = run_cli(*argv)
        assert r.exit_code == 4 and not (tmp_path / "m").exists(), r.output
        assert f"{model / 'pytorch_model.bin'} is a pickle" in r.stderr and "--trust-pickle" in r.stderr, r.output
        assert "safetensors" in r.stderr and "Traceback" not in r.output
    r = run_cli(*args, "--trust-pickle")
    assert r.exit_code == 0, r.output
    # the same folder found in the Hugging Face cache by a hub id (it was loaded without a word there)
    snapshot = tmp_path / "hub" / "models--org--pickled" / "snapshots" / ("0" * 40)
    shutil.copytree(model, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    r = run_cli("generate", "org/pickled", "-p", "x", "--max-new-tokens", "1")
    assert r.exit_code == 4 and "pytorch_model.bin is a pickle" in r.stderr, r.output


def test_macos_appledouble_twins_are_no_side_files(tmp_path):
    """A `._tokenizer.model` (macOS' AppleDouble twin, from a tar or a copy made on a Mac) matched the side files'
    `*.model` pattern: it was copied into the FP8 checkpoint and its export and hashed into the fingerprint. `._*`
    files are left out of side_files, as scan_dump leaves them out of a dump."""
    (tmp_path / "additional_chat_templates").mkdir()
    real = ["tokenizer.json", "tokenizer.model", "additional_chat_templates/tool_use.jinja", "tekken.tiktoken"]
    for name in real:
        (tmp_path / name).write_text("x")
    for name in ["._tokenizer.model", "._tokenizer.json", "._tekken.tiktoken", "._tokenizer.model.v3",
                 "additional_chat_templates/._tool_use.jinja"]:
        (tmp_path / name).write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        ")
    assert sorted(p.relative_to(tmp_path).as_posix() for p in models.side_files(tmp_path)) == sorted(real)


def test_digests_of_files_gone_are_pruned(tiny_llama, tmp_path, monkeypatch):
    """The digest cache kept an entry for every weight file ever hashed (every copied or deleted model) forever. A
    digest written a day or more after the last pruning drops the entries of files that no longer exist (and
    unreadable ones); the entries of files still there stay."""
    model = _copy(tiny_llama, tmp_path, monkeypatch)
    digests = tmp_path / "cache" / "digests"
    gone = tmp_path / "gone"
    shutil.copytree(model, gone)
    models.fingerprint(gone)
    shutil.rmtree(gone)
    (digests / ("0" * 32 + ".json")).write_text("{not json")
    models.fingerprint(model)  # within a day of the last pruning: nothing removed
    assert len(list(digests.glob("*.json"))) == 3
    stamp = digests / models.DIGESTS_PRUNED
    old = stamp.stat().st_mtime - models.PRUNE_DIGESTS_EVERY - 1
    os.utime(stamp, (old, old))
    (model / "model.safetensors").touch()  # hashed again: a digest is written
    models.fingerprint(model)
    left = [json.loads(p.read_text())["key"]["path"] for p in digests.glob("*.json")]
    assert left == [str((model / "model.safetensors").resolve())]


def test_python_callers_pass_trust_pickle(tiny_llama, tmp_path, monkeypatch):
    """--trust-pickle was a context variable the CLI wrapper set (hqtflow.models.TRUST_PICKLE): a library caller had
    to set a module global. It is now a parameter of the loaders that unpickle, passed down from the commands (the
    `measure --tp` launcher hands it to each rank as the flag)."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from hqtflow.api import load_any
    from hqtflow.errors import ModelError
    from hqtflow.measure import distributed
    from hqtflow.measure.settings import MeasureSettings

    model = _copy(tiny_llama, tmp_path, monkeypatch)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"pytorch_model\.bin is a pickle.*--trust-pickle .*\(trust_pickle=True in Python\)"):
        models.load_model(model, "fp32")
    assert not hasattr(models, "TRUST_PICKLE")
    m, tok, kind = load_any(str(model), "fp32", trust_pickle=True)
    assert kind == "fp32" and m.config.num_hidden_layers > 0 and tok is not None
    ranks = []
    monkeypatch.setattr(distributed, "_run_ranks", lambda cmd, out: ranks.append(cmd) or 0)
    for trust in (False, True):
        distributed.launch(MeasureSettings(output=str(tmp_path / "m"), model=str(model), tp=2), trust_pickle=trust)
    assert ["--trust-pickle" in cmd for cmd in ranks] == [False, True]
