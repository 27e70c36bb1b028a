"""hqtflow: an FP8 quantization workflow for LLMs (measure -> quantize -> (unify: N cards -> M) -> generate / eval /
serve / export / inspect)."""

from hqtflow.api import load  # its module imports torch on the first call only

__version__ = "0.5.0"
__all__ = ["__version__", "load"]


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
