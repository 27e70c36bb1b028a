"""What the machine has free: memory within the cgroup's limit."""

from pathlib import Path

import pytest

from hqtflow import hardware


def _group(d: Path, limit: str, usage: int, stat: str, files: tuple[str, str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / files[0]).write_text(limit + "\n")
    (d / files[1]).write_text(f"{usage}\n")
    (d / "memory.stat").write_text(stat)


@pytest.mark.parametrize("v2", [True, False])
def test_cgroup_limit_bounds_available_memory(tmp_path, monkeypatch, v2):
    """MemAvailable ignores a container's memory limit: the tightest cgroup (the process's or an ancestor's) bounds
    it, less its usage but its inactive page cache."""
    mount = tmp_path / "cg"
    files = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    cache = "inactive_file" if v2 else "total_inactive_file"
    monkeypatch.setattr(hardware, "CGROUP_MEMORY", ((mount, *files, cache),))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n" if v2 else "4:memory:/a/b\n0::/\n")
    _group(mount, "max" if v2 else str(2**63 - 4096), 5 * 2**30, f"{cache} 0\n", files)  # the root: no limit
    _group(mount / "a", str(800 * 2**20), 500 * 2**20, f"{cache} {100 * 2**20}\nanon 1\n", files)
    _group(mount / "a" / "b", "max" if v2 else str(2**63 - 4096), 300 * 2**20, f"{cache} 0\n", files)
    assert hardware._cgroup_headroom(proc) == 400 * 2**20  # the parent's 800 MiB - (500 - 100) MiB
    monkeypatch.setattr(hardware, "_cgroup_headroom", lambda: 400 * 2**20)
    monkeypatch.setattr(hardware, "_meminfo_available", lambda: 20 * 2**30)
    assert hardware.available_memory_bytes() == 400 * 2**20


def test_no_cgroup_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "CGROUP_MEMORY", ((tmp_path / "none", "memory.max", "memory.current", "inactive_file"),))
    (tmp_path / "cgroup").write_text("0::/\n")
    assert hardware._cgroup_headroom(tmp_path / "cgroup") is None
