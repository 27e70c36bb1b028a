"""The Python API: `hqtflow.load(path)` returns a ready-to-run FP8 model and its tokenizer; `load_any` is the
commands' loader (FP8 checkpoints of any origin and plain models)."""

from __future__ import annotations

from pathlib import Path


def load(path: str | Path, *, device: str = "cpu", verify: bool = True, backend: str = "auto", dtype: str = "auto"):
    """Load an hqtflow FP8 checkpoint, or its `export --format fp8|compressed-tensors` (schema and file hashes
    checked) -> (model, tokenizer).

    `backend`: the FP8 matmul ("auto": the CPU kernel on CPU, `_scaled_mm` on FP8 GPUs; "qdq" is the reference).
    `dtype`: the high-precision compute dtype, bf16/fp16/fp32 ("auto": the fastest here, see hqtflow.hardware)."""
    from hqtflow import models
    from hqtflow.hardware import resolve_dtype
    from hqtflow.formats.checkpoint import load_checkpoint
    from hqtflow.quantize.fp8_linear import set_backend
    path = Path(path)
    _check_manifest(path, verify)
    model = load_checkpoint(path, device=device, dtype=models.torch_dtype(resolve_dtype(dtype, device)))
    set_backend(model, backend)
    return model, models.load_tokenizer(path)


def _check_manifest(path: Path, verify: bool) -> None:
    """An hqtflow checkpoint's manifest, or an export's in a layout this runtime loads; hashes checked."""
    import json

    from hqtflow.errors import ArtifactError
    from hqtflow.export import LOADABLE_FORMATS
    from hqtflow.formats.artifact import MANIFEST, ArtifactKind, read_manifest

    try:
        kind = json.loads((path / MANIFEST).read_text()).get("_type")
    except (OSError, ValueError, RecursionError, AttributeError):
        kind = None  # read_manifest names what is wrong
    if kind != ArtifactKind.EXPORT:
        read_manifest(path, ArtifactKind.CHECKPOINT, verify=verify)
        return
    m = read_manifest(path, ArtifactKind.EXPORT, verify=verify)
    fmt = m.data.get("format")
    if fmt not in LOADABLE_FORMATS:
        raise ArtifactError(f"{path} is an `export --format {fmt}` artifact, which runs in Neural Compressor; "
                            f"hqtflow loads {' and '.join(LOADABLE_FORMATS)} exports and its own checkpoints.")


def load_any(ref: str | None, dtype: str = "auto", backend: str = "auto", device: str = "cpu"):
    """The one loader of generate, eval, serve and bench -> (model, tokenizer, kind): an hqtflow checkpoint or export
    (through `load`), a foreign FP8 checkpoint (its FP8 layers on `backend`), or a plain HF model (kind: its dtype),
    on `device`. `dtype`: the high-precision compute dtype ("auto": the fastest on `device`)."""
    from hqtflow import models
    from hqtflow.formats.artifact import MANIFEST
    from hqtflow.hardware import resolve_dtype

    dtype = resolve_dtype(dtype, device)
    path = models.resolve_model(ref)
    qc = models.load_config(path).get("quantization_config") or {}
    has_manifest = (path / MANIFEST).exists()  # an hqtflow checkpoint or export: hqtflow.load checks it
    # a quantization_config that is not an object: load_checkpoint refuses it
    if has_manifest or not isinstance(qc, dict) or qc.get("quant_method") in ("compressed-tensors", "fp8"):
        from hqtflow.formats.checkpoint import load_checkpoint
        from hqtflow.quantize.fp8_linear import set_backend

        if has_manifest:
            model, tok = load(path, backend=backend, dtype=dtype, device=device)
        else:
            model = load_checkpoint(path, dtype=models.torch_dtype(dtype), device=device)
            tok = models.load_tokenizer(path)
            set_backend(model, backend)
        return model, tok, "fp8"
    return models.load_model(path, dtype).to(device), models.load_tokenizer(path), dtype
