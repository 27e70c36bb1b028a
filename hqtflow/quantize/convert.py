"""Swapping Linear modules for FP8Linear, and the FP8 checkpoint on disk (write and load)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from hqtflow.formats.measurement import Measurement
from hqtflow.quantize.fp8_linear import FP8Linear
from hqtflow.scales import ScaleMethod, linear_scales


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def convert_model(model: nn.Module, names: list[str], meas: Measurement, method: ScaleMethod, *,
                  target: str, fp8: str, hp_dtype: str, weight_only: bool = False) -> dict[str, dict]:
    """Replace each named Linear by an FP8Linear with scales from `meas`; return the scales used.

    `method` is one ScaleMethod or per-module rules (`hqtflow.scales.ScaleRules`: (name, type name) -> ScaleMethod). A dynamic method's
    activations are quantized at run time (its measured input statistics are not used)."""
    used = {}
    _untie_if_needed(model, names)
    for name in names:
        lin = model.get_submodule(name)
        m = method(name, type(lin).__name__) if callable(method) else method
        stats = None if m.dynamic else meas.nodes[name].inputs[0]
        sc = linear_scales(m, stats, lin.weight, target=target, fp8=fp8, hp_dtype=hp_dtype)
        dynamic = None if weight_only or not m.dynamic else m.activation
        _set_module(model, name, FP8Linear.from_linear(lin, sc.weight, None if weight_only else sc.input, fp8,
                                                       dynamic=dynamic))
        used[name] = {"input": None if sc.input is None else float(sc.input), "weight": sc.weight.float().flatten().tolist()}
    return used


def kv_cache_scales(model: nn.Module, stats: dict, method: ScaleMethod, *, target: str, fp8: str,
                    hp_dtype: str) -> dict[str, torch.Tensor]:
    """{"<attention>.k_scale": s, "<attention>.v_scale": s} (0-d float32) from measured KV maxabs, with the scale
    method's activation rule (backoff, power-of-two or hardware rounding), and registered as buffers on `model`."""
    from hqtflow.errors import ArtifactError
    from hqtflow.scales import activation_scale

    out = {}
    for name, kv in stats.items():
        try:
            attn = model.get_submodule(name)
        except AttributeError:
            raise ArtifactError(f"The KV-cache statistics name {name}, which this model does not have.") from None
        for x in "kv":
            s = activation_scale(kv[x], method.activation, target=target, fp8=fp8, hp_dtype=hp_dtype).float().reshape(())
            attn.register_buffer(f"{x}_scale", s.to(next(model.parameters()).device))
            out[f"{name}.{x}_scale"] = s
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


def save_checkpoint(model: nn.Module, out: Path, *, ignore: list[str], per_channel: bool, static_input: bool,
                    kv_cache: bool = False, dynamic: ScaleMethod | None = None) -> None:
    """compressed-tensors FP8 safetensors + config.json with its quantization_config.

    `dynamic`: the dynamic method the FP8Linears run (`dynamic: true`, strategy token or tensor; an INC method's
    rule is recorded under INC_DYNAMIC_KEY)."""
    from safetensors.torch import save_file

    from hqtflow.formats.compressed_tensors import quantization_config

    out = Path(out)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if per_channel:  # per-layer methods: a per-tensor weight scale written per channel is the same function
        for name, mod in model.named_modules():
            if isinstance(mod, FP8Linear) and mod.weight_scale.numel() == 1 and mod.out_features > 1:
                state[f"{name}.weight_scale"] = mod.weight_scale.detach().reshape(1, 1).expand(mod.out_features, 1).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        out_emb = model.get_output_embeddings()
        lm_name = next((n for n, m in model.named_modules() if m is out_emb), None)
        state.pop(f"{lm_name}.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    kind = rule = None
    if dynamic is not None:
        a = dynamic.activation
        kind = "token" if a.granularity == "PCS" else "tensor"
        if a.dynamic == "inc":
            rule = {"scale_method": dynamic.name, "backoff": a.backoff, "rounding": a.rounding}
    cfg["quantization_config"] = quantization_config(per_channel=per_channel, static_input=static_input and not kind,
                                                     ignore=ignore, kv_cache=kv_cache, dynamic=kind, inc_rule=rule)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)


DROPPED_SUFFIXES = (".output_scale", ".weight_zero_point", ".input_zero_point")
KV_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")
SCALE_SUFFIXES = (".weight_scale", ".input_scale") + KV_SUFFIXES


