"""Per-request RoPE frequencies for the rope types whose frequencies depend on the sequence's length.

transformers' `dynamic_rope_update` picks the frequencies of "dynamic" (NTK) and "longrope" (Phi-3) rotary
embeddings from max(position_ids) + 1 over the whole forward (and dynamic NTK keeps what it grew to). The engine's
step is one flattened row of every scheduled sequence's tokens, so a request would take its neighbours' length, and
a chunked prompt a different length per chunk. `install` makes such a rotary embedding compute, statelessly, each
token's frequencies from its own request's length: a prompt token that of the whole prompt (transformers' generate
prefills it in one forward), a later token at position p that of p + 1 (a decode step). Without a step plan (a plain
`model.generate`, measure) the module is transformers' own; other rope types are not touched.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def length_dependent(module) -> bool:
    """Whether `module` is a rotary embedding whose frequencies depend on the sequence's length."""
    kinds = getattr(module, "rope_type", None)
    kinds = kinds.values() if isinstance(kinds, dict) else [kinds]
    return any(isinstance(k, str) and ("dynamic" in k or k == "longrope") for k in kinds)


def install(model) -> bool:
    """Give each length-dependent rotary embedding of `model` per-request frequencies; whether it has any."""
    found = False
    for module in model.modules():
        if length_dependent(module) and not isinstance(module.forward, functools.partial):
            frequencies = functools.lru_cache(maxsize=512)(functools.partial(_frequencies, module.config))
            module.forward = functools.partial(_per_length_forward, module, inspect.unwrap(type(module).forward),
                                               frequencies)
            found = True
    return found


def _per_length_forward(module, plain, frequencies, x, position_ids, layer_type=None):
    """The rotary embedding's (cos, sin) with every token's frequencies taken from its request's length (the step
    plan's `token_lengths`); transformers' own forward when no step plan is running."""
    from hqtflow.runtime.paged import current_step

    plan = current_step()
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if plan is None:
        return type(module).forward(module, x, position_ids, **kwargs)
    lengths = plan.token_lengths()
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(i)
    parts = []
    for length, rows in groups.items():
        index = torch.tensor(rows, device=position_ids.device)
        ids = position_ids if len(groups) == 1 else position_ids[:, index]
        parts.append((index, _with_frequencies(module, plain, frequencies, x, ids, length, layer_type)))
    if len(parts) == 1:
        return parts[0][1]
    cos, sin = (torch.empty((*position_ids.shape, parts[0][1][0].shape[-1]), dtype=parts[0][1][0].dtype,
                            device=parts[0][1][0].device) for _ in range(2))
    for index, (c, s) in parts:
        cos.index_copy_(1, index, c)
        sin.index_copy_(1, index, s)
    return cos, sin


def _with_frequencies(module, plain, frequencies, x, position_ids, length: int, layer_type):
    """`plain` (the undecorated forward) run with the frequencies and attention scaling of a `length`-token
    sequence, as transformers computes them for that length (`rope_init_fn(config, seq_len=length)`)."""
    prefix = "" if layer_type is None else f"{layer_type}_"
    kind = module.rope_type if layer_type is None else module.rope_type[layer_type]
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = frequencies(kind, layer_type, length, x.device)
    saved = getattr(module, f"{prefix}inv_freq"), getattr(module, f"{prefix}attention_scaling")
    setattr(module, f"{prefix}inv_freq", inv_freq)
    setattr(module, f"{prefix}attention_scaling", scaling)
    try:
        return plain(module, x, position_ids, **kwargs)
    finally:
        setattr(module, f"{prefix}inv_freq", saved[0])
        setattr(module, f"{prefix}attention_scaling", saved[1])


def _frequencies(config, kind: str, layer_type, length: int, device) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) of a `length`-token sequence; the length a tensor, as transformers passes it
    (dynamic NTK computes its base in that tensor's float32). `install` caches it per module."""
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    seq_len = torch.tensor(length, device=device)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, device, seq_len=seq_len, **kwargs)
    return inv_freq.to(device), scaling
