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


def parse(enum: type[E], value: str, what: str, error: type[ConfigError] = ConfigError, *, among=None) -> E:
    """`value` as a member of `enum` (of `among`, a subset, where given), or an `error` naming `what`, the value and
    the valid values."""
    members = list(among or enum)
    try:
        if not isinstance(value, str) or enum(value) not in members:  # Enum's own error would print the whole value
            raise ValueError
        return enum(value)
    except ValueError:
        raise error(f"{what} must be {valid_values(members)}, not {brief(value)}.") from None


def valid_values(members) -> str:
    """The members' values as a message lists them: "a, b or c"."""
    *rest, last = [m.value for m in members]
    return f"{', '.join(rest)} or {last}" if rest else last


class Dtype(StrEnum):
    """A high-precision dtype: bf16, fp16 or fp32, and "auto" (the fastest here, hardware.fastest_dtype) where a
    command picks its compute dtype. The one list of dtype names: every option, recipe key, config value and API
    argument naming one is parsed by `parse_dtype`."""

    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def torch(self):
        """The torch dtype (torch.bfloat16, ...: TORCH_NAMES); AUTO has none."""
        import torch

        return getattr(torch, TORCH_NAMES[self][0])


# torch's names of the stored / computed dtypes (a model's, QUANT_CONFIG's hp_dtype), its own first: the one table
# Dtype.torch, hardware.dtype_name and the formats' maps (scales.HP_DTYPES, checkpoint.HP_DTYPE_NAMES) derive from
TORCH_NAMES = {Dtype.BF16: ("bfloat16",), Dtype.FP16: ("float16", "half"), Dtype.FP32: ("float32", "float")}
HP_DTYPES = tuple(TORCH_NAMES)


def parse_dtype(value, what: str = "--dtype", *, auto: bool = True, error: type[ConfigError] = ConfigError) -> Dtype:
    """`value` as a Dtype (with `auto`: "auto" too), or an `error`: "--dtype must be auto, bf16, fp16 or fp32, not
    'fp64'." (the same sentence for every command, recipe and API argument; `what` names the setting)."""
    return parse(Dtype, value, what, error, among=None if auto else HP_DTYPES)


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
