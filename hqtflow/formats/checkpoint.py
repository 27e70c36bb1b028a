"""The FP8 checkpoint on disk (`quantize`, `export`): safetensors files + config.json, written and read here.

Its tensors are compressed-tensors FP8 (what config.json's `quantization_config` says: `compressed_tensors.py`).
- Writing: `SafetensorsWriter`, the checkpoints' safetensors writer (formats/hessians.py writes its own file): the
  header is computed up front from every tensor's `TensorSpec` (largest items first, so every tensor is aligned),
  then each tensor is written to its offset, in any order and in row blocks, so memory does not grow with the file
  (`--disk-offload` streams its shards through it); `write_safetensors` writes tensors held in memory.
  `save_checkpoint` writes a converted model (`--disk-offload`'s shards are named and indexed in safetensors_files.py);
  `copy_side_files` copies the model's tokenizer and generation config files. `check_free_disk`: both writers'
  refusal, before any tensor is written, of a disk with less free space than the checkpoint takes
  (`checkpoint_bytes`, exact but for the small files).
- Other runtimes' layouts (`hqtflow export`): `autofp8_tensors` (AutoFP8 / vLLM `fp8`), `inc_tensors` (Neural
  Compressor's huggingface QDQ layout), `requantize` between per-tensor and per-channel weight scales; `load_checkpoint`
  reads the `fp8` layout back.
- Reading: `TensorFiles`, the reader of a model's or checkpoint's weight files (formats/hessians.py reads its own
  file): a folder's safetensors files (listed and checked by safetensors_files.py), from their headers, read one
  tensor at a time, memory-mapped; `read_tensors` reads them all; `load_checkpoint` builds the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from hqtflow import errors
from hqtflow.errors import ArtifactError, ModelError
from hqtflow.formats.safetensors_files import check_safetensors, safetensors_header, weight_files
from hqtflow.formats.scale_files import MAX_SCALE  # larger: scale x FP8 value overflows float32
from hqtflow.hardware import byte_size
from hqtflow.scales import FP8_DTYPES, HP_DTYPES, ScaleMethod, full_scale

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}  # safetensors' names
HP_DTYPE_NAMES = {dtype: name for name, dtype in HP_DTYPES.items()}  # torch.bfloat16 -> "bf16"
FP8_WEIGHT_DTYPES = tuple(FP8_DTYPES.values())

KV_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")  # KV-cache scales of an attention module (kv_scale: both)
SCALE_SUFFIXES = (".weight_scale", ".input_scale") + KV_SUFFIXES
DROPPED_SUFFIXES = (".output_scale", ".weight_zero_point", ".input_zero_point")


# ---- writing -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    key: str
    dtype: torch.dtype
    shape: list[int]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _layout(specs: list[TensorSpec]) -> tuple[bytes, dict[str, int]]:
    """The safetensors header (largest items first so every tensor is aligned) and each tensor's data offset."""
    order = sorted(specs, key=lambda t: (-t.dtype.itemsize, t.key))
    header, offsets, pos = {"__metadata__": {"format": "pt"}}, {}, 0
    for t in order:
        header[t.key] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        offsets[t.key] = pos
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


class SafetensorsWriter:
    """One safetensors file: `write(key, tensor)` or `write_blocks(key, row blocks)` each tensor of `specs`."""

    CHUNK = 64 * 2**20  # bytes handed to the file per write

    def __init__(self, path: Path, specs: list[TensorSpec]):
        bad = next((t for t in specs if t.dtype not in ST_DTYPES), None)
        if bad is not None:
            raise ArtifactError(f"{bad.key} has dtype {bad.dtype}, which safetensors cannot store.")
        head, self.offsets = _layout(specs)
        self.base, self.size = len(head), sum(t.nbytes for t in specs)
        self.file = open(path, "wb")
        self.file.write(head)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        self.write_blocks(key, [tensor])

    def write_blocks(self, key: str, blocks: Iterable[torch.Tensor]) -> None:
        self.file.seek(self.base + self.offsets[key])
        for t in blocks:
            buf = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
            for i in range(0, len(buf), self.CHUNK):
                self.file.write(buf[i:i + self.CHUNK])

    def close(self) -> None:
        self.file.truncate(self.base + self.size)
        self.file.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with SafetensorsWriter(path, [TensorSpec(k, t.dtype, list(t.shape)) for k, t in tensors.items()]) as w:
        for k, t in tensors.items():
            w.write(k, t)


