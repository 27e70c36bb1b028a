"""The Python API: `hqtflow.load(path)` returns a ready-to-run FP8 model and its tokenizer."""

from __future__ import annotations

from pathlib import Path


def load(path: str | Path, *, device: str = "cpu", verify: bool = True, backend: str = "auto", dtype: str = "auto"):
    """Load an hqtflow FP8 checkpoint (schema and file hashes checked) -> (model, tokenizer).

    `backend`: the FP8 matmul ("auto": the CPU kernel on CPU, `_scaled_mm` on FP8 GPUs; "qdq" is the reference).
    `dtype`: the high-precision compute dtype, bf16/fp16/fp32 ("auto": the fastest here, see hqtflow.hardware)."""
    from hqtflow import models
    from hqtflow.hardware import resolve_dtype
    from hqtflow.formats.artifact import read_manifest
    from hqtflow.quantize.convert import load_checkpoint
    from hqtflow.quantize.fp8_linear import set_backend
    from hqtflow.quantize.run import CHECKPOINT_SCHEMA, SCHEMA_VERSION

    path = Path(path)
    read_manifest(path, CHECKPOINT_SCHEMA, SCHEMA_VERSION, verify=verify)
    model = load_checkpoint(path, device=device, dtype=models.torch_dtype(resolve_dtype(dtype, device)))
    set_backend(model, backend)
    return model, models.load_tokenizer(path)
