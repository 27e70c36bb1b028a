"""What the machine computes fastest: its CPU's vector flags, and the high-precision dtype the runtime uses when the
user has not chosen one ("auto"): bf16 on GPUs and on CPUs with native bf16 dot products (AVX512-BF16, AMX-BF16),
fp32 on other CPUs, where bf16 matmuls are emulated and run several times slower than fp32."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

BF16_NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's vector-extension flags (x86 /proc/cpuinfo), sorted; the machine name elsewhere."""
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
        return tuple(sorted(f for f in line.split() if f.startswith(("avx", "amx", "f16c", "fma", "sse4"))))
    except (OSError, StopIteration):
        return (platform.machine(),)


def fastest_dtype(device: str = "cpu") -> str:
    """"bf16" or "fp32": the faster high-precision dtype on `device`."""
    if not str(device).startswith("cpu"):
        return "bf16"
    return "bf16" if any(f in cpu_flags() for f in BF16_NATIVE_FLAGS) else "fp32"


DTYPES = ("auto", "bf16", "fp16", "fp32")
RUN_DEVICES = ("auto", "cpu", "cuda")


def run_device(device: str | None, name: str = "--device", engine_inc: bool = True) -> str:
    """Where hqtflow's own runtime runs: "auto" (or None) -> "cuda" when PyTorch sees a CUDA GPU, else "cpu"; "cuda"
    without one is refused in one sentence. `name` words the setting in errors: the flag, or "device=" in Python;
    `engine_inc`: the command has --engine inc (an unknown --device's error says hpu goes with it)."""
    import torch

    from hqtflow.errors import ConfigError

    if device not in (None, *RUN_DEVICES):
        hint = " (hpu: with --engine inc)" if name == "--device" and engine_inc else ""
        raise ConfigError(f"Unknown {_said(name, device, quote=True)}; valid values are {', '.join(RUN_DEVICES)}{hint}.")
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{_said(name, 'cuda')}: PyTorch {torch.__version__} sees no CUDA GPU here; "
                          f"use {_said(name, 'cpu')}.")
    return device


def _said(name: str, value: str, quote: bool = False) -> str:
    """A setting as the user wrote it: `--device cuda` (`quote`: `--device 'gpu'`), or `device='cuda'` in Python."""
    if name.endswith("="):
        return f"{name}{value!r}"
    return f"{name} {value!r}" if quote else f"{name} {value}"


def resolve_dtype(dtype: str | None, device: str = "cpu", name: str = "--dtype") -> str:
    """"auto" (or None) -> fastest_dtype(device); bf16, fp16 and fp32 are returned as they are. `name`: as run_device's."""
    if dtype not in (None, *DTYPES):
        from hqtflow.errors import ConfigError

        raise ConfigError(f"Unknown {_said(name, dtype, quote=True)}; valid values are {', '.join(DTYPES)}.")
    return fastest_dtype(device) if dtype in (None, "auto") else dtype
