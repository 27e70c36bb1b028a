"""Artifact directories: written atomically (temp dir, then rename) with a manifest written last.

A manifest is `hqtflow_manifest.json`: `{"_type", "_version", "tool", "created", "model", "config", "data",
"files": {relpath: sha256}}`. Readers accept only the expected type, refuse newer schema versions, and
check every listed file's hash, so a partial, edited or foreign directory is refused with one sentence.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Iterable, Iterator

from hqtflow import __version__
from hqtflow.errors import ArtifactError, NewerArtifactError, brief, not_there

MANIFEST = "hqtflow_manifest.json"


class ArtifactKind(StrEnum):
    """Every artifact's schema name (its manifest's `_type`); a member is its string, in JSON too."""

    MEASUREMENT = "hqtflow.measurement"  # measure, unify, import-hqt
    SCALES = "hqtflow.scales"  # quantize --scales-only
    CHECKPOINT = "hqtflow.checkpoint"  # quantize
    EXPORT = "hqtflow.export"  # export
    TUNE = "hqtflow.tune"  # tune

    @property
    def version(self) -> int:
        """The schema version this hqtflow writes, and the newest it reads (2: the model fingerprint hashes the whole
        weights, models.FINGERPRINT_SCHEME; v1 artifacts are read, their fingerprints checked as far as they tell)."""
        return 2


MIN_VERSION = 1  # every schema starts at v1
PARTIAL_MARKER = ".hqtflow-partial"  # in a staging dir until its commit: a directory holding it is never an input
# `.<name>.partial-<pid>-h<host>-*` (staging), `.<name>.old-<pid>-h<host>-*` (replaced); names without the host tag
# come from earlier versions
_LEFTOVER = re.compile(r"^\..+\.(partial|old)-(\d+)-(?:h([0-9a-f]{8})-)?")
COMMITTED: list[Path] = []  # the outputs this process has committed, in order (the CLI names them when interrupted)
# directories check_output_dir made for an output's parent, outermost first: a command that fails removes them again
# while they are empty (`remove_created_parents`), so a refused or interrupted run leaves no empty folder behind
CREATED_PARENTS: list[Path] = []


@functools.cache
def _host_tag() -> str:
    """This host and PID namespace, hashed: a leftover's pid is checked only where that pid means the same process
    (another node or container sharing the folder sees other processes under the same numbers)."""
    import socket

    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()} {namespace}".encode()).hexdigest()[:8]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_identity(path: Path) -> dict[str, int]:
    """What tells a file's content unchanged without reading it: its inode, size, mtime and ctime (no user sets a
    ctime: a file rewritten in place with its mtime put back has a new one)."""
    st = os.stat(path)
    return {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def tool_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"hqtflow": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def write_text_atomic(path: Path, text: str, *, executable: bool = False) -> None:
    """`text` at `path` (executable: as a script, within the umask), written beside it and renamed: a reader never
    sees half a file."""
    tmp = Path(path).with_name(f".{Path(path).name}.tmp")
    try:
        tmp.write_text(text)
        if executable:
            os.chmod(tmp, 0o777 & ~_umask())
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: no half-written file left beside it
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any, *, default=None) -> None:
    """`obj` as indented JSON at `path`, atomically (write_text_atomic)."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=default) + "\n")


def check_report_path(path: Path, model: str | None, what: str) -> None:
    """Refuse a JSON report's path before anything is loaded: inside the model it reports on (`what`: "evaluated",
    "benchmarked"), already there (a dangling link too), or under a directory that cannot be made."""
    if model and Path(model).exists() and path.resolve().is_relative_to(Path(model).resolve()):
        raise ArtifactError(f"Report {path} lies inside the {what} model {model}, which is never modified.")
    if os.path.lexists(path):
        raise ArtifactError(f"Report {path} already exists; remove it or pick another path.")
    check_output_dir(path.parent / ".probe", True)


