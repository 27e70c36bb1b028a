"""The CPU FP8 kernel (`csrc/fp8_linear_cpu.cpp`): built once per machine by the system C++ compiler (`$CXX`, else `c++`; one
compile-and-link command, no build tool) and kept in
`$HQTFLOW_CACHE/kernels/<hash>` (the hash covers the source, torch's version and the CPU's vector flags), so later
processes load it in milliseconds. It registers these torch ops:

- `torch.ops.hqtflow.fp8_linear(x, weight, weight_scale, input_scale, bias, packed=None)`: the QDQ reference's
  function hp(QDQ(x) @ hp(W * s_w)^T) + bias, batch-invariant (a row's output does not depend on M or on its
  neighbours); `packed` is `fp8_pack(weight)`, made once per layer (without it, AVX2 packs the weight per call);
- `fp8_linear_gated(gate, up, act, weight, weight_scale, input_scale, bias, packed=None)`: `fp8_linear` of a gated
  MLP's hp(act(gate) * up), that input made row by row inside the call (`gated_mlp.py`; `act`: act's output for
  every bf16/fp16 bit pattern);
- `fp8_pack(weight)`: the weight in the layout the kernel reads on this machine (AVX2: [ceil(N / 8), K, 8], groups of
  8 rows column after column; bf16 dot-product/AMX builds: [ceil(N / 16), ceil(K / 64), 1024], each 64 columns of
  16 rows transposed as the bf16 path widens them; an empty tensor where it reads [N, K] directly); the same bits
  as without it, only faster;
- `fp8_dequantize(weight, weight_scale, dtype)`, `fp8_quantize(x, scale, e4m3)`, `fp8_qdq(x, scale, e4m3)`: the
  reference's `dequantize`, `quantize` and input QDQ, bit-identical and fast;
- `bf16_pack(weight)`, `bf16_linear(x, packed, n, bias)`: high-precision Linears (bf16 values) read packed as bf16 in
  the FP8 path's order (`bf16_linear.py`): fp32 inputs on AVX2, bf16 inputs on AMX and AVX512-BF16;
- `fp8_isa()`: the compute path bf16 models take here ("amx-bf16", "bf16-dot", "avx512-fma", "avx2-fma" or "scalar").

`available()` says whether it could be built here (a compiler and torch headers); the reason otherwise is in
`build_error()`. `load("avx2")` builds an AVX2-only twin under `torch.ops.hqtflow_avx2` so that an AVX-512 machine
tests (and benchmarks) the code path of AVX2-only CPUs too (on an AVX2-only CPU the twin is the native build);
`load("scalar")` a one-lane build without vector instructions (`torch.ops.hqtflow_scalar`), whose order of
operations the AVX2 path must reproduce bit for bit; `load("bf16dot")` a build without AMX
(`torch.ops.hqtflow_bf16dot`), so that an AMX machine tests the AVX512-BF16 path of CPUs without tiles too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "fp8_linear_cpu.cpp"
# one library for hqtflow's CPU ops: the FP8/bf16 Linear kernels and the runtime's paged decode attention
SOURCES = (SOURCE, Path(__file__).parents[1] / "runtime" / "csrc" / "paged_attention_cpu.cpp")
# OpenMP: at::parallel_for runs on torch's threads; no FMA contraction: every path must do the same operations.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
VARIANTS = {"native": ("hqtflow", []), "avx2": ("hqtflow_avx2", ["-mno-avx512f", "-DHQT_OPS_NS=hqtflow_avx2"]),
            "scalar": ("hqtflow_scalar", ["-mno-avx", "-DHQT_OPS_NS=hqtflow_scalar"]),
            "bf16dot": ("hqtflow_bf16dot", ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8", "-DHQT_OPS_NS=hqtflow_bf16dot"])}


def _flags(variant: str) -> list[str]:
    return FLAGS + VARIANTS[variant][1]


def build_dir(variant: str = "native") -> Path:
    from hqtflow.hardware import cpu_flags
    from hqtflow.models import cache_dir

    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(_flags(variant)).encode() + torch.__version__.encode()
                         + " ".join(cpu_flags()).encode())
    return cache_dir() / "kernels" / f"fp8_linear_cpu-{variant}-{key.hexdigest()[:16]}"


def library_path(variant: str = "native") -> Path:
    return build_dir(variant) / f"hqtflow_fp8_cpu_{variant}.so"


def _is_native(variant: str) -> bool:
    """On an x86 CPU with AVX2 and no AVX-512 the `avx2` twin's flags add nothing to `-march=native`, nor the
    `bf16dot` twin's on a CPU without AMX: the native build is that code, so it is not compiled a second time."""
    if variant == "native":
        return True
    from hqtflow.hardware import cpu_flags

    flags = cpu_flags()
    if variant == "bf16dot":
        return "amx_bf16" not in flags
    return variant == "avx2" and "avx2" in flags and "avx512f" not in flags


