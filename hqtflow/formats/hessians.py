"""GPTQ's calibration statistics in a measurement artifact: `hessians.safetensors` (hqtflow's own file; one rank).

One float32 [in, in] matrix per distinct Linear input: the mean of x xᵀ over the calibration tokens (padding
excluded), GPTQ's Hessian up to a constant. Linears fed the same tensor (q/k/v, gate/up) share one matrix; the
metadata maps every module to its matrix (`modules`) and counts the tokens behind each (`tokens`).
Written by `measure --hessians`, read by `quantize --gptq`, one matrix at a time (the file is memory-mapped).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hqtflow.errors import ArtifactError

HESSIAN_FILE = "hessians.safetensors"
FORMAT = "hqtflow-hessians"
VERSION = 1


def write_hessians(directory: Path, matrices: dict[str, torch.Tensor], modules: dict[str, str],
                   tokens: dict[str, int]) -> Path:
    """`matrices`: {key: [in, in] mean x xᵀ}; `modules`: {Linear name: its key}; `tokens`: {key: token count}."""
    from safetensors.torch import save_file

    path = Path(directory) / HESSIAN_FILE
    meta = {"format": FORMAT, "version": str(VERSION), "modules": json.dumps(modules), "tokens": json.dumps(tokens)}
    save_file({k: v.float().contiguous().cpu() for k, v in matrices.items()}, str(path), metadata=meta)
    return path


class Hessians:
    """A measurement's Hessians, checked on open (format, version, the module map) and per matrix on `get`."""

    def __init__(self, path: Path):
        from hqtflow.formats.safetensors_files import check_safetensors, safetensors_header

        self.path = Path(path)
        check_safetensors(self.path)
        with _open(self.path):  # the safetensors library's own header checks (offsets, metadata types), up front
            pass
        _, header = safetensors_header(self.path)
        meta = header.get("__metadata__") or {}
        bad = f"{self.path} is not a Hessian file this hqtflow reads"
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ArtifactError(f"{bad} (format {repr(meta.get('format') if isinstance(meta, dict) else None)[:40]}).")
        version = meta.get("version")
        known = isinstance(version, str) and version.isascii() and version.isdigit() and len(version) < 10
        if known and int(version) > VERSION:
            raise ArtifactError(f"{self.path} has Hessian format version {version}, newer than this hqtflow reads "
                                f"({VERSION}); upgrade hqtflow.")
        if not known or version != str(int(version)) or int(version) < 1:
            raise ArtifactError(f"{bad} (version {repr(version)[:40]}).")
        try:
            modules, tokens = json.loads(meta["modules"]), json.loads(meta["tokens"])
        except (KeyError, TypeError, ValueError, RecursionError):
            modules = tokens = None
        keys = set(header) - {"__metadata__"}
        if not (isinstance(modules, dict) and isinstance(tokens, dict)
                and all(isinstance(v, str) and v in keys for v in modules.values())
                and all(type(n) is int and n >= 0 for n in tokens.values())):
            raise ArtifactError(f"{bad} (its module map or token counts are missing, or name matrices it does not hold).")
        self.modules: dict[str, str] = modules
        self.tokens: dict[str, int] = tokens
        self._shapes = {k: header[k].get("shape") for k in keys}
        self._dtypes = {k: header[k].get("dtype") for k in keys}

    def get(self, module: str, in_features: int) -> torch.Tensor:
        """The [in, in] float32 matrix of `module` (refused: absent, another shape or dtype, not finite, not a
        second moment: asymmetric, a negative variance, a covariance larger than its variances allow)."""
        key = self.modules.get(module)
        if key is None:
            raise ArtifactError(f"{self.path} has no Hessian for {module}; measure again with --hessians.")
        if self._dtypes[key] != "F32":
            raise ArtifactError(f"{self.path}: the Hessian of {module} is {self._dtypes[key]}, not F32; the file is corrupt.")
        if self._shapes[key] != [in_features, in_features]:
            raise ArtifactError(f"{self.path}: the Hessian of {module} is {self._shapes[key]}, not "
                                f"[{in_features}, {in_features}] as the layer's inputs are; the file is corrupt or "
                                "was measured on another model.")
        with _open(self.path) as f:
            h = f.get_tensor(key)
        d = h.diagonal()
        ok = bool(torch.isfinite(h).all()) and bool((d >= 0).all())
        if ok:  # E[x xᵀ] is symmetric, and |E[x_i x_j]| <= sqrt(E[x_i²] E[x_j²]) (float32 sums: a little slack)
            top = float(d.max())
            hn, dn = (h / top, d / top) if top > 0 else (h, d)  # normalized: tiny variances do not underflow
            bound = (dn[:, None] * dn[None, :]).sqrt() * (1 + 1e-3) + 1e-6
            ok = bool(((hn - hn.t()).abs() <= 1e-3 * bound).all()) and bool((hn.abs() <= bound).all())
        if not ok:
            raise ArtifactError(f"{self.path}: the Hessian of {module} is not a second moment of real inputs (NaN, "
                                "inf, a negative variance or an impossible covariance); the file is corrupt.")
        return h * 0.5 + h.t() * 0.5  # (halves first: no overflow near the float32 limit)


def _open(path: Path):
    """safe_open, its refusals as one sentence."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0][:200]}).") from None


def read_hessians(directory: Path) -> Hessians | None:
    """The Hessians of a measurement artifact, None when it has none."""
    path = Path(directory) / HESSIAN_FILE
    return Hessians(path) if path.exists() else None