class StagingDir:
    """A hidden temp dir beside `out`; `commit()` renames it onto `out`, `abort()` removes it.

    The temp dir is `.<name>.partial-<pid>-*` and holds PARTIAL_MARKER until the commit, so a killed run's leftover
    is never read as an artifact; leftovers of dead processes are removed by the next run into the same parent.
    With `overwrite`, an existing `out` is moved aside first and deleted only after the rename succeeded.
    `inputs`: the paths this run reads; `out` may not be, contain or lie inside any of them.
    """

    def __init__(self, out: Path, *, overwrite: bool = False, path: Path | None = None, inputs=(), any_dir: bool = False):
        self.out = Path(out)
        self.overwrite = overwrite
        self.path = path
        self.inputs = tuple(inputs)
        self.any_dir = any_dir  # overwrite any directory (hqtflow's own cache), not only an hqtflow artifact

    def create(self) -> Path:
        remove_stale_partials(self.out.parent)  # first: an output a killed commit moved aside is put back
        check_output_dir(self.out, self.overwrite, self.inputs, self.any_dir)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-{os.getpid()}-h{_host_tag()}-",
                                              dir=self.out.parent))
            os.chmod(self.path, 0o777 & ~_umask())  # mkdtemp makes 0700; the artifact gets normal permissions
            (self.path / PARTIAL_MARKER).write_text(f"pid {os.getpid()}\n")
        except OSError as e:
            self.abort()
            raise ArtifactError(f"Cannot write the output directory {self.out} ({e.strerror}).") from None
        return self.path

    def commit(self) -> Path:
        """Rename the finished temp dir onto `out`; on any failure the temp dir is removed and `out` is untouched."""
        assert self.path is not None
        backup = None
        try:
            _apply_umask(self.path)
            (self.path / PARTIAL_MARKER).unlink(missing_ok=True)
            if self.out.exists() or self.out.is_symlink():
                if not self.overwrite:
                    raise ArtifactError(f"Output {self.out} appeared while this run was writing it; nothing was replaced.")
                if not self.any_dir:
                    check_replaceable(self.out)
                backup = self.out.with_name(f".{self.out.name}.old-{os.getpid()}-h{_host_tag()}-{int(time.time())}")
                os.rename(self.out, backup)
            os.rename(self.path, self.out)
        except BaseException as e:
            if not self.path.exists() and self.out.exists():  # interrupted right after the rename: it is written
                COMMITTED.append(self.out)
                raise
            self.abort()
            # put back what was moved aside (a name of this process's only: when the rename failed because another run
            # moved `out` first, there is nothing to put back)
            if backup is not None and os.path.lexists(backup) and not os.path.lexists(self.out):
                os.rename(backup, self.out)
            if isinstance(e, OSError):
                raise ArtifactError(f"Cannot move the finished output into {self.out} ({e.strerror}; another run "
                                    "may be writing it too); nothing was replaced.") from None
            raise
        COMMITTED.append(self.out)  # interrupted from here on, the CLI says `out` was written
        if backup is not None and backup.is_symlink():  # `out` was a link: drop the link, never what it points to
            backup.unlink()
        elif backup is not None:  # cut short, the next run into this folder removes the rest
            shutil.rmtree(backup, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _apply_umask(directory: Path) -> None:
    """Give every file the permissions the umask allows (some writers, e.g. safetensors, create files 0600)."""
    mode = 0o666 & ~_umask()
    for p in directory.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_partials(parent: Path) -> list[Path]:
    """Remove the leftovers of dead hqtflow processes: staging dirs (named so, holding PARTIAL_MARKER) and replaced
    outputs (named so, holding a manifest); a replaced output whose replacement never arrived (killed between the
    commit's two renames) is renamed back instead. A directory that only looks like one is the user's: it is kept.
    Leftovers of another host or PID namespace (a name's host tag) are judged apart (_foreign_leftover)."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _LEFTOVER.match(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        pid, own = int(m[2]), PARTIAL_MARKER if m[1] == "partial" else MANIFEST
        original = p.with_name(p.name[1:p.name.rindex(f".{m[1]}-")])
        if m[3] is not None and m[3] != _host_tag():  # another host's or container's (or this one's before a restart)
            _foreign_leftover(p, m[1], original)  # its pid says nothing here
            continue
        if pid != os.getpid() and not _pid_alive(pid) and (p / own).is_file():
            if m[1] == "old" and not (original.exists() or original.is_symlink()) and _all_files_present(p):
                try:  # killed between the commit's renames: the replaced output is all there is, put it back
                    os.rename(p, original)
                    continue
                except OSError:  # another run got there first, or it cannot be moved: leave it be
                    continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def _foreign_leftover(p: Path, kind: str, original: Path) -> None:
    """A leftover whose pid cannot be checked here: a staging dir is kept and named (it may be a live run's); a
    replaced output is removed where its replacement arrived, or put back where none did after a minute (a commit's
    two renames take milliseconds)."""
    import warnings

    from hqtflow.errors import LeftoverWarning

    if kind == "partial":
        warnings.warn(f"{p} is the unfinished output of an hqtflow run on another host or container (or of one before "
                      "a restart); it is kept: remove it if no run is writing it.", LeftoverWarning, stacklevel=3)
    elif not (p / MANIFEST).is_file():  # only looks like one: the user's
        return
    elif os.path.lexists(original):
        shutil.rmtree(p, ignore_errors=True)
    elif _all_files_present(p) and time.time() - p.stat().st_mtime > 60:
        try:
            os.rename(p, original)
        except OSError:  # another run got there first, or it cannot be moved: leave it be
            pass


def _all_files_present(directory: Path) -> bool:
    """Whether every file an artifact's manifest lists is there (a replaced output whose removal was cut short is
    not: it is never put back)."""
    try:
        files = json.loads((directory / MANIFEST).read_text()).get("files")
        return isinstance(files, dict) and bool(files) and all(
            isinstance(rel, str) and rel and not Path(rel).is_absolute() and ".." not in Path(rel).parts
            and (directory / rel).is_file() for rel in files)
    except (OSError, ValueError, AttributeError):
        return False


def is_partial(directory: Path) -> bool:
    directory = Path(directory)
    return bool(_LEFTOVER.match(directory.name)) or (directory / PARTIAL_MARKER).exists()


def check_not_partial(directory: Path) -> None:
    """Refuse a staging dir (of a killed, failed or running write): it is never an input to any stage."""
    if is_partial(directory):
        raise ArtifactError(f"{directory} is the unfinished output of an hqtflow run that was killed, failed or is "
                            "still running; it is never read (run the stage again).")


def confined(directory: Path, rel: str) -> Path:
    """`directory / rel`, refused when `rel` is absolute or leads outside `directory` (`..`, symlinks)."""
    directory = Path(directory)
    if not isinstance(rel, str) or not rel or "\0" in rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ArtifactError(f"{directory} names a file {rel!r} outside itself; refusing to read it.")
    p = directory / rel
    if not real_path(p).is_relative_to(real_path(directory)):
        raise ArtifactError(f"{directory} names a file {rel!r} that leads outside it; refusing to read it.")
    return p


def real_path(p: Path) -> Path:
    """`p.resolve()`, with a symlink loop refused in one sentence."""
    try:
        return Path(p).resolve()
    except (RuntimeError, OSError):  # Python 3.11 raises RuntimeError for a loop, later versions OSError (ELOOP)
        raise ArtifactError(f"{p} is a symlink loop (or lies behind one).") from None
    except ValueError:  # a NUL byte, or a lone surrogate no file system name can hold
        raise ArtifactError(f"{str(p)!r} is not a usable path (a NUL byte or an unencodable character).") from None


def check_replaceable(out: Path) -> None:
    """`--overwrite` replaces hqtflow's own outputs (a directory holding an hqtflow manifest), an empty directory or a
    symlink (the link, not what it points to); any other directory is the user's and is refused."""
    if out.is_dir() and not out.is_symlink() and not holds_artifact(out) and any(out.iterdir()):
        raise ArtifactError(f"Output {out} is not an hqtflow artifact (it has no valid {MANIFEST}); --overwrite "
                            "replaces only hqtflow's outputs: move it away or choose another output (nothing was written).")


def holds_artifact(directory: Path) -> bool:
    """Whether `directory` holds an hqtflow manifest: a JSON object whose `_type` is an hqtflow schema name
    (`hqtflow.*`: ArtifactKind's, or a newer hqtflow's), not merely a file of that name. Nothing else is checked: a
    damaged artifact of hqtflow's may still be replaced."""
    try:
        raw = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("_type"), str) and raw["_type"].startswith("hqtflow.")


