"""hqtflow: an FP8 quantization workflow for LLMs (measure -> quantize -> (unify: N cards -> M) -> generate / eval /
serve / export / inspect)."""

__version__ = "0.5.0"


def load(path, **kwargs):
    """Load an FP8 checkpoint (hqtflow's, verified, or another tool's) -> (model, tokenizer). See hqtflow.api.load."""
    from hqtflow.api import load as _load

    return _load(path, **kwargs)


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
