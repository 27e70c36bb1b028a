"""A gated MLP's FP8 `down_proj` on the CPU kernel, its input made inside the kernel (the "cpu" backend).

transformers' Llama-family MLPs compute `down_proj(act_fn(gate_proj(x)) * up_proj(x))`. In eager torch, `act_fn`
and `*` are two element-wise passes over a [tokens, intermediate] tensor, with a third tensor between them: a sixth
of SmolLM2's 16 x 512-token forward on a 2-core AMX Xeon. With an FP8 `down_proj` on the kernel, `fp8_linear_gated`
makes each input row hp(act(g) * u) while it lays the input out for the product (as vLLM fuses SiLU, multiply and
FP8 quantization into one kernel), so the two passes and the tensors they write are gone.

act(g) is looked up in a table of the model's own `act_fn` applied to all 65536 bf16 or fp16 values, so the input is
bit for bit the one the model's forward makes. That holds only for activations whose value for an input does not
depend on where it sits in a tensor: torch's vector and scalar loops agree on every input for SiLU and ReLU, not for
tanh-GELU (4 of 65536 bf16 inputs differ). A module is fused only when its activation passes that check and its
fused forward equals its own on a probe input; others keep their own forward.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from hqtflow.quantize.fp8_linear import FP8Linear

TABLE_DTYPES = (torch.bfloat16, torch.float16)


def act_table(act_fn, dtype: torch.dtype) -> torch.Tensor | None:
    """`act_fn` of every bit pattern of `dtype` (bf16 or fp16), plus one entry of padding (the kernel's vector lookup
    reads 4 bytes): 65537 values. None unless `act_fn` is element-wise and its value for an input does not depend on
    where the input sits: its outputs for the two halves of the values, each strided (torch's scalar loop), must be
    its output for the whole contiguous tensor (vector loops), NaN only where that is NaN, and finite inputs must not
    give NaN."""
    values = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    with torch.no_grad():
        out = act_fn(values)
        apart = [act_fn(half.repeat_interleave(2)[::2]) for half in values.chunk(2)]
    if not all(isinstance(t, torch.Tensor) and t.dtype == dtype for t in [out, *apart]) or out.shape != values.shape:
        return None
    if [t.shape for t in apart] != [h.shape for h in values.chunk(2)] or out[values.isfinite()].isnan().any():
        return None
    apart = torch.cat(apart)
    same = (out.view(torch.int16) == apart.view(torch.int16)) | (out.isnan() & apart.isnan())
    return torch.cat([out, out[:1]]).contiguous() if bool(same.all()) else None


def _gated_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with the product and the activation inside
    `down_proj`'s kernel call."""
    down = self.down_proj
    if down.backend != "cpu" or torch.compiler.is_compiling():
        return type(self).forward(self, x)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != down.hp_dtype or up.dtype != gate.dtype or up.shape != gate.shape:
        return down(self.act_fn(gate) * up)
    return down.gated(gate, up, self.hqtflow_act)


def _candidate(mod: nn.Module) -> bool:
    down = getattr(mod, "down_proj", None)
    return (isinstance(down, FP8Linear) and down.backend == "cpu" and down.activation in ("static", None)
            and down.hp_dtype in TABLE_DTYPES and callable(getattr(mod, "act_fn", None))
            and all(isinstance(getattr(mod, n, None), nn.Module) for n in ("gate_proj", "up_proj")))


def _probe_agrees(mod: nn.Module) -> bool:
    """The fused forward gives the module's own forward's bits on a few random rows."""
    hidden = getattr(mod.gate_proj, "in_features", None)
    if not isinstance(hidden, int):
        return False
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0)).to(mod.down_proj.hp_dtype)
    with torch.no_grad():
        try:
            return torch.equal(_gated_forward(mod, x), type(mod).forward(mod, x))
        except (RuntimeError, TypeError, ValueError):
            return False


def use_kernel(model: nn.Module, on: bool) -> int:
    """Give `model`'s gated MLPs whose FP8 `down_proj` runs on the CPU kernel the fused forward (on), or their own
    back; returns how many are fused."""
    tables: list[torch.Tensor] = []
    n = 0
    for mod in model.modules():
        if "forward" in mod.__dict__ and hasattr(mod, "hqtflow_act"):  # fused before: its own forward back
            del mod.forward, mod.hqtflow_act
        if not (on and _candidate(mod)):
            continue
        table = act_table(mod.act_fn, mod.down_proj.hp_dtype)
        if table is None:
            continue
        bits = table.view(torch.int16)
        table = next((t for t in tables if t.dtype == table.dtype and torch.equal(t.view(torch.int16), bits)), table)
        mod.hqtflow_act, mod.forward = table, types.MethodType(_gated_forward, mod)
        if not _probe_agrees(mod):
            del mod.forward, mod.hqtflow_act
            continue
        if all(t is not table for t in tables):  # one table per activation, shared by the layers
            tables.append(table)
        n += 1
    return n
