"""The CPU FP8 kernel (`csrc/fp8_linear_cpu.cpp`): built once per machine with the system C++ compiler and kept in
`$HQTFLOW_CACHE/kernels/<hash>` (the hash covers the source, torch's version and the CPU's vector flags), so later
processes load it in milliseconds. It registers two torch ops:

- `torch.ops.hqtflow.fp8_linear(x, weight, weight_scale, input_scale, bias)`: QDQ(x) @ (W * s_w)^T + bias with the
  FP8 weight widened in registers (decode-sized inputs) or block by block into ATen's GEMM (prefill);
- `torch.ops.hqtflow.fp8_dequantize(weight, weight_scale, dtype)`: the reference's `dequantize`, fast.

`available()` says whether it could be built here (a compiler and torch headers); the reason otherwise is in
`build_error()`.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "fp8_linear_cpu.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's threads
_error: str | None = None


def _cpu_flags() -> list[str]:
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
        return sorted(f for f in line.split() if f.startswith(("avx", "f16c", "fma", "sse4")))
    except (OSError, StopIteration):
        return [platform.machine()]


def build_dir() -> Path:
    from hqtflow.models import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode()
                         + " ".join(_cpu_flags()).encode())
    return cache_dir() / "kernels" / f"fp8_linear_cpu-{key.hexdigest()[:16]}"


@functools.cache
def load() -> bool:
    """Build (first time on this machine) or load the kernel; True when `torch.ops.hqtflow.fp8_linear` exists."""
    global _error
    import os
    import shutil

    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the pip `ninja` package's binary, when its bin dir is not on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name="hqtflow_fp8_cpu", sources=[str(SOURCE)], build_directory=str(out),
                           extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False,
                           verbose=False)
    except Exception as e:  # no compiler, no headers: the caller falls back to the QDQ reference
        _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        return False

    @torch.library.register_fake("hqtflow::fp8_linear")
    def _(x, weight, weight_scale, input_scale, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("hqtflow::fp8_dequantize")
    def _(weight, weight_scale, dtype):
        return weight.new_empty(weight.shape, dtype=dtype)

    return True


def available() -> bool:
    return load()


def build_error() -> str | None:
    load()
    return _error


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, fp8: str = "E4M3") -> torch.Tensor:
    """`hqtflow.scales.quantize` for a 2-D weight (scale: one value or one per row), bit-identical and parallel
    with the kernel on CPU; the reference otherwise."""
    from hqtflow.scales import quantize

    if w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16, torch.float32) and load():
        return torch.ops.hqtflow.fp8_quantize(w, scale.reshape(-1), fp8 == "E4M3")
    return quantize(w, scale, fp8)
