"""The CPU FP8 kernel (`csrc/fp8_linear_cpu.cpp`): built once per machine with the system C++ compiler and kept in
`$HQTFLOW_CACHE/kernels/<hash>` (the hash covers the source, torch's version and the CPU's vector flags), so later
processes load it in milliseconds. It registers these torch ops:

- `torch.ops.hqtflow.fp8_linear(x, weight, weight_scale, input_scale, bias)`: the QDQ reference's function
  hp(QDQ(x) @ hp(W * s_w)^T) + bias, batch-invariant (a row's output does not depend on M or on its neighbours);
- `fp8_dequantize(weight, weight_scale, dtype)`, `fp8_quantize(x, scale, e4m3)`, `fp8_qdq(x, scale, e4m3)`: the
  reference's `dequantize`, `quantize` and input QDQ, bit-identical and fast;
- `fp8_isa()`: the compute path bf16 models take here ("bf16-dot", "avx512-fma", "avx2-fma" or "scalar").

`available()` says whether it could be built here (a compiler and torch headers); the reason otherwise is in
`build_error()`. `load("avx2")` builds an AVX2-only twin under `torch.ops.hqtflow_avx2` so that an AVX-512 machine
tests (and benchmarks) the code path of AVX2-only CPUs too.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "fp8_linear_cpu.cpp"
# OpenMP: at::parallel_for runs on torch's threads; no FMA contraction: every path must do the same operations.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
VARIANTS = {"native": ("hqtflow", []), "avx2": ("hqtflow_avx2", ["-mno-avx512f", "-DHQT_OPS_NS=hqtflow_avx2"])}
_errors: dict[str, str] = {}


def _flags(variant: str) -> list[str]:
    return FLAGS + VARIANTS[variant][1]


def build_dir(variant: str = "native") -> Path:
    from hqtflow.hardware import cpu_flags
    from hqtflow.models import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags(variant)).encode() + torch.__version__.encode()
                         + " ".join(cpu_flags()).encode())
    return cache_dir() / "kernels" / f"fp8_linear_cpu-{variant}-{key.hexdigest()[:16]}"


def ops(variant: str = "native"):
    """The op namespace of a built variant (`torch.ops.hqtflow` for the native one)."""
    return getattr(torch.ops, VARIANTS[variant][0])


@functools.cache
def load(variant: str = "native") -> bool:
    """Build (first time on this machine) or load the kernel; True when its ops exist."""
    from torch.utils import cpp_extension

    from hqtflow.environment import path_prefixed

    out = build_dir(variant)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with path_prefixed(_ninja_dir()):
            cpp_extension.load(name=f"hqtflow_fp8_cpu_{variant}", sources=[str(SOURCE)], build_directory=str(out),
                               extra_cflags=_flags(variant), extra_ldflags=["-fopenmp"], is_python_module=False,
                               verbose=False)
    except Exception as e:  # no compiler, no headers: the caller falls back to the QDQ reference
        _errors[variant] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        return False
    if variant != "native":
        return True

    @torch.library.register_fake("hqtflow::fp8_linear")
    def _(x, weight, weight_scale, input_scale, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("hqtflow::fp8_dequantize")
    def _(weight, weight_scale, dtype):
        return weight.new_empty(weight.shape, dtype=dtype)

    return True


def _ninja_dir() -> str | None:
    """The pip `ninja` package's bin dir when no `ninja` is on PATH (torch's build runs it by name), else None."""
    import shutil

    if shutil.which("ninja") is not None:
        return None
    try:
        import ninja
    except ImportError:
        return None
    return ninja.BIN_DIR


def available() -> bool:
    return load()


def build_error(variant: str = "native") -> str | None:
    load(variant)
    return _errors.get(variant)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, fp8: str = "E4M3") -> torch.Tensor:
    """`hqtflow.scales.quantize` for a 2-D weight (scale: one value or one per row), bit-identical and parallel
    with the kernel on CPU; the reference otherwise."""
    from hqtflow.scales import quantize

    if w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16, torch.float32) and load():
        return torch.ops.hqtflow.fp8_quantize(w, scale.reshape(-1), fp8 == "E4M3")
    return quantize(w, scale, fp8)
