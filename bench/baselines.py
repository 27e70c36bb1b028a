"""The high-precision baseline a speed bench adds to bf16/fp32 `F.linear`: the CPU kernel's packed bf16 path, which is
how hqtflow runs a plain model's Linears (`hqtflow.api.linears_on_kernel`) and often the fastest high-precision path on
CPUs with bf16 dot products. FP8 is compared with the fastest of them all."""

from __future__ import annotations

from pathlib import Path

import torch


def packed_model(path: str | Path, backend: str = "auto") -> torch.nn.Module | None:
    """The bf16 model at `path` with its Linears on the packed path, as `hqtflow.load` serves it; None where the kernel
    is not used (`backend` qdq, or no kernel)."""
    from hqtflow import models
    from hqtflow.api import linears_on_kernel

    model = models.load_model(path, "bf16")
    return model if linears_on_kernel(model, backend) else None


def packed_linears(weights: list[torch.Tensor]) -> tuple[list[torch.nn.Linear], torch.dtype] | None:
    """Bias-free Linears of `weights` (bf16 values) on the packed path, and the input dtype they take (bf16 with bf16 dot
    products, else fp32); None where the kernel's packed path does not take them."""
    from hqtflow.quantize.bf16_linear import kernel_dtype, use_kernel

    dtype = kernel_dtype()
    mods = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype) for w in weights)
    with torch.no_grad():
        for m, w in zip(mods, weights):
            m.weight.copy_(w)  # bf16 values: exact in either dtype
    return (list(mods), dtype) if use_kernel(mods, True) == len(mods) else None
