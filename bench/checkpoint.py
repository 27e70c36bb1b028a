"""What the model benchmarks share: the FP8 checkpoint (`make demo` writes out/smollm2/fp8) loaded on a backend,
and the path of the model it was quantized from."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hqtflow import models  # noqa: E402
from hqtflow.eval_run import source_model  # noqa: E402
from hqtflow.api import load_any  # noqa: E402
from hqtflow.formats.artifact import MANIFEST  # noqa: E402

DEFAULT = ROOT / "out" / "smollm2" / "fp8"


def fp8_and_source(checkpoint: str | Path, backend: str = "auto"):
    """(FP8 model, tokenizer, source model path, the FP8 layers' backend); exits with one sentence without one."""
    ckpt = Path(checkpoint)
    if not (ckpt / MANIFEST).is_file():
        sys.exit(f"No FP8 checkpoint at {ckpt}: run `make demo` (or pass --checkpoint).")
    fp8, tok, _ = load_any(str(ckpt), backend=backend)
    used = next((m.backend for m in fp8.modules() if hasattr(m, "backend")), "?")
    return fp8, tok, models.resolve_model(source_model(str(ckpt))), used
