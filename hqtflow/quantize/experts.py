"""MoE experts as one pair of Linears per expert, so each expert is planned, scaled, quantized, saved and run like
any Linear.

transformers 5 fuses a Mixtral-style MoE block's experts into one module with 3-D parameters (`gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I]; Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...). `unfuse_experts` replaces each such
module by `Experts`, whose children `<e>` hold `gate_up_proj` [2I, H] and `down_proj` [H, I] as `nn.Linear` views of
the same weights (no copy). Its forward is transformers' eager expert loop, so the unfused model computes the same
function, bit for bit (checked on every module unfused from real weights). The Linears' names,
`<experts>.<e>.gate_up_proj` and `<experts>.<e>.down_proj`, are the nodes `hqtflow measure` observes, so
`convert_model` swaps them for FP8Linears with each expert's own statistics, and the checkpoint stores them under those
names; `load_checkpoint` unfuses a container when the checkpoint holds it per expert.
"""

from __future__ import annotations

import torch
from torch import nn

from hqtflow.errors import ModelError
from hqtflow.measure.hooks import is_fused_experts


class ExpertMLP(nn.Module):
    """One expert: act(gate) * up from the concatenated [gate; up] projection, then down."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn = gate_up_proj, down_proj, act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class Experts(nn.Module):
    """Experts `0..E-1` (children named by their index); called as transformers calls its fused experts."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__()
        self.num_experts = len(experts)
        for e, mlp in enumerate(experts):
            self.add_module(str(e), mlp)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        # transformers' eager loop (MixtralExperts.forward), expert by expert over the tokens routed to it
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        experts = self._modules
        for e in hit.flatten().tolist():
            if e == self.num_experts:  # the slot of tokens sent to no local expert (expert parallelism)
                continue
            top_k_pos, token_idx = torch.where(mask[e])
            y = experts[str(e)](hidden_states[token_idx]) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, y.to(final.dtype))
        return final


def why_not_unfused(mod: nn.Module) -> str | None:
    """Why a fused experts module cannot be unfused (its function is not Mixtral's expert loop), or None."""
    shape_ok = (mod.gate_up_proj.dim() == 3 and mod.down_proj.dim() == 3 and
                mod.gate_up_proj.shape[0] == mod.down_proj.shape[0] and
                mod.gate_up_proj.shape[2] == mod.down_proj.shape[1] and
                mod.gate_up_proj.shape[1] == 2 * mod.down_proj.shape[2])
    standard = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                "has_post_expert_norm": False}
    odd = [k for k, v in standard.items() if getattr(mod, k, v) != v]
    if not shape_ok or odd or not callable(getattr(mod, "act_fn", None)):
        detail = ", ".join(odd) or "gate_up_proj [E, 2I, H], down_proj [E, H, I] and act_fn"
        return f"its fused experts ({type(mod).__name__}) are not of Mixtral's layout ({detail})"
    if any(n.endswith("bias") for n, _ in mod.named_parameters(recurse=False)):
        return f"its fused experts ({type(mod).__name__}) have biases"
    return None


def _unfused(mod: nn.Module) -> Experts:
    gu, down = mod.gate_up_proj, mod.down_proj
    experts = []
    for e in range(gu.shape[0]):
        pair = []
        for w in (gu[e], down[e]):
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta", dtype=w.dtype)
            lin.weight = nn.Parameter(w.detach(), requires_grad=False)  # a view of the fused weight
            pair.append(lin)
        experts.append(ExpertMLP(*pair, mod.act_fn))
    return Experts(experts)


def _check_same_function(name: str, fused: nn.Module, unfused: Experts) -> None:
    """The unfused module must compute what the fused one's eager forward computes, exactly, on a few tokens."""
    w = fused.gate_up_proj
    if w.device.type == "meta":
        return
    eager = getattr(type(fused).forward, "__wrapped__", type(fused).forward)  # past transformers' dispatcher
    g = torch.Generator(device="cpu").manual_seed(0)
    n, e, k = 16, unfused.num_experts, min(2, unfused.num_experts)
    x = torch.randn(n, w.shape[2], generator=g).to(w.dtype).to(w.device)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(w.device)
    wts = torch.rand(n, k, generator=g).to(w.dtype).to(w.device)
    with torch.no_grad():
        a, b = eager(fused, x, idx, wts), unfused(x, idx, wts)
    same = torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())  # damaged weights: NaN
    if not same:
        raise ModelError(f"{name} ({type(fused).__name__}) does not compute Mixtral's expert loop, so its experts "
                         "cannot be quantized one by one; add it to the config's blocklist types.")


def unfuse_experts(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Replace fused experts modules (all of them, or those in `names`) by `Experts`; return the names replaced.
    Modules that are not of Mixtral's layout are left fused (the caller says why, see `why_not_unfused`)."""
    done = []
    for name, mod in list(model.named_modules()):
        if not is_fused_experts(mod) or (names is not None and name not in names) or why_not_unfused(mod):
            continue
        new = _unfused(mod)
        _check_same_function(name, mod, new)
        model.set_submodule(name, new)
        done.append(name)
    return done