def write_config(out: Path, config, quantization_config: dict, generation_config=None) -> None:
    """config.json (the model's transformers config with its `quantization_config`) and the generation config.
    transformers' `_name_or_path` (the folder the config was read from: a user's home path) is left out, as
    save_pretrained leaves it out."""
    cfg = _without_name_or_path(config.to_dict())
    cfg["quantization_config"] = quantization_config
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    if generation_config is not None:
        generation_config.save_pretrained(out)


def _without_name_or_path(cfg: dict) -> dict:
    """`cfg` and its nested configs (text_config, ...) without `_name_or_path`."""
    return {k: _without_name_or_path(v) if isinstance(v, dict) else v for k, v in cfg.items() if k != "_name_or_path"}


def copy_side_files(model_dir: Path, out: Path) -> None:
    """The model's tokenizer, chat template and generation config files (models.side_files), copied as they are:
    the checkpoint's tokenizer is its source's, byte for byte (after write_config: the source's generation config
    replaces the one transformers derived)."""
    import shutil

    from hqtflow.models import side_files

    model_dir = Path(model_dir)
    for f in side_files(model_dir):
        dst = Path(out) / f.relative_to(model_dir)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dst)


def safetensors_bytes(specs: list[TensorSpec]) -> int:
    """The size of the safetensors file `SafetensorsWriter` writes for `specs`: its header and the tensors' bytes."""
    return len(_layout(specs)[0]) + sum(t.nbytes for t in specs)


# the index, manifest and config.json's quantization_config hqtflow adds (a 70B model's index: ~100 KB) and the
# file system's rounding of the ~20 files to its blocks
SMALL_FILES_BYTES = 2**20


def checkpoint_bytes(files: list[list[TensorSpec]], model_dir: Path) -> tuple[int, str]:
    """The disk space a checkpoint of safetensors `files` (each file's tensors) made from `model_dir` takes, and what
    it is made of: the safetensors files exactly, the carried files as large as in `model_dir`, SMALL_FILES_BYTES."""
    tensors = sum(safetensors_bytes(f) for f in files)
    from hqtflow.models import side_files

    carried = sum(f.stat().st_size for f in [Path(model_dir) / "config.json", *side_files(model_dir)] if f.is_file())
    how = (f"{byte_size(tensors)} of safetensors files, {byte_size(carried)} of tokenizer and config files and "
           f"{byte_size(SMALL_FILES_BYTES)} for the index and manifest")
    return tensors + carried + SMALL_FILES_BYTES, how


def check_free_disk(out: Path, files: list[list[TensorSpec]], model_dir: Path) -> None:
    """Refuse (ResourceError, one sentence) when the file system of `out` (a folder to be written, or being written)
    has less free space than the checkpoint takes (`checkpoint_bytes`)."""
    from hqtflow import hardware

    need, how = checkpoint_bytes(files, model_dir)
    parent = Path(out).resolve().parent
    free = hardware.free_disk_bytes(parent)
    if free < need:
        raise errors.ResourceError(f"Not enough free disk space in {parent} for the FP8 checkpoint: {byte_size(need)} is "
                                   f"needed ({how}) and {byte_size(free)} is free.")


def save_checkpoint(model: nn.Module, out: Path, *, ignore: list[str], per_channel: bool, static_input: bool,
                    kv_cache: bool = False, dynamic: ScaleMethod | None = None, carried_from: Path | None = None) -> None:
    """compressed-tensors FP8 safetensors + config.json with its quantization_config.

    `dynamic`: the dynamic method the FP8Linears run (`dynamic: true`, strategy token or tensor; an INC method's
    rule is recorded under INC_DYNAMIC_KEY). `carried_from`: the model folder whose side files the caller copies next (copy_side_files);
    the free disk is checked for the whole checkpoint before any tensor is written (`check_free_disk`)."""
    from hqtflow.formats.compressed_tensors import quantization_config
    from hqtflow.formats.hf_names import disk_module_names, to_disk_names
    from hqtflow.quantize.experts import Experts
    from hqtflow.quantize.fp8_linear import FP8Linear

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
    experts = [n for n, m in model.named_modules() if isinstance(m, Experts)]
    if experts:  # MoE experts one Linear pair each: under the checkpoint's own names (gate and up apart)
        state = to_disk_names(model, state, experts)
        ignore = disk_module_names(model, ignore, experts)
    if carried_from is not None:
        check_free_disk(out, [[TensorSpec(k, t.dtype, list(t.shape)) for k, t in state.items()]], carried_from)
    write_safetensors(out / "model.safetensors", state)
    kind = rule = None
    if dynamic is not None:
        a = dynamic.activation
        kind = "token" if a.granularity == "PCS" else "tensor"
        if a.dynamic == "inc":
            rule = {"scale_method": dynamic.name, "backoff": a.backoff, "rounding": a.rounding}
    qc = quantization_config(per_channel=per_channel, static_input=static_input and not kind, ignore=ignore,
                             kv_cache=kv_cache, dynamic=kind, inc_rule=rule)
    write_config(out, model.config, qc, getattr(model, "generation_config", None))


