"""What the machine computes fastest: its CPU's vector flags, and the high-precision dtype the runtime uses when the
user has not chosen one ("auto"): bf16 on GPUs and on CPUs with native bf16 dot products (AVX512-BF16, AMX-BF16),
fp32 on other CPUs, where bf16 matmuls are emulated and run several times slower than fp32; and where a bf16 GEMM of
many rows is better computed by the fp32 GEMM (`fp32_gemm_is_faster`). Also what it has free:
`available_memory_bytes` (RAM, within the process's cgroup limit) and `free_disk_bytes`."""

from __future__ import annotations

import functools
import platform
import shutil
from pathlib import Path

from hqtflow.choices import TORCH_NAMES

BF16_NATIVE_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """The CPU's vector-extension flags (x86 /proc/cpuinfo), sorted; the machine name elsewhere."""
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
        return tuple(sorted(f for f in line.split() if f.startswith(("avx", "amx", "f16c", "fma", "sse4"))))
    except (OSError, StopIteration):
        return (platform.machine(),)


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor_id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" where there is none."""
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("vendor_id"))
        return line.split(":", 1)[1].strip()
    except (OSError, StopIteration, IndexError):
        return ""


def fp32_gemm_is_faster() -> bool:
    """Whether a CPU GEMM of many rows (prefill, calibration, a bf16 reference) runs faster in fp32 than in bf16 here:
    on CPUs without native bf16 dot products (bf16 emulated), and on Intel cores with AVX512-BF16 but no AMX, where
    VDPBF16PS issues at a quarter of the FMA rate (an Emerald Rapids with AMX hidden: 0.78 vs 0.19 ns an
    instruction; bf16 `F.linear` via the fp32 GEMM 1.4-1.7x oneDNN's bf16 one at 2048-8192 rows, bench/RESULTS.md).
    Not on AMX, nor on AMD cores with AVX512-BF16."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return False
    return "avx512_bf16" not in flags or cpu_vendor() == "GenuineIntel"


def machine_line() -> str:
    """What a benchmark prints about the machine it ran on: the CPU flags, the CPU count and the load average (a run
    beside other work shows it)."""
    import os

    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return f"CPU flags: {' '.join(cpu_flags()) or '(none found)'}; {os.cpu_count()} CPUs; load average {load} (1/5/15 min)"


def fastest_dtype(device: str = "cpu") -> str:
    """"bf16" or "fp32": the faster high-precision dtype on `device`."""
    if not str(device).startswith("cpu"):
        return "bf16"
    return "bf16" if any(f in cpu_flags() for f in BF16_NATIVE_FLAGS) else "fp32"


# torch's names of the high-precision dtypes (and a torch.dtype's str without "torch.") -> hqtflow's
DTYPE_NAMES = {n: d.value for d, names in TORCH_NAMES.items() for n in names}


def dtype_name(dtype):
    """hqtflow's name of a dtype given as hqtflow's name, torch's ("bfloat16") or a torch.dtype (torch.bfloat16), for
    the Python API; anything else is returned as it is, for resolve_dtype to refuse."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_NAMES.get(name, dtype)


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
    """"auto" (or None) -> fastest_dtype(device); bf16, fp16 and fp32 are returned as they are; anything else is
    refused by choices.parse_dtype's sentence. `name`: the setting, "--dtype" or "dtype" in Python."""
    from hqtflow.choices import Dtype, parse_dtype

    dtype = Dtype.AUTO if dtype is None else parse_dtype(dtype, name)
    return fastest_dtype(device) if dtype == Dtype.AUTO else dtype.value


# ---- free resources (monkeypatched by tests) -------------------------------------------------------------
def byte_size(n: int) -> str:
    """A size in bytes for a message, binary units with one decimal: "1.2 GiB" from 1 GiB up, else "64.0 MiB"."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def available_memory_bytes() -> int | None:
    """The memory this process may still take: /proc/meminfo's MemAvailable, or less where a cgroup memory limit
    (v2 memory.max, v1 memory.limit_in_bytes, of the process's group or an ancestor) leaves less; None where
    neither is known."""
    known = [n for n in (_meminfo_available(), _cgroup_headroom()) if n is not None]
    return min(known) if known else None


def free_disk_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# (mount, limit file, usage file, reclaimable page cache counter in memory.stat) of cgroup v2 and v1
CGROUP_MEMORY = ((Path("/sys/fs/cgroup"), "memory.max", "memory.current", "inactive_file"),
                 (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def _cgroup_headroom(proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """limit - (usage - inactive page cache) of the tightest memory cgroup above this process, None without a limit.
    The usage counts page cache; its inactive part is reclaimed before the limit is hit (the working set kubelet
    uses)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best = None
    for mount, limit_file, usage_file, cache_key in CGROUP_MEMORY:
        v2 = limit_file == "memory.max"
        rel = next((l.split(":", 2)[2] for l in lines if l.count(":") >= 2 and
                    (l.split(":", 2)[:2] == ["0", ""] if v2 else "memory" in l.split(":", 2)[1].split(","))), None)
        if rel is None:
            continue
        group = mount / rel.lstrip("/")
        for d in [group, *group.parents]:  # the group and its ancestors: the tightest limit applies
            if not d.is_relative_to(mount):
                break
            room = _group_headroom(d, limit_file, usage_file, cache_key)
            if room is not None:
                best = room if best is None else min(best, room)
    return best


def _group_headroom(d: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit = (d / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 2**60:  # no limit (v1 writes it as a page-rounded 2^63 - 1)
            return None
        usage = int((d / usage_file).read_text())
        stat = dict(l.split() for l in (d / "memory.stat").read_text().splitlines() if len(l.split()) == 2)
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - usage + int(stat.get(cache_key, 0)))