def check_output_dir(out: Path, overwrite: bool, inputs=(), any_dir: bool = False) -> None:
    """Refuse an existing output (unless overwrite, and then only one of hqtflow's unless `any_dir`), an output that
    is, contains or lies inside one of `inputs`, or an unwritable parent, before any work is done."""
    out = Path(out)
    if out.name in ("", ".", ".."):  # `-o .`: the directory this runs in
        raise ArtifactError(f"Output {out} is the current or a parent directory; name a new directory to write.")
    target = real_path(out)
    for i in inputs:
        if i is None:
            continue
        src = real_path(Path(i))
        if target == src or target.is_relative_to(src) or src.is_relative_to(target):
            how = "is" if target == src else ("lies inside" if target.is_relative_to(src) else "contains")
            raise ArtifactError(f"Output {out} {how} the input {i}; choose an output outside every input "
                                "(nothing was written).")
    if (out.exists() or out.is_symlink()) and not overwrite:  # a dangling symlink is in the way too
        raise ArtifactError(f"Output {out} already exists; pass --overwrite to replace it.")
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"Output {out} exists and is not a directory; nothing was replaced.")
    if not any_dir:
        check_replaceable(out)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        missing = [d for d in (parent, *parent.parents) if not os.path.lexists(d)]
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"Cannot create the parent directory of {out} ({e.strerror}).") from None
        CREATED_PARENTS.extend(reversed(missing))
    if why := why_unwritable(parent):
        raise ArtifactError(f"Cannot write to {parent}: {why}.")


