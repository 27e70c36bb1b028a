"""hqtflow: an FP8 quantization workflow for LLMs (measure -> quantize -> unify -> serve)."""

__version__ = "0.1.0"
