"""Artifacts are written atomically with a manifest last, and refused when missing, partial, edited or newer."""

import json
import os
from pathlib import Path

import pytest

from hqtflow.errors import ArtifactError
from hqtflow.formats.artifact import MANIFEST, read_manifest, staged_output, write_manifest


def _make(out, **kw):
    with staged_output(out, **kw) as tmp:
        (tmp / "a.json").write_text("{}")
        (tmp / "b.bin").write_bytes(b"\x00" * 10)
        (tmp / ".c_hooks.json").write_text("{}")  # a dot-file (a dump_stats_path named ".c") is hashed too
        write_manifest(tmp, "hqtflow.test", 1, model={"id": "m"}, config={"k": 1}, data={"n": 2})
    return out


def test_roundtrip(tmp_path):
    out = _make(tmp_path / "art")
    m = read_manifest(out, "hqtflow.test", 1)
    assert m.files.keys() == {"a.json", "b.bin", ".c_hooks.json"} and m.data == {"n": 2} and m.model == {"id": "m"}
    assert m.raw["tool"]["hqtflow"] and m.raw["_version"] == 1
    assert not list(tmp_path.glob(".*")) and not (out / ".hqtflow-partial").exists(), "no staging leftovers"


def test_failure_leaves_nothing(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(RuntimeError):
        with staged_output(out) as tmp:
            (tmp / "a.json").write_text("{}")
            raise RuntimeError("boom")
    assert not out.exists() and not list(tmp_path.iterdir())


def test_existing_output_refused_then_overwritten(tmp_path):
    out = _make(tmp_path / "art")
    with pytest.raises(ArtifactError, match="already exists; pass --overwrite"):
        _make(out)
    before = read_manifest(out, "hqtflow.test", 1).raw["created"]
    _make(out, overwrite=True)
    assert read_manifest(out, "hqtflow.test", 1).raw["created"] >= before
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_failed_overwrite_keeps_old(tmp_path):
    out = _make(tmp_path / "art")
    with pytest.raises(RuntimeError):
        with staged_output(out, overwrite=True):
            raise RuntimeError("boom")
    read_manifest(out, "hqtflow.test", 1)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / MANIFEST).unlink(), "writing did not finish"),
        (lambda d: (d / "b.bin").unlink(), "incomplete: b.bin"),
        (lambda d: (d / "a.json").write_text('{"x": 1}'), "modified after it was written: a.json"),
        (lambda d: (d / ".c_hooks.json").write_text('{"x": 1}'), "modified after it was written: .c_hooks.json"),
        (lambda d: (d / MANIFEST).write_text("{"), "corrupt"),
        (lambda d: _patch(d, _version=2), "newer hqtflow"),
        (lambda d: _patch(d, _type="hqtflow.scales"), "not the 'hqtflow.test'"),
    ],
)
def test_damaged_artifacts_refused(tmp_path, damage, message):
    out = _make(tmp_path / "art")
    damage(out)
    with pytest.raises(ArtifactError, match=message) as e:
        read_manifest(out, "hqtflow.test", 1)
    assert "\n" not in str(e.value)


def _patch(d, **changes):
    m = json.loads((d / MANIFEST).read_text())
    m.update(changes)
    (d / MANIFEST).write_text(json.dumps(m))