def check_scales(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every scale of a checkpoint must be positive and finite (a zero or NaN scale cannot be right)."""
    from hqtflow.errors import ArtifactError

    for k, v in tensors.items():
        if k.endswith(("_scale", ".scale", "_scale_inv")) and not bool((torch.isfinite(v.float()) & (v.float() > 0)).all()):
            raise ArtifactError(f"{path}: {k} holds a zero, negative or non-finite scale, which cannot be right.")


def load_checkpoint(path: Path, *, device: str = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model skeleton on the meta device, swap in FP8Linear where the checkpoint has FP8 weights, load.

    `dtype`: the high-precision compute dtype (None: the checkpoint's own, bf16 if it names none).

    Reads hqtflow's own checkpoints and foreign FP8 ones: compressed-tensors (static per-tensor, dynamic per-token,
    per-tensor or per-group activations; per-tensor, per-channel or block-wise weights) and AutoFP8/vLLM
    `quant_method: fp8` (scalar float32 scales, static or dynamic per-tensor activations, `weight_block_size`).
    KV-cache scales (`k_scale`/`v_scale`, or one `kv_scale` for both) become float32 buffers of their attention
    module (the static decoder's FP8 KV cache uses them); `output_scale` and all-zero zero points are dropped.
    Unsupported schemes are refused by parse_quantization_config.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from hqtflow.errors import ArtifactError
    from hqtflow.formats.compressed_tensors import parse_quantization_config
    from hqtflow.models import check_safetensors

    path = Path(path)
    from hqtflow.models import load_config

    raw = load_config(path)
    qc = parse_quantization_config(raw.get("quantization_config") or {})
    raw.pop("quantization_config", None)
    config = AutoConfig.for_model(**raw)
    hp = dtype or (config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.bfloat16)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # parameters on meta; computed buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, dtype=hp)
    files = sorted(path.glob("*.safetensors"))
    tensors = {}
    for f in files:
        check_safetensors(f)
        with safe_open(f, framework="pt", device=device) as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    dropped = []
    for k in list(tensors):
        if k.endswith(DROPPED_SUFFIXES):
            if k.endswith("_zero_point") and bool(tensors[k].float().abs().max() > 0):
                raise ArtifactError(f"{path}: {k} is non-zero; asymmetric FP8 quantization is not supported.")
            dropped.append(tensors.pop(k))
    check_scales(path, tensors)
    kv_scales = {k: tensors.pop(k) for k in list(tensors) if k.endswith(KV_SUFFIXES)}
    for name, mod in list(model.named_modules()):
        w = tensors.get(f"{name}.weight")
        if not isinstance(mod, nn.Linear) or w is None or w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            continue
        if f"{name}.weight_scale_inv" in tensors:  # DeepSeek / transformers FineGrainedFP8 name; a multiplier too
            tensors[f"{name}.weight_scale"] = tensors.pop(f"{name}.weight_scale_inv")
        if f"{name}.weight_scale" not in tensors:
            raise ArtifactError(f"{path}: the FP8 weight {name}.weight has no weight_scale.")
        fp8 = "E4M3" if w.dtype == torch.float8_e4m3fn else "E5M2"
        activation = qc["activation"]
        if activation == "static" and f"{name}.input_scale" not in tensors:
            raise ArtifactError(f"{path}: {name} has no input_scale although the config says static activations.")
        if activation != "static" and f"{name}.input_scale" in tensors:
            if qc["method"] == "fp8":  # AutoFP8 dynamic checkpoints sometimes carry unused input scales
                tensors.pop(f"{name}.input_scale")
            else:
                activation = "static"
        if activation == "dynamic_group" and mod.in_features % qc["group_size"]:
            raise ArtifactError(f"{path}: {name} has {mod.in_features} inputs, not a multiple of the activation group size {qc['group_size']}.")
        ws = tensors[f"{name}.weight_scale"]
        new = FP8Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, hp_dtype=hp, fp8=fp8,
                        per_channel=qc["strategy"] != "block" and ws.numel() > 1, activation=activation,
                        block_size=qc["block_size"], group_size=qc["group_size"], device="meta")
        if ws.numel() != new.weight_scale.numel():
            raise ArtifactError(f"{path}: {name}.weight_scale has shape {list(ws.shape)}, expected {list(new.weight_scale.shape)} "
                                f"for {qc['strategy']} weights.")
        tensors[f"{name}.weight_scale"] = ws.reshape(new.weight_scale.shape)
        if f"{name}.input_scale" in tensors:
            if tensors[f"{name}.input_scale"].numel() != 1:
                raise ArtifactError(f"{path}: {name}.input_scale has {tensors[f'{name}.input_scale'].numel()} values; "
                                    "static activation scales must be per tensor.")
            tensors[f"{name}.input_scale"] = tensors[f"{name}.input_scale"].reshape(1)
        if qc.get("inc_rule") and activation in ("dynamic_token", "dynamic_tensor"):
            from hqtflow.scales import Rule

            r = qc["inc_rule"]
            new.dynamic_rule = Rule("PCS" if activation == "dynamic_token" else "PTS", rounding=r["rounding"],
                                    backoff=r["backoff"], dynamic="inc")
        _set_module(model, name, new)
    for key, value in kv_scales.items():
        mod_name, _, leaf = key.rpartition(".")
        try:
            attn = model.get_submodule(mod_name)
        except AttributeError:
            raise ArtifactError(f"{path}: {key} belongs to no module of this model.") from None
        for leaf in (("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,)):
            attn.register_buffer(leaf, torch.empty((), dtype=torch.float32, device="meta"))
            tensors[f"{mod_name}.{leaf}"] = value.float().reshape(())
    for k, t in tensors.items():  # high-precision tensors in the compute dtype; FP8 weights and scales as stored
        if t.is_floating_point() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) and not k.endswith(SCALE_SUFFIXES):
            tensors[k] = t.to(hp)
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as e:  # a tensor whose shape disagrees with config.json (a foreign or edited checkpoint)
        detail = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln), str(e).splitlines()[0])
        raise ArtifactError(f"Checkpoint {path} does not match its config.json: {detail}") from None
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ArtifactError(f"Checkpoint {path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    model.hqtflow_quantization = {**qc, "dropped_tensors": len(dropped)}
    return model.eval()
