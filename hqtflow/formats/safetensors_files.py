"""Safetensors files on disk, torch-free: a model folder's weight files and their sharded index, and one file's header.

- The index: `weight_files` lists the files transformers loads (model.safetensors, else the shards
  `model.safetensors.index.json` maps weights to); `shard_names` names a checkpoint's shards and `write_index` writes
  the index. (The tensors themselves are written by formats/checkpoint.py's `SafetensorsWriter`.)
- One file: `safetensors_header` reads its header (the 8-byte little-endian length, then the JSON); `check_safetensors`
  refuses one whose header is unreadable or whose tensors run past its end, from the header alone.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from hqtflow.errors import ArtifactError, ModelError
from hqtflow.formats import APPLEDOUBLE

SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(path: Path, error: type[Exception] = ModelError) -> list[Path]:
    """The safetensors files of a model folder, as transformers picks them: model.safetensors, else the shards its
    model.safetensors.index.json maps weights to (each must be there), else (a folder of other names) every
    *.safetensors but macOS' `._*` twins (APPLEDOUBLE). Another .safetensors file beside them is not part of the
    model."""
    path = Path(path)
    single, index = path / "model.safetensors", path / SAFETENSORS_INDEX
    if single.is_file() or not index.is_file():
        return [single] if single.is_file() else sorted(
            p for p in path.glob("*.safetensors") if not p.name.startswith(APPLEDOUBLE))
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise error(f"{index} is not a valid safetensors index ({type(e).__name__}: {e}).") from None
    names = sorted(set(weight_map.values()))
    # names inside the folder (the hub cache's shards are symlinks into its blobs: not resolved)
    if bad := next((n for n in names if not n or Path(n).is_absolute() or ".." in Path(n).parts), None):
        raise error(f"{index} maps weights to {bad!r}, a file outside {path}; refusing to read it.")
    if missing := [n for n in names if not (path / n).is_file()]:
        raise error(f"{index} maps weights to {missing[0]}, which is not in {path}.")
    return [path / n for n in names]


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(out: Path, total_size: int, weight_map: dict[str, str]) -> None:
    """The index of a sharded checkpoint: which file holds each tensor."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(out) / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


# ---- one file ----------------------------------------------------------------------------------
def _header_length(f) -> int:
    """The JSON header's length in bytes: the file's first 8 bytes, little-endian."""
    (n,) = struct.unpack("<Q", f.read(8))
    return n


# What reading a damaged header raises (garbage lengths, bad JSON, wrong shapes of entries)
HEADER_ERRORS = (OSError, struct.error, ValueError, OverflowError, MemoryError, KeyError, TypeError, IndexError,
                 AttributeError, RecursionError)


def safetensors_header(path: Path) -> tuple[int, dict]:
    """Where a file's tensor data starts and its header ({key: {dtype, shape, data_offsets}}, `__metadata__`); a
    header length past the file's end (garbage) is a ValueError, never an allocation."""
    with open(path, "rb") as f:
        n = _header_length(f)
        if 8 + n > Path(path).stat().st_size:
            raise ValueError("header longer than the file")
        return 8 + n, json.loads(f.read(n))


def check_safetensors(path: Path, error: type[Exception] | None = None) -> None:
    """Refuse a .safetensors file whose header is unreadable or whose tensors run past its end (a truncated copy),
    from the header alone (no tensor is read), with `error` (default ArtifactError; a model's files: ModelError)."""
    error = error or ArtifactError
    path = Path(path)
    try:
        size = path.stat().st_size
        start, header = safetensors_header(path)
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except HEADER_ERRORS:
        raise error(f"{path} is not a readable safetensors file (corrupt header).") from None
    if start + end > size:
        raise error(f"{path} is truncated: its tensors need {start + end} bytes but the file has {size}.")
    from safetensors import SafetensorError, safe_open

    try:  # safetensors' own header checks (offsets, dtypes, shapes against sizes); maps the file, reads no tensor
        with safe_open(path, framework="numpy"):
            pass
    except (SafetensorError, OSError) as e:
        raise error(f"{path} is not a valid safetensors file ({str(e).splitlines()[0]}).") from None