# ---- other runtimes' layouts (`hqtflow export`; their configs: compressed_tensors.py) ----------------------
def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 dequantization, exact (4-bit x 8-bit mantissas fit in float32)."""
    return q.float() * scale.float().reshape(-1, 1) if scale.numel() > 1 else q.float() * scale.float().reshape(())


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """amax / 448 in `dtype`, rounded up (never below the float32 value, so x / s never exceeds 448), at least the
    smallest normal number of `dtype` (an all-zero tensor gets that floor, as in `hqtflow.scales`)."""
    s32 = torch.clamp(amax.float() / full_scale("E4M3"), min=torch.finfo(dtype).tiny)
    s = s32.to(dtype)
    low = s.float() < s32
    if low.any():
        s = torch.where(low, (s.float() * (1 + 2.0 ** -7)).to(dtype), s)
    return s


def requantize(q: torch.Tensor, scale: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize an FP8 weight to per-channel ([out, 1]) or per-tensor ([1]) scales from its dequantized values."""
    w = _dequant(q, scale)
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    s = scale_for(amax, scale.dtype)
    return (w / s.float()).clamp(-full_scale("E4M3"), full_scale("E4M3")).to(torch.float8_e4m3fn), s


def autofp8_tensors(tensors: dict[str, torch.Tensor], linears: list[str], *, static: bool) -> dict[str, torch.Tensor]:
    """The AutoFP8 / vLLM `fp8` layout from hqtflow's tensors: scalar float32 `weight_scale` / `input_scale` (a
    per-channel weight re-quantized to one scale per tensor), float32 scalar KV scales."""
    owned = {f"{n}.{s}" for n in linears for s in ("weight", "weight_scale", "input_scale")}
    out = {k: (v.float().reshape(()) if k.endswith(KV_SUFFIXES) else v) for k, v in tensors.items() if k not in owned}
    for n in linears:
        q, s = tensors[f"{n}.weight"], tensors[f"{n}.weight_scale"]
        if s.numel() > 1:
            q, s = requantize(q, s, per_channel=False)
        out[f"{n}.weight"] = q
        out[f"{n}.weight_scale"] = s.float().reshape(())
        if static:
            out[f"{n}.input_scale"] = tensors[f"{n}.input_scale"].float().reshape(())
    return out


def inc_tensors(tensors: dict[str, torch.Tensor], linears: list[str]) -> tuple[dict[str, torch.Tensor], bool]:
    """INC QDQ state dict from hqtflow's tensors; returns it and whether weights were re-quantized per tensor."""
    owned = {f"{n}.{s}" for n in linears for s in ("weight", "weight_scale", "input_scale")}
    out = {k: v for k, v in tensors.items() if k not in owned and not k.endswith(KV_SUFFIXES)}
    requantized = False
    for n in linears:
        q, s, si = tensors[f"{n}.weight"], tensors[f"{n}.weight_scale"], tensors[f"{n}.input_scale"]
        if s.numel() > 1:
            q, s = requantize(q, s, per_channel=False)
            requantized = True
        hp = s.dtype
        out[f"{n}.weight"] = q.t().contiguous()
        out[f"{n}.dequant_weights.scale"] = s.reshape(())
        inv = torch.reciprocal(si.to(hp)).reshape(())  # INC's QuantDequant: scale_inv, and its inverse as `scale`
        out[f"{n}.quant_input.scale"] = torch.reciprocal(inv)  # (not si itself: 1 / hp(1 / s) where s is no power of 2)
        out[f"{n}.quant_input.scale_inv"] = inv
    return out, requantized