def ops(variant: str = "native"):
    """The op namespace of a built variant (`torch.ops.hqtflow` for the native one)."""
    return getattr(torch.ops, VARIANTS["native" if _is_native(variant) else variant][0])


def compile_command(compiler: str, variant: str, output: Path) -> list[str]:
    """One compile-and-link command of the shared library against torch's headers and libraries."""
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [a for p in include_paths() for a in ("-isystem", p)]
    libs = [f"-L{p}" for p in library_paths()]
    return [compiler, "-shared", "-fPIC", "-std=c++20", *includes, *_flags(variant), *map(str, SOURCES), "-o", str(output),
            *libs, "-lc10", "-ltorch_cpu", "-ltorch"]


def _build(variant: str, library: Path) -> None:
    """Compile `library` (written beside itself, then renamed: a concurrent process never loads half a file)."""
    from hqtflow.environment import cxx_compiler

    name = cxx_compiler()
    compiler = shutil.which(name)
    if compiler is None:
        raise OSError(f"no C++ compiler {name!r} found")
    library.parent.mkdir(parents=True, exist_ok=True)
    if sys.stderr.isatty():  # a minute or two of silence otherwise, the first time
        print(f"Building the CPU FP8 kernel ({variant}) into {library.parent}, once per machine and torch version "
              "(1-2 minutes)...", file=sys.stderr, flush=True)
    partial = library.with_name(f".{library.name}.{os.getpid()}.partial")
    done = subprocess.run(compile_command(compiler, variant, partial), cwd=library.parent, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        lines = [l for l in done.stderr.splitlines() if "error" in l] or done.stderr.strip().splitlines() or ["?"]
        raise OSError(f"{Path(compiler).name} failed: {lines[0].strip()}")
    partial.replace(library)


@functools.cache
def _load(variant: str) -> str | None:
    """Build (first time on this machine) and load the kernel once per process: None, or why it cannot be."""
    if variant != "native" and _is_native(variant):
        return _load("native")
    library = library_path(variant)
    try:
        if not library.is_file():
            _build(variant, library)
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as e:  # no compiler, no headers: the caller falls back to the QDQ reference
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
    if variant == "native":
        _register_fakes()
    return None


def _register_fakes() -> None:
    """Shapes of the ops' outputs for torch.compile's tracing (meta tensors)."""

    @torch.library.register_fake("hqtflow::fp8_linear")
    def _(x, weight, weight_scale, input_scale, bias, packed=None):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @torch.library.register_fake("hqtflow::fp8_linear_gated")
    def _(gate, up, act, weight, weight_scale, input_scale, bias, packed=None):
        return gate.new_empty(*gate.shape[:-1], weight.shape[0])

    @torch.library.register_fake("hqtflow::paged_decode_attention")
    def _(q, keys, values, slots, offsets, k_scale, v_scale, scale, softcap=0.0, sinks=None):
        return torch.empty_like(q)

    @torch.library.register_fake("hqtflow::bf16_linear")
    def _(x, packed, n, bias):
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("hqtflow::fp8_dequantize")
    def _(weight, weight_scale, dtype):
        return weight.new_empty(weight.shape, dtype=dtype)


def build(variants) -> None:
    """Compile the libraries of `variants` not built yet side by side, one compiler each (what `load` would do one
    after another); a failure is left for `load` to report."""
    from concurrent.futures import ThreadPoolExecutor

    todo = {v: library_path(v) for v in {"native" if _is_native(v) else v for v in variants}}
    todo = {v: lib for v, lib in todo.items() if not lib.is_file()}

    def one(v):
        try:
            _build(v, todo[v])
        except OSError:
            pass

    with ThreadPoolExecutor(max(1, len(todo))) as pool:
        list(pool.map(one, todo))


def load(variant: str = "native") -> bool:
    """Build (first time on this machine) or load the kernel; True when its ops exist."""
    return _load(variant) is None


def available() -> bool:
    return load()


def build_error(variant: str = "native") -> str | None:
    return _load(variant)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, fp8: str = "E4M3") -> torch.Tensor:
    """`hqtflow.scales.quantize` for a 2-D weight (scale: one value or one per row), bit-identical and parallel
    with the kernel on CPU; the reference otherwise."""
    from hqtflow.scales import quantize

    if w.device.type == "cpu" and w.dim() == 2 and w.dtype in (torch.bfloat16, torch.float16, torch.float32) and load():
        return torch.ops.hqtflow.fp8_quantize(w, scale.reshape(-1), fp8 == "E4M3")
    return quantize(w, scale, fp8)
