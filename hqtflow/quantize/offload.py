"""`hqtflow quantize --disk-offload`: the FP8 checkpoint written without ever holding the model in RAM.

The model exists only as a skeleton on the meta device (names, shapes, the dtypes `from_pretrained` would give).
Each weight is read from the source safetensors files (`hqtflow.formats.checkpoint.TensorFiles`, memory-mapped: its
pages are file pages, reclaimable, not anonymous memory), quantized with `hqtflow.scales.linear_scales` and the
measurement's input statistics exactly as `convert_model` does (bit-identical tensors), and written straight into
its place in an output shard. Non-quantized tensors are copied through (cast to the model dtype, as loading would).
A tied `lm_head` is dropped like `save_checkpoint` does, or untied (quantized from the embedding) when it is quantized.
Checkpoint names transformers renames on loading are found through the model's conversion mapping; fused MoE experts
are written per expert (`hqtflow.quantize.experts`), each read from its own rows of the source (`_expert_parts`).

Output: `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards of at most `shard_size` bytes of tensor
data each (a single tensor larger than that gets a shard of its own) plus `model.safetensors.index.json`. The
default shard size is DEFAULT_SHARD_SIZE (512 MiB). Each shard is a `SafetensorsWriter`: its header is computed up
front (every output shape and dtype is known from the plan), so tensors are written to their offsets one at a time
and memory does not grow with the shard size. The source
tensors are memory-mapped, so a step holds in anonymous memory only its temporaries (`step_memory`): for the default
maxabs methods on a bf16 model 5 bytes per element of the weight being quantized (the finiteness check), on top of
the torch/transformers import baseline.

Before anything is written, free memory (`hqtflow.hardware.available_memory_bytes`: MemAvailable, within the cgroup
limit) is checked against the largest step plus MEMORY_MARGIN, and free disk (of the output's parent) against the
checkpoint's size (`hqtflow.formats.checkpoint.check_free_disk`, which the in-memory path uses too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hqtflow import hardware
from hqtflow.errors import ModelError, ResourceError
from hqtflow.formats.checkpoint import (ST_DTYPES, SafetensorsWriter, TensorEntry, TensorFiles, TensorSpec,
                                        check_free_disk, generation_config_of)
from hqtflow.formats.hf_names import Mapping, disk_keys, disk_module_names, loaded_twice, split, split_shape
from hqtflow.formats.safetensors_files import shard_names

DEFAULT_SHARD_SIZE = 512 * 2**20  # bytes of tensor data per output file
QUANT_CHUNK_ELEMS = 1 << 20  # weights are cast to FP8 in row blocks of about this many elements
# what grows after the check besides the largest step: the tokenizer, write buffers, allocator slack (measured:
# 34 MiB on a 0.85 GB Llama)
MEMORY_MARGIN = 64 * 2**20
BLOCK_BYTES = 9  # per element of a row block cast to FP8: float32 x, float32 x / s, the codes


# ---- the plan ------------------------------------------------------------------------------------
# transformers drops these tensors of older checkpoints where the model has such a buffer (its own exception rules)
IGNORED_ON_LOAD = {"rotary_emb.inv_freq": r"rotary_emb\.inv_freq", "position_ids": r"(^|\.)position_ids$"}


@dataclass
class Unit:
    """What one step writes: a quantized Linear (its 2-4 tensors) or one copied tensor."""

    kind: str  # "quant" | "copy" | "value" (a persistent buffer the checkpoint lacks: the skeleton's value)
    outputs: list[TensorSpec]
    source: TensorEntry | None = None
    bias_source: TensorEntry | None = None
    module: str | None = None
    value: torch.Tensor | None = None
    parts: list[tuple[TensorEntry, int | None]] | None = None  # an MoE expert's weight: (tensor, expert index) rows
    disk: dict[str, list[str]] | None = None  # output name -> its names in the file (an expert's gate and up apart)

    @property
    def specs(self) -> list[TensorSpec]:
        """What the unit writes, under the checkpoint's names."""
        if self.disk is None:
            return self.outputs
        return [TensorSpec(k, t.dtype, split_shape(t.shape, len(self.disk[t.key]))) for t in self.outputs
                for k in self.disk[t.key]]

    def write(self, shard: SafetensorsWriter, key: str, tensor: torch.Tensor) -> None:
        names = self.disk[key] if self.disk else [key]
        for i, name in enumerate(names):
            shard.write(name, split(key, tensor, i, len(names)))

    def whole(self, key: str) -> bool:
        """Whether output `key` is written as one tensor (so it can be streamed in row blocks)."""
        return self.disk is None or len(self.disk[key]) == 1

    def read(self, files: TensorFiles) -> torch.Tensor:
        """The unit's source weight: one tensor, or an expert's rows gathered from its parts (gate and up
        concatenated, or one expert of a fused 3-D tensor)."""
        if self.parts is None:
            return files.get(self.source.key)
        rows = [files.get(e.key) if i is None else files.get(e.key)[i] for e, i in self.parts]
        return (rows[0] if len(rows) == 1 else torch.cat(rows)).reshape(self.outputs[0].shape)

    @property
    def source_bytes(self) -> int:
        if self.parts is None:
            return self.source.nbytes
        return sum(e.nbytes if i is None else e.nbytes // e.shape[0] for e, i in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def weight(self) -> TensorSpec:
        """What the unit reads, in the model dtype: the weight to quantize or the tensor to copy."""
        if self.kind != "quant":
            return self.outputs[0]
        return TensorSpec(self.outputs[0].key, self.outputs[1].dtype, self.outputs[0].shape)

    @property
    def copies_source(self) -> bool:
        """Whether the source becomes anonymous memory: cast to another dtype, or an expert gathered from parts
        (else it stays memory-mapped, file pages, and is written from there)."""
        sources = [self.source] if self.parts is None else [e for e, _ in self.parts]
        return len(sources) > 1 or any(e.dtype != ST_DTYPES[self.weight.dtype] for e in sources)


@dataclass
class OffloadPlan:
    model_dir: Path
    config: object  # the transformers config written to config.json
    generation_config: object | None
    units: list[Unit]
    shards: list[list[int]]  # unit indices per output file
    shard_names: list[str]
    total_bytes: int
    weight_only: bool
    per_channel: bool
    stats: dict = field(default_factory=dict)


def read_sources(model_dir: Path) -> dict[str, TensorEntry]:
    tf = TensorFiles(model_dir, error=ModelError)
    if not tf.files:
        raise ModelError(f"--disk-offload reads safetensors weights, and {model_dir} has no *.safetensors file.")
    return tf.entries


def _source_names(skel, sources: dict[str, TensorEntry]) -> tuple[dict[str, TensorEntry], list[tuple]]:
    """Each source tensor under the name transformers loads it as (`hqtflow.formats.hf_names.Mapping`): ({model name:
    tensor} for renamed ones, e.g. Mixtral's `block_sparse_moe.gate` is the model's `mlp.gate`; [(experts module,
    projection, expert, part, parts, tensor)] for an expert's matrices merged into one fused parameter, e.g. its
    `w1`/`w3` into `mlp.experts.gate_up_proj`)."""
    m = Mapping.of(skel)
    renamed, merged = {}, []
    if m is None:
        return renamed, merged
    for key, entry in sources.items():
        expert = m.expert_of(key)
        if expert is not None:
            merged.append((*expert, entry))
            continue
        target, _ = m.forward(key)
        if target != key:
            renamed[target] = entry
    return renamed, merged


def _expert_parts(skel, sources: dict[str, TensorEntry], renamed: dict[str, TensorEntry], merged: list[tuple],
                  containers: list[str]) -> dict:
    """{(experts module, "gate_up_proj" | "down_proj"): {expert: [(source tensor, index)], ...}} for the fused experts
    `containers`: a fused 3-D tensor under the module's own name or one transformers renames to it (GraniteMoE's
    `input_linear`; index: the expert's row), or the checkpoint's per-expert matrices that transformers merges into
    it (`merged` of `_source_names`; index None)."""
    out: dict[tuple[str, str], dict] = {}
    wanted = {(c, p) for c in containers for p in ("gate_up_proj", "down_proj")}
    shapes = {k: v.shape for k, v in skel.state_dict().items()}
    whole = set()
    for c, p in wanted:
        key = f"{c}.{p}"
        src = sources.get(key) or renamed.get(key)
        if src is not None and list(src.shape) == list(shapes.get(key, [])):
            out[(c, p)] = {e: [(src, e)] for e in range(shapes[key][0])}
            whole.add((c, p))
    for container, proj, e, i, n, entry in merged:
        if (container, proj) not in wanted or (container, proj) in whole:
            continue
        out.setdefault((container, proj), {}).setdefault(e, [None] * n)[i] = (entry, None)
    return out


def plan_offload(model_dir: Path, names: list[str], *, dtype: str, weight_only: bool, per_channel: bool,
                 shard_size: int | None = None, extra_values: dict[str, torch.Tensor] | None = None,
                 unfused: list[str] = (), ignore: list[str] = ()) -> OffloadPlan:
    """Map every tensor of the converted model to its source tensor and its output shard (nothing is read yet).
    `unfused`: fused MoE experts modules written per expert (`hqtflow.quantize.experts`), from their source parts.
    `ignore`: the modules kept in high precision (the config's list, under the checkpoint's names)."""
    from hqtflow.models import skeleton, torch_dtype

    model_dir = Path(model_dir)
    shard_size = shard_size or DEFAULT_SHARD_SIZE
    sources = read_sources(model_dir)
    skel = skeleton(model_dir, torch_dtype(dtype))  # parameters in the dtypes loading would give
    config = skel.config
    quant = set(names)
    out_emb = skel.get_output_embeddings()
    lm_name = next((n for n, m in skel.named_modules() if m is out_emb), None) if out_emb is not None else None
    tied = bool(getattr(config, "tie_word_embeddings", False)) and lm_name is not None
    untie = tied and lm_name in quant
    emb_key = None
    if untie:
        in_emb = skel.get_input_embeddings()
        emb_key = next(f"{n}.weight" for n, m in skel.named_modules() if m is in_emb)
        config.tie_word_embeddings = False  # as convert_model's untying does
    prefix = getattr(skel, "base_model_prefix", "") or ""

    if twice := loaded_twice(skel, sources):
        raise ModelError(f"{model_dir} holds a weight twice, as {twice[0]} and {twice[1]}; the weights and "
                         "config.json do not belong together.")
    renamed, merged = _source_names(skel, sources)

    def find(key: str) -> TensorEntry | None:
        if key in sources:
            return sources[key]
        if key in renamed:
            return renamed[key]
        if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in sources:
            return sources[key[len(prefix) + 1:]]
        if prefix and f"{prefix}.{key}" in sources:
            return sources[f"{prefix}.{key}"]
        return None

    def need(key: str, shape) -> TensorEntry:
        src = find(key)
        if src is None:
            raise ModelError(f"--disk-offload cannot find {key} in the safetensors files of {model_dir} "
                             "(weights stored under other names need the in-memory path: drop --disk-offload).")
        if list(src.shape) != list(shape):
            raise ModelError(f"{model_dir}: {key} has shape {src.shape} in the checkpoint, the model expects {list(shape)}.")
        return src

    from hqtflow.scales import FP8_DTYPES

    from hqtflow.measure.hooks import is_fused_experts

    fused = [n for n, m in skel.named_modules() if is_fused_experts(m)]
    experts = _expert_parts(skel, sources, renamed, merged, fused) if fused else {}
    units: list[Unit] = []
    for key, v in skel.state_dict().items():
        mod, _, leaf = key.rpartition(".")
        if mod in fused and leaf in ("gate_up_proj", "down_proj") and (mod in unfused or find(key) is None):
            parts = experts.get((mod, leaf), {})
            for e in range(v.shape[0]):
                out_f, in_f = v.shape[1:]
                if e not in parts or None in parts[e]:
                    raise ModelError(f"--disk-offload cannot find the weights of expert {e} of {mod} in the "
                                     f"safetensors files of {model_dir}.")
                rows = [p.shape[1] if i is not None else p.shape[0] for p, i in parts[e]]
                cols = {p.shape[-1] for p, _ in parts[e]}
                if rows != [out_f // len(rows)] * len(rows) or cols != {in_f}:  # gate and up: half the rows each
                    raise ModelError(f"{model_dir}: the weights of expert {e} of {mod} are {len(rows)} matrices of "
                                     f"{rows} rows and {sorted(cols)} columns; the model expects "
                                     f"{' and '.join([f'[{out_f // len(rows)}, {in_f}]'] * len(rows))}.")
            if mod not in unfused:  # kept fused (blocklisted): the 3-D tensor, gathered expert after expert
                units.append(Unit("copy", [TensorSpec(key, v.dtype, list(v.shape))],
                                  parts=[part for e in range(v.shape[0]) for part in parts[e]]))
                continue
            for e in range(v.shape[0]):
                name, (out_f, in_f) = f"{mod}.{e}.{leaf}", v.shape[1:]
                if name in quant:
                    outs = [TensorSpec(f"{name}.weight", FP8_DTYPES["E4M3"], [out_f, in_f]),
                            TensorSpec(f"{name}.weight_scale", v.dtype, [out_f, 1] if per_channel else [1])]
                    if not weight_only:
                        outs.append(TensorSpec(f"{name}.input_scale", v.dtype, [1]))
                    units.append(Unit("quant", outs, module=name, parts=parts[e]))
                else:
                    units.append(Unit("copy", [TensorSpec(f"{name}.weight", v.dtype, [out_f, in_f])], parts=parts[e]))
            continue
        if mod in quant:
            if leaf != "weight":
                continue  # the bias is written with its module
            lin = skel.get_submodule(mod)
            hp = v.dtype
            out_f, in_f = lin.out_features, lin.in_features
            # a tied lm_head is loaded as the embedding, then untied by convert_model: quantize the embedding
            src = need(emb_key if (untie and mod == lm_name) else key, v.shape)
            outs = [TensorSpec(f"{mod}.weight", FP8_DTYPES["E4M3"], [out_f, in_f]),
                    TensorSpec(f"{mod}.weight_scale", hp, [out_f, 1] if per_channel else [1])]
            if not weight_only:
                outs.append(TensorSpec(f"{mod}.input_scale", hp, [1]))
            bias_src = None
            if lin.bias is not None:
                bias_src = need(f"{mod}.bias", lin.bias.shape)
                outs.append(TensorSpec(f"{mod}.bias", hp, [out_f]))
            units.append(Unit("quant", outs, src, bias_src, mod))
        elif tied and not untie and key == f"{lm_name}.weight":
            continue  # tied to the embedding: not stored, as save_checkpoint does
        else:
            src = find(key)
            if src is None and v.device.type != "meta":
                units.append(Unit("value", [TensorSpec(key, v.dtype, list(v.shape))], value=v))
                continue
            src = need(key, v.shape)
            units.append(Unit("copy", [TensorSpec(key, v.dtype, list(v.shape))], src))
    used = {e.key for u in units for e in [u.source, u.bias_source, *(pe for pe, _ in u.parts or ())] if e is not None}
    if tied:  # a tied lm_head stored anyway is not loaded (nor quantized from: the embedding is)
        used |= {emb_key, f"{lm_name}.weight", f"{prefix}.{lm_name}.weight"}
    buffers = [b for b, _ in skel.named_buffers()]
    ignored = [re.compile(p) for p in getattr(skel, "_keys_to_ignore_on_load_unexpected", None) or ()]
    ignored += [re.compile(p) for leaf, p in IGNORED_ON_LOAD.items() if any(b.endswith(leaf) for b in buffers)]
    if unknown := sorted(k for k in set(sources) - used if not any(p.search(k) for p in ignored)):
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise ModelError(f"Cannot load the model in {model_dir}: its config.json has no place for {len(unknown)} "
                         f"weights ({', '.join(unknown[:3])}{more}); the weights and config.json do not belong together.")
    for key, v in (extra_values or {}).items():  # computed tensors the source lacks (KV-cache scales)
        units.append(Unit("value", [TensorSpec(key, v.dtype, list(v.shape))], value=v))
    keys = disk_keys(skel, [t.key for u in units for t in u.outputs], unfused) if unfused else None
    if keys is not None:  # MoE experts per expert: under the checkpoint's own names, as save_checkpoint writes them
        for u in units:
            u.disk = {t.key: keys[t.key] for t in u.outputs}
        ignore = disk_module_names(skel, list(ignore), unfused)
    for u in units:
        for t in u.outputs:
            if t.dtype not in ST_DTYPES:
                raise ModelError(f"--disk-offload cannot write {t.key} of dtype {t.dtype}; drop --disk-offload.")
    shards: list[list[int]] = [[]]
    size = 0
    for i, u in enumerate(units):
        if shards[-1] and size + u.nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += u.nbytes
    generation_config = generation_config_of(model_dir, getattr(skel, "generation_config", None))
    return OffloadPlan(model_dir, config, generation_config, units, shards, shard_names(len(shards)),
                       sum(u.nbytes for u in units), weight_only, per_channel, {"ignore": list(ignore)})


def step_memory(u: Unit, *, hp_dtype: torch.dtype, opt_weight: bool = False, gptq: bool = False) -> tuple[int, str]:
    """The anonymous memory `write_offloaded` holds at once writing unit `u`, and the formula. With n the weight's
    elements and b its dtype's bytes: the source as a copy when `u.copies_source` (n * b), else nothing (mapped);
    for a quantized weight then the largest of what follows one after another, in bytes per element: the
    finiteness check of `linear_scales` (w == w, |w|, |w| != inf, their and: 3 + b), a maxabs scale (w cast to
    hp_dtype when it is another, and |w|: h or 2h), an OPT weight scale's candidate round trips (`opt_weight`: four
    float32 temporaries and two in w's dtype, 16 + 2b; measured 17.7 on a bf16 Llama), GPTQ's weight in float32 transposed, permuted and rounded plus its result (`gptq`:
    12 + b, and six float32 [in, in] matrices: the Hessian's copies and factors); plus a row block of
    QUANT_CHUNK_ELEMS cast to FP8 (BLOCK_BYTES each)."""
    n, b = u.weight.numel, u.weight.dtype.itemsize
    held = n * b if u.copies_source else 0
    if u.kind != "quant":
        return held, f"{u.weight.key}: {n / 1e6:.1f}M elements x {b if held else 0} bytes"
    h = hp_dtype.itemsize
    maxabs = 2 * h if hp_dtype != u.weight.dtype else h
    per = max(3 + b, maxabs, 16 + 2 * b if opt_weight else 0, 12 + b if gptq else 0) + (b if held else 0)
    square = 6 * 4 * u.weight.shape[1] ** 2 if gptq else 0
    how = f"{u.module}: {n / 1e6:.1f}M elements x {per} bytes" + (" plus its Hessian's factors" if gptq else "")
    return n * per + square + BLOCK_BYTES * QUANT_CHUNK_ELEMS, how


def memory_needed(p: OffloadPlan, *, hp_dtype: torch.dtype, opt_weight: bool = False,
                  gptq: bool = False) -> tuple[int, str]:
    """The memory `write_offloaded` needs on top of what the process holds now: its largest step (`step_memory`)
    plus MEMORY_MARGIN; and the formula, in words."""
    step, how = max((step_memory(u, hp_dtype=hp_dtype, opt_weight=opt_weight, gptq=gptq)
                     for u in p.units if u.kind != "value"), default=(0, "no tensor"), key=lambda s: s[0])
    return step + MEMORY_MARGIN, f"the largest step, {how}, plus {hardware.byte_size(MEMORY_MARGIN)}"


def check_resources(p: OffloadPlan, output: Path, *, hp_dtype: torch.dtype = torch.bfloat16, opt_weight: bool = False,
                    gptq: bool = False) -> None:
    """Refuse, in one sentence, when free memory (`memory_needed`) or free disk (`check_free_disk`) is not enough."""
    need, how = memory_needed(p, hp_dtype=hp_dtype, opt_weight=opt_weight, gptq=gptq)
    avail = hardware.available_memory_bytes()
    if avail is not None and avail < need:
        raise ResourceError(f"Not enough free memory for --disk-offload: about {hardware.byte_size(need)} is needed ({how}) and "
                            f"{hardware.byte_size(avail)} is available (MemAvailable, within the cgroup's memory limit).")
    check_free_disk(output, [[t for i in idx for t in p.units[i].specs] for idx in p.shards], p.model_dir)


# ---- writing -------------------------------------------------------------------------------------
def write_offloaded(p: OffloadPlan, out: Path, meas, method, *, target: str, fp8: str, hp_dtype: str,
                    round_weight=None, progress=None) -> dict:
    """Write the shards, index, config.json and generation config of `p` into `out`; return timing stats.
    `round_weight(name, weight, weight_scale)`: GPTQ's weight on its FP8 grid (one tensor at a time), or None.
    `progress`: a `hqtflow.progress.Progress` advanced by the bytes of each tensor written."""
    from hqtflow.progress import Progress

    import time

    from hqtflow.formats.checkpoint import write_config
    from hqtflow.formats.compressed_tensors import quantization_config
    from hqtflow.formats.safetensors_files import write_index
    from hqtflow.quantize.fp8_linear import quantize_linear
    from hqtflow.scales import linear_scales

    out = Path(out)
    t0 = time.perf_counter()
    weight_map: dict[str, str] = {}
    read_bytes = 0
    progress = progress or Progress(False)
    progress.start("quantize", p.total_bytes, "B")
    with TensorFiles(p.model_dir, error=ModelError) as source, torch.no_grad():
        for name, idx in zip(p.shard_names, p.shards):
            outs = [t for i in idx for t in p.units[i].specs]
            with SafetensorsWriter(out / name, outs) as shard:
                for i in idx:
                    u = p.units[i]
                    try:
                        if u.kind == "value":
                            u.write(shard, u.outputs[0].key, u.value.to(u.outputs[0].dtype))
                            continue
                        src = u.read(source)  # memory-mapped: file pages, not anonymous memory (an expert's rows: a copy)
                        read_bytes += u.source_bytes
                        if u.kind == "copy":
                            u.write(shard, u.outputs[0].key, src.to(u.outputs[0].dtype))
                            del src
                            continue
                        hp = u.outputs[1].dtype
                        w = src.to(hp)
                        del src
                        stats = None if p.weight_only else meas.nodes[u.module].inputs[0]
                        sc = linear_scales(method, stats, w, target=target, fp8=fp8, hp_dtype=hp_dtype,
                                           name=u.module)
                        if round_weight is not None:
                            w = round_weight(u.module, w, sc.weight)
                        # FP8Linear.from_linear's own arithmetic (quantize_linear), streamed in row blocks
                        q = quantize_linear(w, sc.weight, None if p.weight_only else sc.input, fp8,
                                            rows=max(1, QUANT_CHUNK_ELEMS // max(1, w.shape[1])), inc_codes=method.inc_codes)
                        key = f"{u.module}.weight"
                        if u.whole(key):
                            shard.write_blocks(u.disk[key][0] if u.disk else key, q.weight_blocks)
                        else:  # an expert's gate and up: one expert's FP8 weight, split in two
                            u.write(shard, key, torch.cat(list(q.weight_blocks)))
                        u.write(shard, f"{u.module}.weight_scale", q.weight_scale)
                        if q.input_scale is not None:
                            u.write(shard, f"{u.module}.input_scale", q.input_scale)
                        if u.bias_source is not None:
                            u.write(shard, f"{u.module}.bias", source.get(u.bias_source.key).to(hp))
                            read_bytes += u.bias_source.nbytes
                        del w
                    finally:  # written (or the run stops, and the bar with it)
                        progress.advance(u.nbytes)
            weight_map.update({t.key: name for t in outs})
    progress.close()
    if len(p.shard_names) > 1:
        write_index(out, p.total_bytes, weight_map)
    qc = quantization_config(per_channel=p.per_channel, static_input=not p.weight_only, ignore=p.stats.get("ignore", []),
                             kv_cache=p.stats.get("kv_cache", False))
    write_config(out, p.config, qc, p.generation_config)
    return {"seconds": time.perf_counter() - t0, "bytes_read": read_bytes, "bytes_written": p.total_bytes,
            "shards": len(p.shard_names)}


def prepare(model_dir: Path, plan: dict, output: Path, *, dtype: str, weight_only: bool, per_channel: bool,
            shard_size: int | None = None, extra_values: dict[str, torch.Tensor] | None = None,
            hp_dtype: torch.dtype = torch.bfloat16, opt_weight: bool = False, gptq: bool = False) -> OffloadPlan:
    """The plan for `run.quantize` plus the resource checks (`check_resources`), before any output is created."""
    p = plan_offload(model_dir, plan["quantize"], dtype=dtype, weight_only=weight_only, per_channel=per_channel,
                     shard_size=shard_size, extra_values=extra_values, unfused=plan.get("unfused", []),
                     ignore=plan["ignore"])
    p.stats["kv_cache"] = bool(extra_values)
    check_resources(p, output, hp_dtype=hp_dtype, opt_weight=opt_weight, gptq=gptq)
    return p


__all__ = ["DEFAULT_SHARD_SIZE", "check_resources", "memory_needed", "plan_offload", "prepare", "step_memory",
           "write_offloaded"]