def remove_created_parents() -> None:
    """Remove the directories check_output_dir made, innermost first, each only while it is empty."""
    for d in reversed(CREATED_PARENTS):
        try:
            d.rmdir()
        except OSError:  # not empty (something was written there after all), or gone
            pass
    CREATED_PARENTS.clear()


def why_unwritable(folder: Path) -> str | None:
    """Why files cannot be created in `folder` ("read-only file system", "permission denied"), None if they can."""
    if os.access(folder, os.W_OK | os.X_OK):
        return None
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "read-only file system"
    except OSError:
        pass
    return "permission denied"


@contextmanager
def staged_output(out: Path, *, overwrite: bool = False, inputs=()) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `out`, on any error (the commit's too) it is removed."""
    stage = StagingDir(out, overwrite=overwrite, inputs=inputs)
    path = stage.create()
    try:
        yield path
    except BaseException:
        stage.abort()
        raise
    stage.commit()


def write_manifest(directory: Path, type_: str, version: int | None = None, *, model: dict | None, config: Any,
                   data: dict) -> dict:
    """Hash every file in `directory` and write the manifest last (`version`: the kind's current one by default)."""
    directory = Path(directory)
    version = ArtifactKind(type_).version if version is None else version
    files = {
        str(p.relative_to(directory)): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, PARTIAL_MARKER) and not p.is_symlink()  # dot-files too
    }
    manifest = {
        "_type": str(type_),
        "_version": version,
        "tool": tool_versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model,
        "config": config,
        "data": data,
        "files": files,
    }
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest


