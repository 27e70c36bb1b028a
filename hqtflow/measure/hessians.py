"""`measure --hessians`: each Linear input's second moment E[x xᵀ] over the calibration tokens, for GPTQ.

Linears fed the same tensor in a forward (q/k/v, gate/up) share one matrix, accumulated once: the first of them
to see an input owns the matrix and the others point at it. Fused MoE experts get one matrix per expert and
projection (`<experts>.<e>.gate_up_proj`, `.down_proj`), from the tokens routed to that expert. Padding positions are left out, as the observers do.
The cost is one [in, in] float32 matrix per distinct input and a `xᵀx` product per forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from hqtflow.measure.hooks import expert_inputs, is_fused_experts


class HessianRecorder:
    """Forward hooks on the named Linears. Use `with recorder.batch(attention_mask): model(...)`."""

    def __init__(self, model: nn.Module, names: list[str]):
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self.owner: dict[str, str] = {}  # Linear -> the Linear whose matrix it shares (itself when it owns one)
        self._last: tuple[torch.Tensor, str] | None = None  # the latest input accumulated, and its owner
        self._mask: torch.Tensor | None = None
        wanted = set(names)
        self._handles = [mod.register_forward_hook(self._hook(n)) for n, mod in model.named_modules()
                         if n in wanted and isinstance(mod, nn.Linear)]
        for n, mod in model.named_modules():  # fused MoE experts: one matrix per expert and projection
            if is_fused_experts(mod):
                names_of = {e: (f"{n}.{e}.gate_up_proj", f"{n}.{e}.down_proj") for e in range(mod.gate_up_proj.shape[0])}
                names_of = {e: p for e, p in names_of.items() if wanted & set(p)}
                if names_of:
                    self._handles.append(mod.register_forward_pre_hook(self._experts_hook(names_of, wanted)))

    def _add(self, name: str, rows: torch.Tensor) -> None:
        rows = rows.float()
        if name not in self.sums:
            self.sums[name] = torch.zeros(rows.shape[1], rows.shape[1], device=rows.device)
            self.tokens[name] = 0
        self.sums[name].addmm_(rows.t(), rows)
        self.tokens[name] += rows.shape[0]

    def _experts_hook(self, names_of: dict[int, tuple[str, str]], wanted: set[str]):
        @torch.no_grad()
        def hook(mod, args):
            hidden, mask = args[0], self._mask
            valid = mask.reshape(-1).to(hidden.device) if mask is not None and mask.numel() == hidden.shape[0] else None
            for e, x, _, inner, _ in expert_inputs(mod, hidden, args[1], valid, list(names_of)):
                for name, rows in zip(names_of[e], (x, inner)):
                    if name in wanted:
                        self._add(name, rows)
                        self.owner[name] = name

        return hook

    def _hook(self, name: str):
        def hook(mod, args, output):
            x = args[0]
            if self._last is not None and self._last[0] is x:  # a sibling already accumulated this very input
                owner = self._last[1]
            else:
                owner = name
                rows = x.reshape(-1, x.shape[-1])
                if self._mask is not None and self._mask.numel() == rows.shape[0]:
                    rows = rows[self._mask.reshape(-1).to(rows.device)]
                self._add(name, rows)
                self._last = (x, name)
            if self.owner.setdefault(name, owner) != owner:
                raise RuntimeError(f"{name} shared its input with {self.owner[name]} in one forward and with {owner} "
                                   "in another; its Hessian cannot be recorded.")

        return hook

    @contextmanager
    def batch(self, attention_mask: torch.Tensor | None) -> Iterator[None]:
        """Accumulate one forward; positions where attention_mask is 0 (padding) are left out."""
        self._mask = None if attention_mask is None else attention_mask.bool()
        try:
            yield
        finally:
            self._mask = self._last = None

    def matrices(self) -> dict[str, torch.Tensor]:
        """{owner: mean x xᵀ} for every input seen (exactly symmetric)."""
        return {k: ((v + v.t()) / (2 * max(1, self.tokens[k]))).cpu() for k, v in self.sums.items()}

    def non_finite(self) -> str | None:
        """The first Linear whose inputs were NaN or inf, None when every matrix is finite."""
        return next((k for k, v in self.sums.items() if not bool(torch.isfinite(v).all())), None)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
