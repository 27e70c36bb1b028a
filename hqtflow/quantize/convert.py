"""Swapping Linear modules for FP8Linear (the checkpoint on disk: `hqtflow.formats.checkpoint`)."""

from __future__ import annotations

import torch
from torch import nn

from hqtflow.formats.measurement import Measurement
from hqtflow.quantize.fp8_linear import FP8Linear
from hqtflow.scales import ScaleMethod, linear_scales


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def convert_model(model: nn.Module, names: list[str], meas: Measurement, method: ScaleMethod, *,
                  target: str, fp8: str, hp_dtype: str, weight_only: bool = False,
                  round_weight=None, progress=None) -> dict[str, dict]:
    """Replace each named Linear by an FP8Linear with scales from `meas`; return the scales used.
    `round_weight(name, weight, weight_scale)`: the weight moved onto its FP8 grid (GPTQ); None: round to nearest.
    `progress`: a `hqtflow.progress.Progress` advanced by each layer converted.

    `method` is one ScaleMethod or per-module rules (`hqtflow.scales.ScaleRules`: (name, type name) -> ScaleMethod). A dynamic method's
    activations are quantized at run time (its measured input statistics are not used)."""
    from hqtflow.progress import Progress

    used = {}
    _untie_if_needed(model, names)
    progress = progress or Progress(False)
    progress.start("quantize", len(names), "layer")
    for name in names:
        lin = model.get_submodule(name)
        m = method(name, type(lin).__name__) if callable(method) else method
        stats = None if m.dynamic or weight_only else meas.nodes[name].inputs[0]
        sc = linear_scales(m, stats, lin.weight, target=target, fp8=fp8, hp_dtype=hp_dtype, name=name)
        dynamic = None if weight_only or not m.dynamic else m.activation
        weight = round_weight(name, lin.weight, sc.weight) if round_weight else None
        _set_module(model, name, FP8Linear.from_linear(lin, sc.weight, None if weight_only else sc.input, fp8,
                                                       dynamic=dynamic, weight=weight, inc_codes=m.inc_codes))
        used[name] = {"input": None if sc.input is None else float(sc.input), "weight": sc.weight.float().flatten().tolist()}
        progress.advance(1)
    progress.close()
    return used


def kv_cache_scales(model: nn.Module, stats: dict, method: ScaleMethod, *, target: str, fp8: str,
                    hp_dtype: str) -> dict[str, torch.Tensor]:
    """{"<attention>.k_scale": s, "<attention>.v_scale": s} (0-d float32, where they are stored, floored there) from
    measured KV maxabs, with the scale method's activation rule (backoff, power-of-two or hardware rounding), and
    registered as buffers on `model`; a scale over `MAX_SCALE` is refused."""
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.scale_files import MAX_SCALE
    from hqtflow.models import attention_modules
    from hqtflow.scales import activation_scale, floored

    out = {}
    for name, kv in stats.items():
        try:
            attn = model.get_submodule(name)
        except AttributeError:
            raise ArtifactError(f"The KV-cache statistics name {name}, which this model does not have.") from None
        for x in "kv":
            s = floored(activation_scale(kv[x], method.activation, target=target, fp8=fp8, hp_dtype=hp_dtype).float().reshape(()))
            if not float(s) <= MAX_SCALE:  # inf and NaN fail too
                raise ArtifactError(f"The KV-cache statistic {name}.{x} ({kv[x]}) gives no usable {hp_dtype} scale "
                                    f"({float(s):.3g}; a reader takes at most {MAX_SCALE:.3g}); the statistics are corrupt.")
            attn.register_buffer(f"{x}_scale", s.to(next(model.parameters()).device))
            out[f"{name}.{x}_scale"] = s
    missing = sorted(set(attention_modules(model).values()) - set(stats))
    if missing:
        raise ArtifactError(f"The KV-cache statistics lack {len(missing)} attention module(s) of this model "
                            f"({', '.join(missing[:3])}); measure again to use --kv-cache fp8.")
    return out


def _untie_if_needed(model: nn.Module, names: list[str]) -> None:
    """A quantized lm_head cannot share its weight with the (high-precision) embedding."""
    out = model.get_output_embeddings()
    if out is None or not getattr(model.config, "tie_word_embeddings", False):
        return
    lm_name = next((n for n, m in model.named_modules() if m is out), None)
    if lm_name in names:
        out.weight = nn.Parameter(out.weight.detach().clone())
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = None
