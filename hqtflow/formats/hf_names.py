"""Tensor names on disk vs in the model.

transformers 5 renames and merges some checkpoint tensors when it loads a model (its conversion mapping): Mixtral's
`block_sparse_moe.gate` is the model's `mlp.gate`, and the per-expert `block_sparse_moe.experts.<e>.w1/w3/w2` become
one fused `mlp.experts.gate_up_proj` / `down_proj`. hqtflow runs MoE experts as one Linear pair per expert
(`<experts>.<e>.gate_up_proj`, `hqtflow.quantize.experts`), and its FP8 checkpoints store the checkpoint's own names
(what `save_pretrained` writes and vLLM and transformers read): gate and up as two tensors with the same scales.
- `to_model_names`: a checkpoint's tensors under the model's names (gate and up of an expert concatenated; their
  weight scales kept per tensor when equal, else per output channel; their input scales, one input, the larger);
  checkpoints already under the model's names pass through.
- `to_disk_names`: the reverse, for the experts modules given; the names are used only when they map back exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hqtflow.errors import ArtifactError

PROJS = ("gate_up_proj", "down_proj")
_EXPERT_KEY = re.compile(r"^(.+)\.(\d+)\.(gate_up_proj|down_proj)\.([A-Za-z_]+)$")


@dataclass
class Mapping:
    """A model's conversion mapping: its renamings, and the converters that merge per-expert matrices."""

    renamings: list
    converters: list
    experts: dict  # "gate_up_proj" | "down_proj" -> the converters that make one
    prefix: str | None
    reverse: list  # the renamings undone, in reverse order (model name -> checkpoint name)

    @classmethod
    def of(cls, model, legacy: bool = True) -> Mapping | None:
        """`legacy`: with transformers' renamings of old checkpoint names (reading: yes; writing: no, as
        `save_pretrained`)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

        transforms = [t for t in get_model_conversion_mapping(model, add_legacy=legacy)
                      if type(t).__name__ in ("WeightRenaming", "WeightConverter")]
        if not transforms:
            return None
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        experts: dict[str, list] = {p: [] for p in PROJS}
        for c in converters:
            ops = [(type(o), getattr(o, "dim", None)) for o in c.operations]
            for p, n in (("gate_up_proj", 2), ("down_proj", 1)):  # the merge of Mixtral-style experts, nothing else
                if (len(c.target_patterns) == 1 and c.target_patterns[0].endswith(f"experts.{p}")
                        and len(c.source_patterns) == n and ops == [(MergeModulelist, 0), (Concatenate, 1)][:n]):
                    experts[p].append(c)
        return cls(renamings, converters, experts, getattr(model, "base_model_prefix", None),
                   [r.reverse_transform() for r in renamings][::-1])

    def forward(self, key: str) -> tuple[str, str | None]:
        """What transformers loads `key` as: (model name, the converter source pattern it matched or None)."""
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(key, self.renamings, self.converters, self.prefix)

    def expert_of(self, key: str) -> tuple[str, str, int, int, int] | None:
        """(experts module, projection, expert, part, parts) of a per-expert tensor on disk, None for another one."""
        base, _, leaf = key.rpartition(".")
        target, pattern = self.forward(f"{base}.weight")
        if pattern is None:
            return None
        container, _, proj = target.rpartition(".")
        conv = next((c for c in self.experts.get(proj, []) if pattern in c.source_patterns), None)
        index = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), f"{base}.weight")
        if conv is None or index is None:
            return None
        return container, proj, int(index.group(1)), conv.source_patterns.index(pattern), len(conv.source_patterns)

    def disk_names(self, container: str, proj: str, expert: int) -> list[str] | None:
        """The on-disk `.weight` names of one expert's projection (gate and up: two), None where none is known."""
        from transformers.core_model_loading import rename_source_key

        target = f"{container}.{proj}"
        for conv in self.experts.get(proj, []):
            tp = conv.target_patterns[0]
            at = target.rfind(tp)
            if at < 0 or at + len(tp) != len(target):
                continue
            names = [rename_source_key(target[:at] + sp.replace("*", str(expert)), self.reverse, [], self.prefix)[0]
                     for sp in conv.source_patterns]
            if all(self.expert_of(n) == (container, proj, expert, i, len(names)) for i, n in enumerate(names)):
                return names
        return None

    def disk_name(self, key: str) -> str:
        """The on-disk name of a tensor transformers only renames."""
        from transformers.core_model_loading import rename_source_key

        name = rename_source_key(key, self.reverse, [], self.prefix)[0]
        return name if self.forward(name) == (key, None) else key