@dataclass(frozen=True)
class Manifest:
    path: Path
    raw: dict
    checked: dict[str, dict] = field(default_factory=dict, compare=False, repr=False)  # rel -> file_identity when hashed

    @property
    def type(self) -> str:
        return self.raw["_type"]

    @property
    def version(self) -> int:
        return self.raw["_version"]

    @property
    def model(self) -> dict | None:
        return self.raw.get("model")

    @property
    def data(self) -> dict:
        return self.raw.get("data", {})

    @property
    def written_by(self):
        """The hqtflow version that wrote it (tool.hqtflow; None if not recorded). No reader refuses another version:
        `hqtflow run` redoes its stages (pipeline.other_version)."""
        tool = self.raw.get("tool")
        return tool.get("hqtflow") if isinstance(tool, dict) else None

    @property
    def files(self) -> dict[str, str]:
        return self.raw.get("files", {})

    def digest(self) -> str:
        """A hash identifying this artifact's content (the manifest's file hashes)."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()


def _raw_manifest(directory: Path, kind: str) -> tuple[Path, dict]:
    """The manifest's JSON (`_type` and `_version` present), nothing verified; `kind` words the refusals."""
    what = f"{kind} " if kind else ""
    if not directory.is_dir():
        why = "is a file, not a directory" if directory.is_file() else not_there(directory)
        raise ArtifactError(f"{(what or 'artifact ').capitalize()}directory {directory} {why}.")
    check_not_partial(directory)
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(
            f"{directory} has no {MANIFEST}: it is not an hqtflow {what}artifact, or its writing did not finish."
        )
    try:
        raw = json.loads(mpath.read_text())
        raw["_type"], raw["_version"]
        # no lone surrogate ("\ud800") but the escaped bytes of a path that is not UTF-8 (Python's surrogateescape)
        json.dumps(raw, ensure_ascii=False).encode("utf-8", "surrogateescape")
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        raise ArtifactError(f"{mpath} is corrupt (not a valid hqtflow manifest).") from None
    return mpath, raw


def whole(x) -> bool:
    """A JSON integer (not a float such as 2.5, Infinity or 1e400, nor a boolean)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _strings(x) -> bool:
    return isinstance(x, list) and all(isinstance(s, str) for s in x)


# The data fields stages read back from a manifest, each with its type; a hand-edited one of another type is corrupt.
DATA_FIELDS = {
    "files": (_strings, "a list of file names"),
    "quantized": (_strings, "a list of module names"),
    "skipped": (lambda x: isinstance(x, dict) and all(isinstance(v, str) for v in x.values()),
                "an object of module names and reasons"),
    "world_size": (lambda x: whole(x) and x >= 1, "a whole number of ranks"),
    "scale_method": (lambda x: isinstance(x, (str, dict)), "a scale method or per-module rules"),
    **{k: (lambda x: isinstance(x, str), "a string") for k in (
        "model_path", "target", "fp8", "mode", "observer", "source_measurement", "source_digest", "dump_stats_path",
        "model_dtype", "hp_dtype", "kv_cache", "weight_rounding", "imported_from")},
    "notes": (_strings, "a list of notes"),
}


def _data_problem(data: dict) -> str | None:
    for key, (ok, what) in DATA_FIELDS.items():
        if data.get(key) is not None and not ok(data[key]):
            return f"its data field {key!r} is not {what}"
    return None


@functools.cache
def known_values() -> dict[tuple[str, str], tuple[str, ...]]:
    """The enumerated manifest fields stages act on, (section, field) -> the values this hqtflow writes; a value
    outside them comes from a newer or another hqtflow, which stages would otherwise misread (section "config": the
    QUANT_CONFIG, as `QuantConfig.from_dict` accepts it; `--engine inc` records a per-module method as "custom" and
    its device, "hpu", as the target)."""
    from hqtflow.formats import quant_config as c
    from hqtflow.choices import KVCache

    return {("data", "fp8"): c.FP8_FORMATS, ("data", "hp_dtype"): c.HP_DTYPES, ("data", "model_dtype"): c.HP_DTYPES,
            ("data", "observer"): c.MEASURE_OBSERVERS, ("data", "scale_method"): (*c.SCALE_METHODS, "custom"),
            ("data", "target"): (*(d.lower() for d in c.DEVICES_FOR_SCALES), "hpu"),
            ("data", "weight_rounding"): WEIGHT_ROUNDINGS, ("data", "kv_cache"): tuple(KVCache),
            ("data", "mode"): CHECKPOINT_MODES,
            ("config", "fp8_config"): c.FP8_FORMATS, ("config", "hp_dtype"): c.HP_DTYPES,
            ("config", "observer"): c.OBSERVERS, ("config", "scale_method"): c.SCALE_METHODS,
            ("config", "device_for_scales"): c.DEVICES_FOR_SCALES}


WEIGHT_ROUNDINGS = ("nearest", "gptq")  # a checkpoint's FP8 weights: rounded to nearest, or by GPTQ
CHECKPOINT_MODES = ("w8a8-static", "w8a8-dynamic", "weight-only")


def _unknown_value(directory: Path, raw: dict) -> str | None:
    """The refusal of an enumerated field whose value this hqtflow does not know, or None (a per-module
    `scale_method` object is checked where it is parsed)."""
    for (section, key), known in known_values().items():
        value = (raw.get(section) if isinstance(raw.get(section), dict) else {}).get(key)
        if value is not None and not isinstance(value, str) and not (key == "scale_method" and isinstance(value, dict)):
            field = key if section == "data" else f"config.{key}"
            return f"{directory} records {field} as {str(value)[:40]!r}, not one of the names {', '.join(known)}: the manifest is corrupt."
        if isinstance(value, str) and value not in known:
            field = key if section == "data" else f"config.{key}"
            kind = str(raw["_type"]).split(".")[-1]
            return (f"{directory}, a {kind} artifact, records {field} {value!r}, which this hqtflow does not know (it knows "
                    f"{', '.join(known)}): written by a newer or another hqtflow?")
    return None


def artifact_kind(directory: str | Path) -> str:
    """The `_type` an artifact's manifest declares, to pick its reader (`read_manifest` then checks everything)."""
    return str(_raw_manifest(Path(directory), "")[1]["_type"])


