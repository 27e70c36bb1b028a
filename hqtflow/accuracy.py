"""Faithfulness of a quantized model to its bf16 original, on the next-token distribution.

For each evaluated position t, with P the bf16 model's softmax and Q the quantized model's (computed in float32
from each model's logits): KL(P || Q) = sum_v P_v (log P_v - log Q_v), and top-1 agreement = [argmax P == argmax Q].
`mean_kl` and `top1` average over every position of every window; `nll` is the quantized model's mean negative
log-likelihood of each window's actual next tokens (exp(nll) = its perplexity on the slice). The evaluation text is a fixed slice: the first
`n_tokens` tokens of a file, in consecutive windows of `window` tokens (each window a separate sequence).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Divergence:
    mean_kl: float
    top1: float
    tokens: int
    nll: float = float("nan")

    def as_dict(self) -> dict:
        return {"mean_kl": self.mean_kl, "top1": self.top1, "tokens": self.tokens, "nll": self.nll}


def token_windows(tokenizer, path: str | Path, n_tokens: int, window: int = 512,
                  what: str = "Text file") -> list[torch.Tensor]:
    """The first `n_tokens` tokens of the text file, as [1, window] id tensors (no special tokens); a file that is
    not UTF-8 text, or is empty, is refused as eval's --ppl-file is (`what` names it)."""
    from hqtflow.evaluate import read_ppl_text

    ids = tokenizer(read_ppl_text(path, what), add_special_tokens=False)["input_ids"][:n_tokens]
    return [torch.tensor([ids[i:i + window]]) for i in range(0, len(ids) - window + 1, window)]


@torch.inference_mode()
def log_probs(model, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each window's next-token log-probabilities [T, V] in float32 (keep them for several comparisons); a bf16
    reference's matmuls run as fp32 GEMMs where that is faster (`hqtflow.bf16_matmul`)."""
    from hqtflow.bf16_matmul import bf16_matmuls_via_fp32

    device = next(model.parameters()).device
    with bf16_matmuls_via_fp32():
        return [torch.log_softmax(model(input_ids=w.to(device), use_cache=False).logits[0].float(), -1).cpu() for w in windows]


@torch.inference_mode()
def divergence(reference: list[torch.Tensor], model, windows: list[torch.Tensor]) -> Divergence:
    """KL(reference || model) and top-1 agreement, averaged over every position (see the module doc)."""
    device = next(model.parameters()).device
    kl_sum, agree, n, nll, m = 0.0, 0, 0, 0.0, 0
    for ref, w in zip(reference, windows):
        q = torch.log_softmax(model(input_ids=w.to(device), use_cache=False).logits[0].float(), -1).cpu()
        kl_sum += float((ref.exp() * (ref - q)).sum(-1).clamp(min=0).sum())  # >= 0 up to float rounding
        agree += int((ref.argmax(-1) == q.argmax(-1)).sum())
        n += ref.shape[0]
        nll -= float(q[:-1].gather(-1, w[0, 1:, None]).sum())
        m += ref.shape[0] - 1
    return Divergence(kl_sum / n, agree / n, n, nll / max(m, 1))
