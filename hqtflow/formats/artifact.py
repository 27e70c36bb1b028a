"""Artifact directories: written atomically (temp dir, then rename) with a manifest written last.

A manifest is `hqtflow_manifest.json`: `{"_type", "_version", "tool", "created", "model", "config", "data",
"files": {relpath: sha256}}`. Readers accept only the expected type, refuse newer schema versions, and
check every listed file's hash, so a partial, edited or foreign directory is refused with one sentence.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hqtflow import __version__
from hqtflow.errors import ArtifactError

MANIFEST = "hqtflow_manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tool_versions() -> dict[str, str]:
    import torch
    import transformers

    return {"hqtflow": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


class StagingDir:
    """A hidden temp dir beside `out`; `commit()` renames it onto `out`, `abort()` removes it.

    With `overwrite`, an existing `out` is moved aside first and deleted only after the rename succeeded.
    """

    def __init__(self, out: Path, *, overwrite: bool = False, path: Path | None = None):
        self.out = Path(out)
        self.overwrite = overwrite
        self.path = path

    def create(self) -> Path:
        check_output_dir(self.out, self.overwrite)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.path, 0o777 & ~umask)  # mkdtemp makes 0700; the artifact gets normal permissions
        except OSError as e:
            raise ArtifactError(f"Cannot write the output directory {self.out} ({e.strerror}).") from None
        return self.path

    def commit(self) -> Path:
        assert self.path is not None
        backup = None
        if self.out.exists():
            if not self.overwrite:
                raise ArtifactError(f"Output {self.out} appeared while this run was writing it; nothing was replaced.")
            backup = self.out.with_name(f".{self.out.name}.old-{os.getpid()}-{int(time.time())}")
            os.rename(self.out, backup)
        os.rename(self.path, self.out)
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
        return self.out

    def abort(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an existing output (unless overwrite) or an unwritable parent, before any work is done."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ArtifactError(f"Output {out} already exists; pass --overwrite to replace it.")
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"Output {out} exists and is not a directory; nothing was replaced.")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArtifactError(f"Cannot create the parent directory of {out} ({e.strerror}).") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ArtifactError(f"Cannot write to {parent}: permission denied.")


@contextmanager
def staged_output(out: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir to fill; on success it replaces `out`, on any error it is removed."""
    stage = StagingDir(out, overwrite=overwrite)
    path = stage.create()
    try:
        yield path
    except BaseException:
        stage.abort()
        raise
    stage.commit()


def write_manifest(directory: Path, type_: str, version: int, *, model: dict | None, config: Any, data: dict) -> dict:
    """Hash every file in `directory` and write the manifest last."""
    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): sha256_file(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")
    }
    manifest = {
        "_type": type_,
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
    def files(self) -> dict[str, str]:
        return self.raw.get("files", {})

    def digest(self) -> str:
        """A hash identifying this artifact's content (the manifest's file hashes)."""
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()


def read_manifest(directory: Path, type_: str, max_version: int, *, verify: bool = True) -> Manifest:
    """Load and check an artifact's manifest; every failure is one ArtifactError sentence."""
    directory = Path(directory)
    kind = type_.split(".")[-1]
    if not directory.is_dir():
        raise ArtifactError(f"{kind.capitalize()} directory {directory} does not exist.")
    mpath = directory / MANIFEST
    if not mpath.is_file():
        raise ArtifactError(
            f"{directory} has no {MANIFEST}: it is not an hqtflow {kind} artifact, or its writing did not finish."
        )
    try:
        raw = json.loads(mpath.read_text())
        found_type, found_version = raw["_type"], raw["_version"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise ArtifactError(f"{mpath} is corrupt (not a valid hqtflow manifest).") from None
    if found_type != type_:
        raise ArtifactError(f"{directory} holds a {found_type!r} artifact, not the {type_!r} this step needs.")
    if not isinstance(found_version, int) or found_version > max_version:
        raise ArtifactError(
            f"{directory} was written with {type_} schema v{found_version} by a newer hqtflow "
            f"(this one reads up to v{max_version}); upgrade hqtflow."
        )
    if verify:
        for rel, digest in raw.get("files", {}).items():
            p = directory / rel
            if not p.is_file():
                raise ArtifactError(f"{directory} is incomplete: {rel} is listed in its manifest but missing.")
            if sha256_file(p) != digest:
                raise ArtifactError(f"{directory} was modified after it was written: {rel} does not match its manifest hash.")
    return Manifest(mpath, raw)
