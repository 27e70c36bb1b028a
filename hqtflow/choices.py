"""Closed sets of option values as enums (a member is its string), and the one way a value is checked."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from hqtflow.errors import ConfigError

E = TypeVar("E", bound=StrEnum)


class KVCache(StrEnum):
    """The KV cache's dtype: bf16 (high precision), or fp8 (the checkpoint's k/v scales, E4M3)."""

    BF16 = "bf16"
    FP8 = "fp8"


def parse(enum: type[E], value: str, what: str) -> E:
    """`value` as a member of `enum`, or a ConfigError naming `what`, the value and the valid values."""
    try:
        return enum(value)
    except ValueError:
        valid = " or ".join(m.value for m in enum)
        raise ConfigError(f"{what} must be {valid}, not {value!r}.") from None