def read_checkpoint_manifest(directory: str | Path, *, verify: bool = True) -> Manifest:
    """An FP8 checkpoint's manifest: an hqtflow checkpoint's or its export's (any other kind is refused by
    read_manifest as not the checkpoint needed)."""
    kind = _raw_manifest(Path(directory), "checkpoint")[1]["_type"]
    return read_manifest(directory, ArtifactKind.EXPORT if kind == ArtifactKind.EXPORT else ArtifactKind.CHECKPOINT,
                         verify=verify)


def kind_named(directory: str | Path) -> str | None:
    """For an error message: "measurement", "checkpoint", ... when `directory` holds an hqtflow manifest, else None."""
    if not (Path(directory) / MANIFEST).is_file():
        return None
    try:
        return artifact_kind(directory).split(".")[-1]
    except ArtifactError:
        return "unreadable"


def checkpoint_without_config(directory: str | Path) -> ArtifactError:
    """The refusal of an FP8 checkpoint (its manifest says so) whose config.json is gone or not a file."""
    return ArtifactError(f"{directory} is incomplete: its config.json is missing (or not a file); make the checkpoint "
                         "again with `hqtflow quantize`.")


def read_manifest(directory: Path, type_: str, max_version: int | None = None, *, verify: bool = True) -> Manifest:
    """Load and check an artifact's manifest; every failure is one ArtifactError sentence.

    Refused: a staging dir, a missing or corrupt manifest, another type, a schema version outside
    MIN_VERSION..max_version (the kind's current version by default), a listed file outside the directory and (with
    `verify`: verify_files) a missing or changed file."""
    directory = Path(directory)
    max_version = ArtifactKind(type_).version if max_version is None else max_version
    mpath, raw = _raw_manifest(directory, type_.split(".")[-1])
    found_type, found_version = raw["_type"], raw["_version"]
    if found_type != type_:
        raise ArtifactError(f"{directory} holds a {found_type!r} artifact, not the {str(type_)!r} this step needs.")
    if type(found_version) is int and max_version < found_version < 10**6:  # beyond: no schema, a corrupt number
        raise NewerArtifactError(
            f"{directory} was written with {type_} schema v{found_version} by a newer hqtflow "
            f"(this one reads up to v{max_version}); upgrade hqtflow."
        )
    if type(found_version) is not int or not MIN_VERSION <= found_version <= max_version:
        raise ArtifactError(f"{mpath} has schema version {brief(found_version)}, which no hqtflow writes "
                            f"(this one reads v{MIN_VERSION} to v{max_version}).")
    files = raw.get("files")  # every artifact has files: none listed would leave them all unchecked
    if not isinstance(files, dict) or not files or not isinstance(raw.get("data", {}), dict) or \
            not isinstance(raw.get("model"), (dict, type(None))):
        raise ArtifactError(f"{mpath} is corrupt (not a valid hqtflow manifest).")
    if (problem := _data_problem(raw.get("data") or {})) is not None:
        raise ArtifactError(f"{mpath} is corrupt: {problem}.")
    if (unknown := _unknown_value(directory, raw)) is not None:
        raise ArtifactError(unknown)
    for rel in files:
        confined(directory, rel)
    if found_type in (ArtifactKind.CHECKPOINT, ArtifactKind.EXPORT):  # the weights read are the ones listed
        from hqtflow.formats.safetensors_files import SAFETENSORS_INDEX, weight_files

        for f in [*weight_files(directory, ArtifactError), directory / SAFETENSORS_INDEX]:
            if f.is_file() and f.relative_to(directory).as_posix() not in files:
                raise ArtifactError(f"{directory} was modified after it was written: {f.name} is not in its manifest (or another run replaced it meanwhile).")
    manifest = Manifest(mpath, raw)
    if verify:
        verify_files(manifest)
    return manifest