def _merge(leaf: str, parts: list[torch.Tensor], rows: list[int], block_rows: int | None, what: str) -> torch.Tensor:
    """One tensor of a merged projection from its parts' (gate, up) tensors of `leaf`."""
    if len(parts) == 1:
        return parts[0]
    if len({p.dtype for p in parts}) > 1 or len({tuple(p.shape[1:]) for p in parts}) > 1:
        raise ArtifactError(f"{what}: the `{leaf}` tensors of its gate and up differ in dtype or shape "
                            f"({', '.join(f'{p.dtype} {list(p.shape)}' for p in parts)}), so they cannot be joined.")
    if block_rows and leaf.startswith("weight_scale"):  # block-wise: the parts' blocks must stack into whole blocks
        if any(r % block_rows for r in rows):
            raise ArtifactError(f"{what}: its gate and up have {rows} rows, not whole blocks of {block_rows}, so their "
                                "block-wise scales cannot be joined.")
        return torch.cat(parts)
    if leaf == "input_scale":
        return torch.stack([p.reshape(()) for p in parts]).max().reshape(parts[0].shape)
    if leaf.startswith("weight_scale"):
        if all(p.numel() == 1 for p in parts) and all(torch.equal(p, parts[0]) for p in parts):
            return parts[0]
        if all(p.numel() in (1, r) for p, r in zip(parts, rows)):  # per tensor or per channel -> per channel
            return torch.cat([p.reshape(-1, 1).expand(r, 1) for p, r in zip(parts, rows)])
    return torch.cat(parts)  # weights; block-wise scales (whole blocks of rows each)


