"""Intel Gaudi (HPU) specifics, in one place; imported by the INC engine only when `--device hpu`.

Every function that touches the Habana stack is named after the Habana API it calls and imports
`habana_frameworks.torch` lazily, so this module imports (and its bucketing runs) on any machine.
Untested here: no Gaudi machine and no `habana_frameworks` wheel are available to hqtflow's CI.
"""

from __future__ import annotations

import importlib
import importlib.util

from hqtflow.errors import ConfigError

HABANA_MODULE = "habana_frameworks.torch"


def available() -> bool:
    """Whether `habana_frameworks.torch` imports (checked without importing anything when it is not installed)."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return False
    try:
        importlib.import_module(HABANA_MODULE)
    except Exception:  # noqa: BLE001 - an installed but broken stack (no driver, wrong Synapse) is "not available"
        return False
    return True


def import_habana():
    """`import habana_frameworks.torch` (registers the `hpu` device with torch); one sentence when it is absent."""
    if importlib.util.find_spec("habana_frameworks") is None:
        raise ConfigError("--device hpu needs the Intel Gaudi software stack (habana_frameworks.torch), which is not "
                          "installed here; use --device cpu.")
    try:
        return importlib.import_module(HABANA_MODULE)
    except Exception as e:  # noqa: BLE001 - any import failure of the vendor stack
        raise ConfigError(f"--device hpu: habana_frameworks.torch does not import ({type(e).__name__}: {e}); "
                          "use --device cpu.") from None


def mark_step() -> None:
    """`habana_frameworks.torch.core.mark_step()`: run the ops queued in lazy mode (after each forward)."""
    import_habana()
    importlib.import_module("habana_frameworks.torch.core").mark_step()


def wrap_in_hpu_graph(model):
    """`habana_frameworks.torch.hpu.wrap_in_hpu_graph(model)`: replay recorded HPU graphs per input shape."""
    import_habana()
    return importlib.import_module("habana_frameworks.torch.hpu").wrap_in_hpu_graph(model)


def to_hpu(obj):
    """`obj.to("hpu")` for a model or tensor (the device exists once habana_frameworks.torch is imported)."""
    import_habana()
    return obj.to("hpu")


# ---- shape bucketing, as TGI-Gaudi does it (pure; runs anywhere) -----------------------------------------
def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple (TGI-Gaudi's PAD_SEQUENCE_TO_MULTIPLE_OF / BATCH_BUCKET_SIZE rule)."""
    if n < 0 or multiple < 1:
        raise ValueError(f"round_up needs n >= 0 and multiple >= 1, not {n}, {multiple}")
    return n + (-n % multiple)


def bucketed_shape(batch: int, length: int, *, batch_bucket: int = 1, pad_to_multiple: int = 128,
                   max_length: int | None = None) -> tuple[int, int]:
    """The (batch, sequence) shape a request batch runs as on HPU: batch rounded up to `batch_bucket`, length to
    `pad_to_multiple` and capped at `max_length`, so HPU graphs are recorded for few shapes."""
    padded = round_up(length, pad_to_multiple)
    if max_length is not None:
        if length > max_length:
            raise ConfigError(f"A sequence of {length} tokens is longer than the maximum {max_length}.")
        padded = min(padded, max_length)
    return round_up(batch, batch_bucket), padded


def pad_to_bucket(input_ids, attention_mask, pad_id: int, *, batch_bucket: int = 1, pad_to_multiple: int = 128,
                  max_length: int | None = None):
    """Left-pad a [B, S] batch to its bucketed shape (TGI-Gaudi pads prompts on the left; extra rows are padding
    with an all-zero mask). Returns (input_ids, attention_mask)."""
    import torch

    b, s = input_ids.shape
    nb, ns = bucketed_shape(b, s, batch_bucket=batch_bucket, pad_to_multiple=pad_to_multiple, max_length=max_length)
    ids = torch.full((nb, ns), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    mask = torch.zeros((nb, ns), dtype=attention_mask.dtype, device=attention_mask.device)
    ids[:b, ns - s:] = input_ids
    mask[:b, ns - s:] = attention_mask
    return ids, mask