def test_missing_dir(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        read_manifest(tmp_path / "nope", "hqtflow.measurement", 1)


def test_output_that_is_the_working_directory_or_a_symlink_loop(tmp_path):
    from hqtflow.formats.artifact import check_output_dir

    for out in (".", "..", "a/.."):
        with pytest.raises(ArtifactError, match="current or a parent directory"):
            check_output_dir(Path(out), True)
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(ArtifactError, match="symlink loop"):
        check_output_dir(tmp_path / "loop" / "x", False)


def test_leftovers_of_another_host_are_kept(tmp_path):
    """A staging dir or replaced output is judged by its pid only where that pid means this host's (and this PID
    namespace's) process. Another node's or container's staging dir in a shared folder is kept and named (it may
    be a live run's); its replaced output is removed where the replacement arrived, put back where none did."""
    import os
    import time

    from hqtflow.errors import LeftoverWarning
    from hqtflow.formats import artifact

    dead = 2 ** 22 + 12345  # above any pid_max: no such process here
    mine = artifact._host_tag()
    theirs = "0" * 8 if mine != "0" * 8 else "1" * 8
    replaced = _make(tmp_path / "d")  # another host's commit: its replacement arrived, the replaced one is garbage
    _make(tmp_path / "e")
    for name in ("d", "e"):
        os.rename(tmp_path / name, tmp_path / f".{name}.old-{dead}-h{theirs}-1795974782")
    _make(replaced)  # "d" was replaced; "e" was not (killed between the renames), long ago
    for name, tag in [("a", mine), ("b", theirs)]:
        d = tmp_path / f".{name}.partial-{dead}-h{tag}-xyz"
        d.mkdir()
        (d / artifact.PARTIAL_MARKER).write_text("pid\n")
    old = tmp_path / f".c.old-{dead}-1795974782"  # a name of earlier versions, no host tag: judged by pid as before
    old.mkdir()
    (old / MANIFEST).write_text("{}")
    hour_ago = time.time() - 3600
    os.utime(tmp_path / f".e.old-{dead}-h{theirs}-1795974782", (hour_ago, hour_ago))
    with pytest.warns(LeftoverWarning, match=f".b.partial-{dead}-h{theirs}-xyz is the unfinished output of an hqtflow run on another host"):
        removed = artifact.remove_stale_partials(tmp_path)
    assert sorted(p.name for p in removed) == sorted([f".a.partial-{dead}-h{mine}-xyz", old.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".b.partial-{dead}-h{theirs}-xyz", "d", "e"]
    read_manifest(tmp_path / "e", "hqtflow.test", 1)
    with pytest.warns(LeftoverWarning):  # named again by the next stage into this folder
        assert f"-{os.getpid()}-h{mine}-" in artifact.StagingDir(tmp_path / "x").create().name


def test_overwrite_racing_another_writer(tmp_path, monkeypatch):
    """Another `--overwrite` run moved the output away between this commit's check and its rename: one sentence,
    not a FileNotFoundError from putting back a backup that was never made."""
    import shutil

    from hqtflow.formats import artifact

    out = _make(tmp_path / "art")
    stage = artifact.StagingDir(out, overwrite=True)
    (stage.create() / MANIFEST).write_text("{}")
    monkeypatch.setattr(artifact, "check_replaceable", lambda o: shutil.rmtree(o))  # the other run, at that moment
    with pytest.raises(ArtifactError, match="Cannot move the finished output into .*another run may be writing it"):
        stage.commit()
    assert list(tmp_path.iterdir()) == []


def test_json_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A failed write (a full disk) leaves neither the file nor its temp file."""
    import errno
    import os

    from hqtflow.formats import artifact

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        artifact.write_json_atomic(tmp_path / "r.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_manifest_recording_a_path_that_is_not_utf8(tmp_path):
    """A path with bytes that are not UTF-8 (a Latin-1 folder name) is recorded as Python holds it and read back;
    a manifest with any other lone surrogate is still refused as corrupt."""
    import os

    out = _make(tmp_path / "art")
    name = os.fsdecode(b"lat\xe9")  # "lat\udce9"
    _patch(out, model={"id": "m", "path": str(tmp_path / name)})
    assert read_manifest(out, "hqtflow.test", 1).raw["model"]["path"].endswith(name)
    _patch(out, model={"id": "m", "path": "\ud800"})
    with pytest.raises(ArtifactError, match="corrupt"):
        read_manifest(out, "hqtflow.test", 1)


@pytest.mark.parametrize("flags, why", [(os.ST_RDONLY, "read-only file system"), (0, "permission denied")])
def test_unwritable_parent_says_why(tmp_path, monkeypatch, flags, why):
    """A read-only file system (EROFS) is named as such, not as a permission problem."""
    from hqtflow.formats import artifact

    real = os.statvfs
    monkeypatch.setattr(artifact.os, "access", lambda p, mode: False)
    monkeypatch.setattr(artifact.os, "statvfs", lambda p: type("S", (), {"f_flag": real(p).f_flag | flags if flags
                                                                          else real(p).f_flag & ~os.ST_RDONLY})())
    with pytest.raises(ArtifactError, match=f"Cannot write to {tmp_path}: {why}."):
        artifact.check_output_dir(tmp_path / "out", False)


@pytest.mark.parametrize("manifest", ["{}", "not json", '{"_type": "photos"}', '["hqtflow.measurement"]'])
def test_overwrite_refuses_a_folder_that_only_holds_a_file_named_like_a_manifest(tmp_path, manifest):
    """--overwrite replaces hqtflow's outputs only: a folder of the user's holding a file named hqtflow_manifest.json
    that is no hqtflow manifest (no `_type` naming an hqtflow schema) is refused, and kept as it was."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    (mine / MANIFEST).write_text(manifest)
    with pytest.raises(ArtifactError, match="is not an hqtflow artifact"):
        _make(mine, overwrite=True)
    assert sorted(p.name for p in mine.iterdir()) == [MANIFEST, "notes.txt"]
    assert (mine / "notes.txt").read_text() == "precious" and [p.name for p in tmp_path.iterdir()] == ["mine"]
