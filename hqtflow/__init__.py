"""hqtflow: an FP8 quantization workflow for LLMs (measure -> quantize -> unify -> serve)."""

__version__ = "0.1.0"


def load(path, **kwargs):
    """Load an hqtflow FP8 checkpoint -> (model, tokenizer). See hqtflow.api.load."""
    from hqtflow.api import load as _load

    return _load(path, **kwargs)