# ---- reading -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header lists it."""

    file: Path
    key: str
    dtype: str  # safetensors' name (ST_DTYPES)
    shape: list[int]
    nbytes: int


class TensorFiles:
    """The tensors of a folder's safetensors files (`safetensors_files.weight_files`: those transformers loads):
    `entries` from the headers (each file checked first, no tensor read), `get(key)` one tensor, memory-mapped (its
    pages are file pages, reclaimable, not anonymous memory). `error`: the kind of a damaged file's refusal."""

    def __init__(self, directory: Path, *, device: str = "cpu", error: type[Exception] = ArtifactError):
        self.directory, self.device = Path(directory), device
        self.files = weight_files(self.directory, error)
        self.entries: dict[str, TensorEntry] = {}
        for f in self.files:
            check_safetensors(f, error)
            for k, info in safetensors_header(f)[1].items():
                if k in self.entries:
                    raise error(f"{self.directory}: {k} is in both {self.entries[k].file.name} and {f.name}.")
                if k != "__metadata__":
                    b, e = info["data_offsets"]
                    self.entries[k] = TensorEntry(f, k, info["dtype"], list(info["shape"]), e - b)
        self._handles: dict[Path, object] = {}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.entries[key].file
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt", device=self.device).__enter__()
        return self._handles[f].get_tensor(key)

    def close(self) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> TensorFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_tensors(directory: Path, *, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (refused: no safetensors file, a corrupt or truncated one)."""
    with TensorFiles(directory, device=device) as tf:
        if not tf.files:
            raise ArtifactError(f"{directory} has no .safetensors files.")
        return {k: tf.get(k) for k in tf.entries}


SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_scales(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every scale of a checkpoint must be a float32, float16 or bfloat16 tensor, positive and finite (a zero or NaN
    scale cannot be right), and small enough that dequantizing with it stays finite in float32."""
    for k, v in tensors.items():
        if k.endswith(("_scale", ".scale", "_scale_inv")):
            if v.dtype not in SCALE_DTYPES:
                raise ArtifactError(f"{path}: {k} is a {str(v.dtype).removeprefix('torch.')} tensor; scales are "
                                    "float32, float16 or bfloat16.")
            v = v.float()
            if not bool((torch.isfinite(v) & (v > 0)).all()):
                raise ArtifactError(f"{path}: {k} holds a zero, negative or non-finite scale, which cannot be right.")
            if bool((v > MAX_SCALE).any()):
                raise ArtifactError(f"{path}: {k} holds a scale of {v.max().item():.3g}, over {MAX_SCALE:.3g}: "
                                    "dequantizing with it overflows float32, so it cannot be right.")


def skeleton_of(path: Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The model a checkpoint's config.json describes, its parameters on the meta device (computed buffers, rotary,
    real), in `dtype` (None: the config's own, bf16 if it names none)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from hqtflow.models import BUILD_ERRORS, bad_config, config_errors, load_config

    raw = load_config(path)
    raw.pop("quantization_config", None)
    entries = TensorFiles(path).entries  # the headers only: config.json's sizes are checked against them first
    _check_layer_count(path, raw.get("num_hidden_layers"), entries)
    try:
        config = AutoConfig.for_model(**raw)
        hp = dtype or (config.dtype if isinstance(getattr(config, "dtype", None), torch.dtype) else torch.bfloat16)
        if entries:
            _check_sizes(path, AutoModelForCausalLM, config, sum(_numel(e.shape) for e in entries.values()))
        # parameters on meta; computed buffers (rotary) real, from __init__; no random init of the meta parameters
        # (transformers' init_weights, a third of a small model's load, writes nothing a checkpoint does not replace)
        with init_empty_weights(include_buffers=False), no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=hp)
    except (*config_errors(), *BUILD_ERRORS) as e:
        raise bad_config(path, e) from None
    model.generation_config = generation_config_of(path, model.generation_config)
    return model


def generation_config_of(path: Path, default):
    """The checkpoint's generation_config.json (its EOS ids, as from_pretrained reads them), else `default` (the one
    config.json implies)."""
    from transformers import GenerationConfig

    from hqtflow.models import check_generation_config

    check_generation_config(path)
    if not (Path(path) / "generation_config.json").is_file():
        return default
    file = Path(path) / "generation_config.json"
    try:
        gc = GenerationConfig.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(f"Cannot read {file} ({type(e).__name__}: {str(e)[:200]}).") from None
    eos = gc.eos_token_id
    if eos is not None and not all(type(i) is int and i >= 0 for i in (eos if isinstance(eos, list) else [eos])):
        raise ModelError(f"{file}: eos_token_id must be a token id or a list of them, not {errors.brief(eos)}.")
    return gc


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_layer_count(path: Path, layers, entries: dict, what: str = "Checkpoint", error=ArtifactError) -> None:
    """Refuse a config.json naming more layers than the weights hold (or none), before a model of that many is built
    (10**9 layers would be built for minutes, memory growing, even on the meta device). A weight's layer is the first
    number in its name (model.layers.3.mlp...)."""
    import re

    if not entries or not isinstance(layers, int) or isinstance(layers, bool):
        return
    found = 1 + max((int(m.group(1)) for k in entries if (m := re.search(r"\.(\d+)\.", k))), default=-1)
    if layers < 1 or layers > found:
        raise error(f"{what} {path} does not match its config.json: num_hidden_layers is {layers}, "
                    f"but its weights hold {found} layer(s).")


def _check_sizes(path: Path, auto, config, total: int, what: str = "Checkpoint", error=ArtifactError) -> None:
    """Build the model on the meta device (nothing allocated) and refuse a parameter larger than all the checkpoint's
    weights together (a config.json size, vocab_size say, that its weights cannot match)."""
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except (NotImplementedError, RuntimeError):  # an architecture that cannot be built on meta: the load checks shapes
        return
    for name, p in model.named_parameters():
        if p.numel() > total:
            raise error(f"{what} {path} does not match its config.json: {name} would have shape "
                        f"{list(p.shape)}, more values than all its weights together.")


def check_config_sizes(path: Path, error=ArtifactError, what: str = "Model") -> None:
    """Before a model is loaded (and its parameters allocated at config.json's sizes): refuse a parameter larger
    than all the weights in its safetensors headers together. A config.json that transformers cannot read is left to
    the load, which names it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hqtflow.models import load_config

    entries = TensorFiles(path, error=error).entries
    if not entries:
        return
    _check_layer_count(path, load_config(path).get("num_hidden_layers"), entries, what, error)
    try:
        config = AutoConfig.from_pretrained(path)
        _check_sizes(path, AutoModelForCausalLM, config, sum(_numel(e.shape) for e in entries.values()), what, error)
    except error:
        raise
    except Exception:  # noqa: BLE001 - a config that cannot be read or built: the load that follows refuses it in its own words
        return


def quantization_scheme(path: Path) -> dict:
    """The FP8 scheme of the checkpoint at `path`: its config.json's `quantization_config`, parsed (one that hqtflow
    cannot run is refused by parse_quantization_config); every reader of a checkpoint checks it here."""
    from hqtflow.formats.compressed_tensors import parse_quantization_config
    from hqtflow.models import check_generation_config, load_config

    qc = parse_quantization_config(load_config(path).get("quantization_config") or {})
    check_generation_config(path)
    return qc


def load_checkpoint(path: Path, *, device: str = "cpu", dtype: torch.dtype | None = None,
                    tensors: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Build the model skeleton on the meta device, swap in FP8Linear where the checkpoint has FP8 weights, load.

    `dtype`: the high-precision compute dtype (None: the checkpoint's own, bf16 if it names none).
    `tensors`: the checkpoint's tensors already read (export checks what it reads this way); the dict is consumed.

    Reads hqtflow's own checkpoints and foreign FP8 ones: compressed-tensors (static per-tensor, dynamic per-token,
    per-tensor or per-group activations; per-tensor, per-channel or block-wise weights) and AutoFP8/vLLM
    `quant_method: fp8` (scalar float32 scales, static or dynamic per-tensor activations, `weight_block_size`).
    KV-cache scales (`k_scale`/`v_scale`, or one `kv_scale` for both) become float32 buffers of their attention
    module (the static decoder's FP8 KV cache uses them); `output_scale` and all-zero zero points are dropped.
    Unsupported schemes are refused by quantization_scheme.
    """
    from hqtflow.formats.compressed_tensors import ignored_fp8_layer
    from hqtflow.formats.hf_names import module_or_none, per_expert_containers, to_model_names
    from hqtflow.quantize.experts import unfuse_experts
    from hqtflow.quantize.fp8_linear import FP8Linear

    path = Path(path)
    qc = quantization_scheme(path)
    model = skeleton_of(path, dtype)
    config, hp = model.config, next(model.parameters()).dtype
    if tensors is None:
        tensors = read_tensors(path, device=device)
    fp8 = [k[: -len(".weight")] for k, v in tensors.items() if k.endswith(".weight") and v.dtype in FP8_WEIGHT_DTYPES]
    if (name := ignored_fp8_layer(qc, fp8)) is not None:
        key = "ignore" if qc["method"] == "compressed-tensors" else "ignored_layers"
        raise ArtifactError(f"{path}: config.json's quantization_config.{key} names {name}, whose weight is FP8 "
                            "(other loaders would then run it unquantized); the config contradicts the weights.")
    tensors = to_model_names(model, tensors, str(path), qc["block_size"])  # renamed or per-expert: as the model names them
    dropped = []
    for k in list(tensors):
        if k.endswith(DROPPED_SUFFIXES):
            if k.endswith("_zero_point") and bool(tensors[k].float().abs().max() > 0):
                raise ArtifactError(f"{path}: {k} is non-zero; asymmetric FP8 quantization is not supported.")
            dropped.append(tensors.pop(k))
    check_scales(path, tensors)
    kv_scales = {k: tensors.pop(k) for k in list(tensors) if k.endswith(KV_SUFFIXES)}
    unfuse_experts(model, sorted(per_expert_containers(tensors)))  # MoE experts stored one by one (quantize's)
    for name, mod in list(model.named_modules()):
        w = tensors.get(f"{name}.weight")
        if not isinstance(mod, nn.Linear) or w is None or w.dtype not in FP8_WEIGHT_DTYPES:
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
        model.set_submodule(name, new)
    for k, t in tensors.items():  # FP8 bytes anywhere else would be used as numbers (a router, a norm)
        owner = module_or_none(model, k.rpartition(".")[0])
        if t.dtype in FP8_WEIGHT_DTYPES and owner is None:
            raise ArtifactError(f"Checkpoint {path} does not match its config.json: {k} belongs to no layer of the "
                                f"model it describes ({type(model).__name__}).")
        if t.dtype in FP8_WEIGHT_DTYPES and not (k.endswith(".weight") and isinstance(owner, FP8Linear)):
            raise ArtifactError(f"{path}: {k} is stored in {t.dtype} but is not the weight of a Linear layer with its "
                                "weight_scale; hqtflow runs FP8 weights in Linear layers only.")
    for key, value in kv_scales.items():
        mod_name, _, leaf = key.rpartition(".")
        try:
            attn = model.get_submodule(mod_name)
        except AttributeError:
            raise ArtifactError(f"{path}: {key} belongs to no module of this model.") from None
        if value.numel() != 1:
            raise ArtifactError(f"{path}: {key} has {value.numel()} values; KV-cache scales are per tensor (one value).")
        for leaf in (("k_scale", "v_scale") if leaf == "kv_scale" else (leaf,)):
            attn.register_buffer(leaf, torch.empty((), dtype=torch.float32, device="meta"))
            tensors[f"{mod_name}.{leaf}"] = value.float().reshape(())
    for k, t in tensors.items():  # high-precision tensors in the compute dtype; FP8 weights and scales as stored
        if t.is_floating_point() and t.dtype not in FP8_WEIGHT_DTYPES and not k.endswith(SCALE_SUFFIXES):
            tensors[k] = t.to(hp)
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    except RuntimeError as e:  # a tensor whose shape disagrees with config.json (a foreign or edited checkpoint)
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]  # torch's first line only names the model
        detail = next((ln for ln in lines if "size mismatch" in ln), (lines[1:] or lines or [""])[0])
        raise ArtifactError(f"Checkpoint {path} does not match its config.json: {detail}") from None
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ArtifactError(f"Checkpoint {path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}.")
    model.hqtflow_quantization = {**qc, "dropped_tensors": len(dropped)}
    # the buffers computed at construction (rotary inv_freq) were made on the CPU: left there, every forward copies
    # them to the GPU, which CUDA graph capture refuses (the FP8 server then decoded eagerly: 0.14x bf16 on an H100)
    return model.to(device).eval()
