"""Closed sets of option values as enums (a member is its string), and `parse`, which checks a value against one.

Not every closed set is here: the QUANT_CONFIG's values are tuples in formats/quant_config.py, checked by its `choice`."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from hqtflow.errors import ConfigError, brief

E = TypeVar("E", bound=StrEnum)


class KVCache(StrEnum):
    """The KV cache's dtype: bf16 (high precision), or fp8 (the checkpoint's k/v scales, E4M3)."""

    BF16 = "bf16"
    FP8 = "fp8"


def parse(enum: type[E], value: str, what: str, error: type[ConfigError] = ConfigError) -> E:
    """`value` as a member of `enum`, or an `error` naming `what`, the value and the valid values."""
    try:
        if not isinstance(value, str):  # Enum's own error would print the whole value
            raise ValueError
        return enum(value)
    except ValueError:
        *rest, last = [m.value for m in enum]
        valid = f"{', '.join(rest)} or {last}" if rest else last
        raise error(f"{what} must be {valid}, not {brief(value)}.") from None


class Backend(StrEnum):
    """The FP8 matmul: auto (the fastest here), qdq (the reference), cpu (hqtflow's kernel), scaled_mm (CUDA FP8 GEMM)."""

    AUTO = "auto"
    QDQ = "qdq"
    CPU = "cpu"
    SCALED_MM = "scaled_mm"


class Engine(StrEnum):
    """Who measures, quantizes and runs: hqtflow itself, or Neural Compressor driven by hqtflow."""

    HQTFLOW = "hqtflow"
    INC = "inc"
