"""High-precision Linear layers of an FP8 model on the CPU kernel (the "cpu" backend, fp32 compute on AVX2).

An FP8 checkpoint keeps some Linears in bf16 (the `lm_head`, layers `tune` or a blocklist left out). Where the model
computes in fp32 (`--dtype auto` on CPUs without native bf16), oneDNN's fp32 GEMM reads 4 bytes per weight, and its
sums change order with the number of rows: at batch 1 SmolLM2's tied 49152x576 `lm_head` was a third of an FP8
decode step, and its logits were not batch-invariant. `PackedBf16Linear` keeps the layer (parameters, state dict,
tied weights) and computes it with the kernel's `bf16_linear`: a bf16 copy of the weight laid out for the kernel
(half of fp32's bytes), each output's products added k ascending like the FP8 layers'. Only weights whose every
value is exactly a bf16 are read that way (then it is the same function as fp32 `F.linear` up to the order of the
sums); others, and inputs that are not fp32, keep `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedBf16Linear(nn.Linear):
    """An `nn.Linear` (its class swapped in place by `use_kernel`) whose fp32 forward reads a packed bf16 copy."""

    packed: torch.Tensor | None = None
    _packed_from: tuple[int, int] | None = None  # (data_ptr, version) of the weight `packed` was made from

    def repack(self) -> None:
        w = self.weight.detach()
        self.packed = None
        if w.dtype == torch.float32 and w.device.type == "cpu":
            wb = w.to(torch.bfloat16)
            if torch.equal(wb.float(), w):
                packed = torch.ops.hqtflow.bf16_pack(wb)
                self.packed = packed if packed.numel() else None
        self._packed_from = (self.weight.data_ptr(), self.weight._version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and self._packed_from != (self.weight.data_ptr(), self.weight._version):
            self.repack()
        if self.packed is None or x.dtype != torch.float32:
            return super().forward(x)
        return torch.ops.hqtflow.bf16_linear(x, self.packed, self.out_features, self.bias)


def use_kernel(model: nn.Module, on: bool) -> int:
    """Swap `model`'s plain fp32 Linears to `PackedBf16Linear` (on) or back; returns how many read packed bf16."""
    n = 0
    for mod in model.modules():
        if on and type(mod) is nn.Linear and mod.weight.dtype == torch.float32:
            mod.__class__ = PackedBf16Linear
        if isinstance(mod, PackedBf16Linear):
            if on:
                mod.repack()
                n += mod.packed is not None
            else:
                mod.__class__ = nn.Linear
                mod.packed, mod._packed_from = None, None
    return n
