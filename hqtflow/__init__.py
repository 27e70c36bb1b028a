"""hqtflow: an FP8 quantization workflow for LLMs (measure -> quantize -> (unify: N cards -> M) -> generate / eval /
serve / export / inspect)."""

__version__ = "0.5.0"
__all__ = ["__version__", "load"]


def load(path, *, device: str = "cpu", verify: bool = True, backend: str = "auto", dtype="auto"):
    """Load an FP8 checkpoint -> (model, tokenizer), ready to run (torch is imported on the first call).

    `path`: hqtflow's checkpoint or its `export --format fp8|compressed-tensors`, or another tool's compressed-tensors
    or AutoFP8 `fp8` checkpoint.
    `device`: "cpu", "cuda" or "auto" (cuda when PyTorch sees a CUDA GPU).
    `verify`: check the sha256 of every file hqtflow's manifest lists (False: its schema and file list only; faster
    for a large checkpoint that was verified before).
    `backend`: the FP8 matmul: "auto" (the CPU kernel on CPU, `_scaled_mm` on FP8 GPUs), "qdq" (the reference), ...
    `dtype`: the high-precision compute dtype: "auto" (the fastest here), "bf16"/"bfloat16"/torch.bfloat16,
    "fp16"/"float16"/torch.float16 or "fp32"/"float32"/torch.float32.
    Raises hqtflow.errors.HqtflowError subclasses (one sentence each) for what is wrong with the arguments or files."""
    from hqtflow.api import load as _load

    return _load(path, device=device, verify=verify, backend=backend, dtype=dtype)


def _quiet_optional_kernels() -> None:
    """transformers imports torchao (its quantizer registry) with every model class; on a machine without those
    CUDA builds torchao logs `Failed to load ..._C_mxfp8...` and makes torch log Enum `register_constant`
    deprecations, before every one-sentence error and on every model load (once per rank). Users read them as
    failures. Only those records of those two loggers are dropped; everything else they log still shows."""
    import logging

    logging.getLogger("torchao").addFilter(lambda r: not str(r.msg).startswith("Failed to load"))
    logging.getLogger("torch.utils._pytree").addFilter(
        lambda r: "is an Enum subclass and is now natively supported" not in r.getMessage())


_quiet_optional_kernels()
