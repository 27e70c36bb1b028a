"""Attach maxabs observers to the modules a QUANT_CONFIG selects and collect HQT node statistics.

Observed: every `nn.Linear` (inputs; outputs unless `measure_exclude` says otherwise; the weight once), and
MoE expert containers whose experts are fused 3-D parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
transformers 5's layout): each expert is observed as two nodes `<experts>.<e>.gate_up_proj` and
`<experts>.<e>.down_proj`, fed with the tokens the router sent to it. Under tensor parallelism each rank
observes its local shards and records, per node, how the weight is split (from its DTensor placement).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch
from torch import nn

from hqtflow.errors import ModelError
from hqtflow.formats.measurement import NodeStats
from hqtflow.formats.quant_config import QuantConfig
from hqtflow.measure.observers import make_observer, weight_stat


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (tensor parallelism), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def parallel_style(w: torch.Tensor) -> tuple[str, int]:
    """How tensor parallelism split a weight [out, in]: (column | row | replicated, packed parts).

    Packed (fused gate/up) weights carry a strided shard: each rank holds a slice of every part.
    """
    placements = getattr(w, "placements", None)
    if not placements:
        return "replicated", 1
    p = placements[0]
    if getattr(p, "is_shard", lambda *a: False)():
        dim = p.dim if p.dim >= 0 else p.dim + w.dim()
        return {0: "column", 1: "row"}.get(dim, f"shard{dim}"), int(getattr(p, "split_factor", 1))
    return "replicated", 1


def expert_style(mod: nn.Module, proj: str) -> tuple[str, int, list[int]]:
    """How tensor parallelism split one expert's matrix of fused experts (transformers' plan: `packed_colwise` for
    gate_up_proj, `rowwise` for down_proj): (column | row | replicated, packed parts, the whole matrix's shape), from
    the 3-D weight's DTensor placement or, for a plain local shard, its shape against the module's own sizes."""
    w = getattr(mod, proj)
    local = list(_local(w).shape[1:])
    inter, hidden = getattr(mod, "intermediate_dim", None), getattr(mod, "hidden_dim", None)
    whole = ([2 * inter, hidden] if proj == "gate_up_proj" else [hidden, inter]) if inter and hidden else local
    placements = getattr(w, "placements", None)
    dim = next((p.dim % w.dim() for p in placements or () if getattr(p, "is_shard", lambda *a: False)()), None)
    if dim is None and local != whole and len(whole) == 2:
        dim = 1 if local[0] != whole[0] else 2
    style = {1: "column", 2: "row"}.get(dim, "replicated")
    return style, 2 if style == "column" and proj == "gate_up_proj" else 1, whole


def is_fused_experts(mod: nn.Module) -> bool:
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.dim() == 3 and down.dim() == 3


def expert_inputs(mod: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, valid: torch.Tensor | None,
                  experts: list[int]) -> Iterator[tuple]:
    """For each expert of `experts` that the router sent tokens to (`valid`: a mask of the tokens to count, padding
    excluded): (e, its input x, gate_up output h, down_proj's input act(gate) * up, down_proj's weight), from the fused
    weights (local shards under tensor parallelism)."""
    gu_all, down_all = _local(mod.gate_up_proj), _local(mod.down_proj)
    for e in experts:
        routed = (top_k_index == e).any(dim=-1)
        if valid is not None:
            routed &= valid
        if not routed.any():
            continue
        x = hidden[routed]
        gu_w = gu_all[e] if gu_all.shape[-1] == x.shape[-1] else gu_all[e].t()
        h = nn.functional.linear(x, gu_w)
        gate, up = h.chunk(2, dim=-1)
        inner = mod.act_fn(gate) * up
        down_w = down_all[e] if down_all.shape[-1] == inner.shape[-1] else down_all[e].t()
        yield e, x, h, inner, down_w


def unsupported(mod: nn.Module) -> str | None:
    """Why a module cannot be measured, where calibration would otherwise pass it over without a word."""
    kind = type(mod).__name__
    if kind == "Conv1D":  # transformers' GPT-2 family: x @ W + b with W stored [in, out]
        return "its projections are transformers' Conv1D layers, not nn.Linear"
    if is_fused_experts(mod) and (not callable(getattr(mod, "act_fn", None)) or
                                  any(n.endswith("bias") for n, _ in mod.named_parameters(recurse=False))):
        return f"its fused experts ({kind}) are not of Mixtral's layout (gate_up_proj and down_proj without biases, act_fn)"
    if stacked := other_experts(mod):
        return f"its {kind} holds 3-D weights ({', '.join(stacked)}) in no layout hqtflow measures"
    return None


def other_experts(mod: nn.Module) -> list[str]:
    """The 3-D weights of an experts module of a layout other than Mixtral's fused one (Nemotron-H's, JetMoE's),
    which hqtflow neither measures nor quantizes; [] for any other module."""
    if "Expert" not in type(mod).__name__ or is_fused_experts(mod):
        return []
    return [n for n, p in mod.named_parameters(recurse=False) if p.dim() == 3]


@dataclass
class _Node:
    name: str
    type_name: str
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    params: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def to_stats(self) -> NodeStats:
        return NodeStats(
            inputs=[o.state.cpu().numpy().astype(np.float32) for o in self.inputs if o.used],
            outputs=[o.state.cpu().numpy().astype(np.float32) for o in self.outputs if o.used],
            params={k: v.cpu().numpy().astype(np.float32) for k, v in self.params.items()},
        )

    @property
    def used(self) -> bool:
        return any(o.used for o in self.inputs + self.outputs)


class ObserverSession:
    """Observers on one model. Use `with session.batch(attention_mask): model(...)` for each forward."""

    def __init__(self, model: nn.Module, config: QuantConfig):
        self.config = config
        self.nodes: dict[str, _Node] = {}
        self.skipped: dict[str, str] = {}
        self._mask: torch.Tensor | None = None
        self._lengths: list[int] | None = None  # valid prefix per row when the padding is on the right
        self._handles = []
        self.samples = 0
        self.tokens = 0
        for name, mod in model.named_modules():
            why = unsupported(mod)
            experts_like = is_fused_experts(mod) or bool(other_experts(mod))
            if why and experts_like and not config.selects(name, type(mod).__name__):
                self.skipped[name] = "excluded by allowlist/blocklist"  # kept in high precision, never observed
                continue
            if why:
                hint = (f' Keep them in high precision with a QUANT_CONFIG (-c) blocklist: {{"blocklist": {{"types": '
                        f'["{type(mod).__name__}"]}}}}.' if experts_like else "")
                raise ModelError(f"hqtflow cannot measure {type(model).__name__}: {why} ({name}). It measures and quantizes "
                                 f"nn.Linear layers and Mixtral-style fused experts.{hint}")
            if isinstance(mod, nn.Linear):
                self._attach_linear(name, mod)
            elif is_fused_experts(mod):
                self._attach_experts(name, mod)

    # ---- attaching ------------------------------------------------------------------------------
    def _new_node(self, name: str, type_name: str, weight: torch.Tensor, device) -> _Node:
        cfg = self.config
        node = _Node(name, type_name)
        if cfg.measures_inputs:
            node.inputs.append(make_observer(cfg.per_channel, dim=-1, device=device))
        if cfg.measures_outputs:
            node.outputs.append(make_observer(cfg.per_channel, dim=-1, device=device))
        if cfg.measures_params:
            node.params["weight"] = weight_stat(weight, cfg.per_channel)
        self.nodes[name] = node
        return node

    def _attach_linear(self, name: str, mod: nn.Linear) -> None:
        type_name = type(mod).__name__
        if not self.config.selects(name, type_name):
            self.skipped[name] = "excluded by allowlist/blocklist"
            return
        local_w = _local(mod.weight)
        node = self._new_node(name, type_name, local_w, local_w.device)
        style, parts = parallel_style(mod.weight)
        node.info = {
            "style": style,
            "packed_parts": parts,
            "weight_shape": list(local_w.shape),
            "global_weight_shape": list(mod.weight.shape),
        }
        self._handles.append(mod.register_forward_hook(self._linear_hook(node)))

    def _linear_hook(self, node: _Node):
        def hook(mod, args, output):
            x = args[0]
            mask, lengths = self._mask, self._lengths
            for obs in node.inputs:
                obs.update(_local(x), mask, lengths)
            for obs in node.outputs:
                obs.update(_local(output), mask, lengths)
            if "input_dim" not in node.info:
                node.info["input_dim"] = int(x.shape[-1])
                node.info["output_dim"] = int(output.shape[-1])

        return hook

    def _attach_experts(self, name: str, mod: nn.Module) -> None:
        container = type(mod).__name__
        if container in self.config.blocklist.types:
            self.skipped[name] = "excluded by blocklist types"
            return
        gu, down = _local(mod.gate_up_proj), _local(mod.down_proj)
        experts = []
        for e in range(gu.shape[0]):
            pair = {}
            for proj, w in (("gate_up_proj", gu[e]), ("down_proj", down[e])):
                node_name = f"{name}.{e}.{proj}"
                if not self.config.selects(node_name, "Linear"):
                    self.skipped[node_name] = "excluded by allowlist/blocklist"
                    continue
                node = self._new_node(node_name, container, w, w.device)
                style, parts, whole = expert_style(mod, proj)
                node.info = {"style": style, "packed_parts": parts, "weight_shape": list(w.shape),
                             "global_weight_shape": whole, "expert": e}
                pair[proj] = node
            experts.append(pair)
        if any(experts):
            self._handles.append(mod.register_forward_pre_hook(self._experts_hook(mod, experts)))

    def _experts_hook(self, mod: nn.Module, experts: list[dict]):
        @torch.no_grad()
        def hook(m, args):
            mask = self._mask
            valid = mask.reshape(-1) if mask is not None and mask.numel() == args[0].shape[0] else None
            wanted = [e for e, pair in enumerate(experts) if pair]
            for e, x, h, inner, down_w in expert_inputs(m, args[0], args[1], valid, wanted):
                pair = experts[e]
                for proj, xin, y in (("gate_up_proj", x, h), ("down_proj", inner, None)):
                    node = pair.get(proj)
                    if node is None:
                        continue
                    for obs in node.inputs:
                        obs.update(xin)
                    for obs in node.outputs:
                        obs.update(y if y is not None else nn.functional.linear(inner, down_w))

        return hook

    # ---- running --------------------------------------------------------------------------------
    @contextmanager
    def batch(self, attention_mask: torch.Tensor | None) -> Iterator[None]:
        """Observe one forward; positions where attention_mask is 0 (padding) are not observed."""
        if attention_mask is not None:
            mask = attention_mask.bool()
            n = int(mask.sum())
            self.count(mask.shape[0], n)
            self._mask = None if n == mask.numel() else mask
            if self._mask is not None:
                lengths = mask.sum(dim=1)
                prefix = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
                self._lengths = lengths.tolist() if torch.equal(prefix, mask) else None
        try:
            yield
        finally:
            self._mask = self._lengths = None

    def count(self, samples: int, tokens: int) -> None:
        """Count sequences and the tokens of theirs that went through the model (`batch` does so from its mask; a
        generation, observed with no mask, says what it ran)."""
        self.samples += samples
        self.tokens += tokens

    def stats(self) -> dict[str, NodeStats]:
        """Statistics of every node that saw data (INC drops unused nodes the same way)."""
        return {name: node.to_stats() for name, node in self.nodes.items() if node.used or not node.inputs}

    def unused(self) -> list[str]:
        return [name for name, node in self.nodes.items() if node.inputs and not node.used]

    def layer_info(self) -> dict[str, dict]:
        return {name: {"type": node.type_name, **node.info} for name, node in self.nodes.items()}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
