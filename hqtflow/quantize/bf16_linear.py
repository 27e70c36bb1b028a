"""High-precision Linear layers of an FP8 model on the CPU kernel (the "cpu" backend).

An FP8 checkpoint keeps some Linears in bf16 (the `lm_head`, layers `tune` or a blocklist left out). oneDNN's GEMM
changes the order of its sums with the number of rows, so their outputs were not batch-invariant, and where the
model computes in fp32 (`--dtype auto` on CPUs without native bf16) it reads 4 bytes per weight: at batch 1 SmolLM2's
tied 49152x576 `lm_head` was a third of an FP8 decode step. `PackedBf16Linear` keeps the layer (parameters, state
dict, tied weights) and computes it with the kernel's `bf16_linear` from a bf16 copy of the weight laid out for the
kernel, each output's products added in the FP8 layers' fixed order:
- fp32 models on the kernel's fp32 path (AVX2, the one-lane build): weights whose every value is exactly a bf16
  (then it is the function of fp32 `F.linear` up to the order of the sums);
- bf16 models on the kernel's bf16 paths (AMX, AVX512-BF16): bf16 weights (the function of bf16 `F.linear`, the bias
  added after the rounding to bf16 as in the FP8 layers).
Others, and inputs of another dtype, keep `F.linear`. The router of an unfused MoE block (`hqtflow.quantize.experts`;
transformers' routers call `F.linear` on a plain weight) gets the same treatment for its one product.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def weight_tag(w: torch.Tensor) -> tuple:
    """What a packed copy of `w` was made from: its storage and in-place version (None for an inference tensor, which
    has no version: a model loaded under torch.inference_mode)."""
    return w.data_ptr(), None if w.is_inference() else w._version


class PackedBf16Linear(nn.Linear):
    """An `nn.Linear` (its class swapped in place by `use_kernel`) whose fp32 forward reads a packed bf16 copy."""

    packed: torch.Tensor | None = None
    _packed_from: tuple | None = None  # weight_tag of the weight `packed` was made from

    def repack(self) -> None:
        self.packed = _pack(self.weight)
        self._packed_from = weight_tag(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and self._packed_from != weight_tag(self.weight):
            self.repack()
        if self.packed is None or x.dtype != self.weight.dtype:
            return super().forward(x)
        return torch.ops.hqtflow.bf16_linear(x, self.packed, self.out_features, self.bias)


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` laid out for the kernel's `bf16_linear`, or None where the kernel does not take it (see above)."""
    w = weight.detach()
    if w.dtype == kernel_dtype() and w.device.type == "cpu":
        wb = w.to(torch.bfloat16)
        if torch.equal(wb.to(w.dtype), w):
            packed = torch.ops.hqtflow.bf16_pack(wb)
            return packed if packed.numel() else None
    return None


class _RouterOnKernel(TorchFunctionMode):
    """Inside a MoE router's forward (transformers' routers are not `nn.Linear`: they call `F.linear(x,
    self.weight)`), that one product on the kernel, so the routing of a token does not depend on its neighbours."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = self.router
        if (func is nn.functional.linear and len(args) == 2 and not kwargs and args[1] is r.weight
                and args[0].dtype == r.weight.dtype and args[0].dim() == 2):
            return torch.ops.hqtflow.bf16_linear(args[0], r.hqtflow_packed, r.weight.shape[0], None)
        return func(*args, **kwargs)


def _router_forward(self, *args, **kwargs):
    if torch.compiler.is_compiling():
        return type(self).forward(self, *args, **kwargs)
    w = self.weight
    if self.hqtflow_packed_from != (*weight_tag(w), w.dtype):  # remade when the weight changed
        self.hqtflow_packed, self.hqtflow_packed_from = _pack(w), (*weight_tag(w), w.dtype)
    if self.hqtflow_packed is None:
        return type(self).forward(self, *args, **kwargs)
    with _RouterOnKernel(self):
        return type(self).forward(self, *args, **kwargs)


def _routers(model: nn.Module) -> list[nn.Module]:
    """The routers of `model`'s unfused MoE blocks: a sibling of an `Experts` module with a [E, H] weight."""
    from hqtflow.quantize.experts import Experts

    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, Experts):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            for child in parent.children():
                w = getattr(child, "weight", None)
                if (type(child) is not nn.Linear and isinstance(w, torch.Tensor) and w.dim() == 2
                        and w.shape[0] == mod.num_experts):
                    found.append(child)
    return found


def kernel_dtype() -> torch.dtype:
    """The input dtype of this machine's `bf16_linear`: bf16 on the kernel's bf16 paths, else fp32."""
    return torch.bfloat16 if torch.ops.hqtflow.fp8_isa() in ("amx-bf16", "bf16-dot") else torch.float32


def use_kernel(model: nn.Module, on: bool) -> int:
    """Swap `model`'s plain Linears of the kernel's dtype to `PackedBf16Linear` (on) or back; returns how many read
    packed bf16."""
    n = 0
    for router in _routers(model):
        if on:
            w = router.weight
            router.hqtflow_packed, router.hqtflow_packed_from = _pack(w), (*weight_tag(w), w.dtype)
            router.forward = types.MethodType(_router_forward, router)
            n += router.hqtflow_packed is not None
        elif "forward" in router.__dict__:
            del router.forward, router.hqtflow_packed, router.hqtflow_packed_from
    for mod in model.modules():
        if on and type(mod) is nn.Linear and mod.weight.dtype == kernel_dtype():
            mod.__class__ = PackedBf16Linear
        if isinstance(mod, PackedBf16Linear):
            if on:
                mod.repack()
                n += mod.packed is not None
            else:
                mod.__class__ = nn.Linear
                mod.packed, mod._packed_from = None, None
    return n