def module_or_none(model, name: str):
    """model.get_submodule(name), None where there is none."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def to_model_names(model, tensors: dict[str, torch.Tensor], where: str = "",
                   block_size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """`tensors` (a checkpoint's) under `model`'s names; per-expert tensors on disk become `<experts>.<e>.<proj>.*`.
    `block_size`: the checkpoint's weight blocks (block-wise scales), None for per-tensor or per-channel ones."""
    m = Mapping.of(model)
    if m is None:
        return tensors
    out: dict[str, torch.Tensor] = {}
    parts: dict[tuple, list] = {}
    for key, t in tensors.items():
        expert = m.expert_of(key) if any(m.experts.values()) else None
        if expert is None:
            target, pattern = m.forward(key)
            if pattern is not None:  # transformers joins it with others (not an expert's gate and up): hqtflow does not
                raise ArtifactError(f"{where}: {key} is one of the tensors transformers joins into {target} when it "
                                    "loads this model; hqtflow reads checkpoints whose tensors are the model's own.")
            if target in out:
                raise ArtifactError(f"{where}: two tensors are the model's {target} (one of them {key}); the checkpoint "
                                    "holds a weight twice under different names.")
            out[target] = t
            continue
        container, proj, e, i, n = expert
        parts.setdefault((container, proj, e, key.rpartition(".")[2]), [None] * n)[i] = t
    for (container, proj, e, leaf), ts in parts.items():
        if any(t is None for t in ts):
            raise ArtifactError(f"{where}: expert {e} of {container} has only {sum(t is not None for t in ts)} of the "
                                f"{len(ts)} `{leaf}` tensors its {proj} is made of.")
        weights = parts.get((container, proj, e, "weight"))
        rows = [w.shape[0] if w is not None else 0 for w in weights] if weights else [0] * len(ts)
        fused = getattr(module_or_none(model, container), proj, None)  # [experts, out, in]: each part out / n rows
        if leaf == "weight" and fused is not None and fused.dim() == 3 and rows != [fused.shape[1] // len(ts)] * len(ts):
            raise ArtifactError(f"{where}: expert {e} of {container} has {proj} parts of {rows} rows; the model's "
                                f"config gives each {fused.shape[1] // len(ts)}.")
        if f"{container}.{e}.{proj}.{leaf}" in out:
            raise ArtifactError(f"{where}: {container}.{e}.{proj}.{leaf} is in the checkpoint both whole and in parts; "
                                "the checkpoint holds a weight twice under different names.")
        out[f"{container}.{e}.{proj}.{leaf}"] = _merge(leaf, ts, rows, block_size[0] if block_size else None,
                                                        f"{where}: expert {e} of {container}")
    return out


def loaded_twice(model, keys) -> tuple[str, str] | None:
    """Two of a checkpoint's tensor names that transformers would load as one tensor of `model` (renamed and not, or
    an expert's matrix both per expert and in the fused 3-D tensor), or None. transformers keeps one of them
    silently."""
    m = Mapping.of(model)
    if m is None:
        return None
    whole: dict[str, str] = {}
    parts: dict[tuple, str] = {}
    for key in keys:
        expert = m.expert_of(key) if any(m.experts.values()) else None
        if expert is None:
            target, pattern = m.forward(key)
            if pattern is not None:  # one of several tensors another converter joins into one: not a copy
                continue
        else:
            target = (*expert[:4], key.rpartition(".")[2])
        seen = whole if expert is None else parts
        if target in seen:
            return seen[target], key
        seen[target] = key
    for (container, proj, *_), key in parts.items():
        if f"{container}.{proj}" in whole:
            return whole[f"{container}.{proj}"], key
    return None


def per_expert_containers(keys) -> set[str]:
    """The experts modules a checkpoint stores per expert under the model's names: `<experts>` of every
    `<experts>.<e>.gate_up_proj.weight`."""
    return {hit.group(1) for k in keys if (hit := _EXPERT_KEY.match(k)) and hit.group(3, 4) == ("gate_up_proj", "weight")}


def disk_keys(model, keys, containers) -> dict[str, list[str]] | None:
    """{model name: its on-disk names} (two for the gate-and-up of an expert of `containers`, in order), or None when
    the model has no conversion mapping or a name would not map back exactly."""
    m = Mapping.of(model, legacy=False)
    if m is None:
        return None
    containers = set(containers)
    out: dict[str, list[str]] = {}
    seen: set[str] = set()
    for key in keys:
        hit = _EXPERT_KEY.match(key)
        if hit is None or hit.group(1) not in containers:
            names = [m.disk_name(key)]
        else:
            names = m.disk_names(hit.group(1), hit.group(3), int(hit.group(2)))
            if names is None:
                return None
            names = [n[: -len(".weight")] + "." + hit.group(4) for n in names]
        if seen.intersection(names):
            return None
        seen.update(names)
        out[key] = names
    return out


def to_disk_names(model, tensors: dict[str, torch.Tensor], containers) -> dict[str, torch.Tensor]:
    """`tensors` under `model`'s names (experts of `containers` one Linear pair each) -> the checkpoint's own names.
    Unchanged when the model has no conversion mapping or a name would not map back exactly."""
    keys = disk_keys(model, tensors, containers)
    if keys is None:
        return tensors
    return {name: split(key, t, i, len(keys[key])) for key, t in tensors.items() for i, name in enumerate(keys[key])}


def split(key: str, t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """Part `i` of `n` (gate, up) of a merged projection's tensor `key`: rows of weights and per-channel scales, the
    same per-tensor scale for each."""
    if n == 1 or t.dim() == 0 or t.shape[0] == 1:
        return t
    rows = t.shape[0] // n
    return t[i * rows:(i + 1) * rows]


def split_shape(shape: list[int], n: int) -> list[int]:
    """The shape of each of `n` parts `split` makes of a tensor of `shape`."""
    return list(shape) if n == 1 or not shape or shape[0] == 1 else [shape[0] // n, *shape[1:]]


def disk_module_names(model, names: list[str], containers) -> list[str]:
    """Module names (a checkpoint config's `ignore` list) under the checkpoint's own names."""
    keys = disk_keys(model, [f"{n}.weight" for n in names], containers)
    if keys is None:
        return list(names)
    return sorted(k[: -len(".weight")] for ks in keys.values() for k in ks)
