"""Engines hqtflow can drive besides its own: Neural Compressor (`inc.py`) and, under it, Intel Gaudi (`hpu.py`).

`--engine hqtflow|inc` and `--device cpu|hpu` are resolved here; the engines themselves are imported lazily.
"""

from __future__ import annotations

from hqtflow.choices import Engine, parse
from hqtflow.errors import ConfigError

DEVICES = ("cpu", "hpu")


def default_device() -> str:
    """hpu when `habana_frameworks.torch` imports (a Gaudi machine), else cpu."""
    from hqtflow.engines import hpu

    return "hpu" if hpu.available() else "cpu"


def resolve(engine: str, device: str | None) -> str | None:
    """Check `--engine` and `--device`; the device INC runs on (None for hqtflow's own engine)."""
    if parse(Engine, engine, "--engine") == Engine.HQTFLOW:
        if device is not None:
            raise ConfigError("--device selects where Neural Compressor runs: use it with --engine inc.")
        return None
    device = device or default_device()
    if device not in DEVICES:
        raise ConfigError(f"Unknown --device {device!r}; valid values are {', '.join(DEVICES)}.")
    if device == "hpu":
        from hqtflow.engines import hpu

        hpu.import_habana()  # one sentence when the Gaudi stack is absent
    return device