def verify_files(manifest: Manifest, *, read_later: Iterable[str] = ()) -> None:
    """Check every file `manifest` lists present and unchanged (its hash), recording its file_identity; those in
    `read_later` only present: their reader hashes the bytes it parses (verified_bytes), so none is hashed twice."""
    directory, later = manifest.path.parent, set(read_later)
    for rel, digest in manifest.files.items():
        p = directory / rel
        if not p.is_file():
            raise _missing(directory, rel)
        if rel in later:
            continue
        manifest.checked[rel] = file_identity(p)
        if sha256_file(p) != digest:
            raise _changed(directory, rel)


def check_unchanged(manifest: Manifest) -> None:
    """Refuse an artifact whose files changed since read_manifest hashed them (their file_identity): a reader that
    reopens them by path afterwards (load_checkpoint) then loaded files nobody checked."""
    directory = manifest.path.parent
    for rel, identity in manifest.checked.items():
        try:
            same = file_identity(directory / rel) == identity
        except OSError:
            same = False
        if not same:
            raise ArtifactError(f"{directory} changed while it was being loaded ({rel} was replaced or rewritten, by "
                                "another run's --overwrite?); nothing loaded from it is used: load it again.")


def _missing(directory: Path, rel: str) -> ArtifactError:
    return ArtifactError(f"{directory} is incomplete: {rel} is listed in its manifest but missing.")


def _changed(directory: Path, rel: str) -> ArtifactError:
    return ArtifactError(f"{directory} was modified after it was written: {rel} does not match its manifest hash (or "
                         "another run replaced it meanwhile).")


def verified_bytes(manifest: Manifest, rel: str) -> bytes:
    """The bytes of a file `manifest` lists, read once and checked against its hash: a reader parses exactly what was
    checked (a file replaced after read_manifest's check is refused, never parsed). For the small files parsed whole;
    weights are checked by read_manifest and file_identity."""
    directory = manifest.path.parent
    p = confined(directory, rel)
    if rel not in manifest.files:
        raise ArtifactError(f"{p} is not listed in {directory}'s manifest (it was added after the artifact was "
                            "written); it is never read.")
    try:
        data = p.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise _missing(directory, rel) from None
    if hashlib.sha256(data).hexdigest() != manifest.files[rel]:
        raise _changed(directory, rel)
    return data
