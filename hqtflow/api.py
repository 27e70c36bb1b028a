"""The Python API: `hqtflow.load(path)` returns a ready-to-run FP8 model (hqtflow's checkpoint, verified, or another
tool's) and its tokenizer; `load_any` is the commands' loader (FP8 checkpoints and plain models)."""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path


def load(path: str | Path, *, device: str = "cpu", verify: bool = True, backend: str = "auto", dtype="auto"):
    """Load an FP8 checkpoint -> (model, tokenizer), ready to run (torch is imported on the first call).

    `path`: hqtflow's checkpoint or its `export --format fp8|compressed-tensors` (schema checked), or another tool's
    compressed-tensors or AutoFP8 `fp8` checkpoint.
    `device`: "cpu", "cuda" or "auto" (cuda when PyTorch sees a CUDA GPU).
    `verify`: check the sha256 of every file hqtflow's manifest lists (False: its schema and file list only; faster
    for a large checkpoint that was verified before).
    `backend`: the FP8 matmul: "auto" (the CPU kernel on CPU, `_scaled_mm` on FP8 GPUs), "qdq" (the reference), ...
    `dtype`: the high-precision compute dtype: "auto" (the fastest here, see hqtflow.hardware),
    "bf16"/"bfloat16"/torch.bfloat16, "fp16"/"float16"/torch.float16 or "fp32"/"float32"/torch.float32.
    Raises hqtflow.errors.HqtflowError subclasses (one sentence each) for what is wrong with the arguments or files."""
    from hqtflow import models
    from hqtflow.errors import ArtifactError
    from hqtflow.formats.artifact import MANIFEST, check_unchanged
    from hqtflow.formats.checkpoint import load_checkpoint
    from hqtflow.hardware import dtype_name, resolve_dtype, run_device
    from hqtflow.quantize.fp8_linear import set_backend

    device = run_device(device, "device=")
    dtype = resolve_dtype(dtype_name(dtype), device, "dtype")
    path = Path(path)
    manifest = None
    if (path / MANIFEST).is_file() or not path.is_dir():  # hqtflow's: verified; read_manifest words a missing path
        manifest = _check_manifest(path, verify)
    elif not _is_fp8(models.resolve_model(str(path))):
        raise ArtifactError(f"{path} is not an FP8 checkpoint: it has no {MANIFEST} and its config.json no FP8 "
                            "quantization_config (compressed-tensors or fp8).")
    model = load_checkpoint(path, device=device, dtype=models.torch_dtype(dtype))
    set_backend(model, backend)
    tokenizer = models.load_tokenizer(path)
    if manifest is not None:  # loaded by path: the files read are the ones hashed, or it is refused
        check_unchanged(manifest)
    return model, tokenizer


def _is_fp8(path: Path) -> bool:
    """Whether the model folder `path` holds an FP8 checkpoint (hqtflow's, or another tool's compressed-tensors or
    AutoFP8 `fp8`); a quantization_config that is not an object counts, for load_checkpoint to refuse it."""
    from hqtflow import models
    from hqtflow.formats.artifact import MANIFEST

    qc = models.load_config(path).get("quantization_config") or {}
    return (path / MANIFEST).exists() or not isinstance(qc, dict) or qc.get("quant_method") in ("compressed-tensors", "fp8")


def _check_manifest(path: Path, verify: bool):
    """An hqtflow checkpoint's manifest, or an export's in a layout this runtime loads, hashes checked: returned."""
    from hqtflow.errors import ArtifactError
    from hqtflow.export import FORMATS, LOADABLE_FORMATS
    from hqtflow.formats.artifact import ArtifactKind, read_checkpoint_manifest

    m = read_checkpoint_manifest(path, verify=verify)
    if m.type != ArtifactKind.EXPORT:
        return m
    fmt = m.data.get("format")
    if fmt not in FORMATS:
        raise ArtifactError(f"{path}'s manifest gives the export format {fmt!r}, which this hqtflow does not know "
                            f"({', '.join(FORMATS)}); written by a newer or another hqtflow?")
    if fmt not in LOADABLE_FORMATS:
        raise ArtifactError(f"{path} is an `export --format {fmt}` artifact, which runs in Neural Compressor; "
                            f"hqtflow loads {' and '.join(LOADABLE_FORMATS)} exports and its own checkpoints.")
    return m


def load_any(ref: str | None, dtype: str = "auto", backend: str = "auto", device: str = "cpu", *,
             trust_pickle: bool = False):
    """The one loader of generate, eval, serve and bench -> (model, tokenizer, kind): an FP8 checkpoint of any origin
    (through `load`, kind "fp8") or a plain HF model (kind: its dtype), on `device`. `dtype`: the high-precision
    compute dtype ("auto": the fastest on `device`); `trust_pickle`: load a plain model whose weights are only
    pickles (pytorch_model.bin, .pt, .pth), which runs what they hold (models.load_model)."""
    from hqtflow import models
    from hqtflow.hardware import resolve_dtype

    dtype = resolve_dtype(dtype, device)
    path = models.resolve_model(ref)
    if _is_fp8(path):
        model, tok, kind = (*load(path, backend=backend, dtype=dtype, device=device), "fp8")
    else:
        model, tok, kind = models.load_model(path, dtype, trust_pickle=trust_pickle).to(device), models.load_tokenizer(path), dtype
        if device == "cpu":
            linears_on_kernel(model, backend)
    if dtype == "fp16":
        guard_fp16(model, ref or models.DEFAULT_MODEL)
    return model, tok, kind


def linears_on_kernel(model, backend: str = "auto") -> int:
    """A plain model on the CPU: its Linears (bf16 weights, computed in bf16, or in fp32 where that is faster) on the
    CPU kernel's packed-bf16 path, as an FP8 model's high-precision Linears are (`bf16_linear.py`): a row's output
    then does not depend on its neighbours (oneDNN's bf16 GEMM changes its order of sums with the number of rows on
    AMX CPUs, so a served request's logprobs and text changed with the batch), and it was faster at every M measured
    (SmolLM2 forward on a 2-core AMX Xeon: 1.10-1.47x at 1-512 tokens). `backend` "qdq" (or a kernel that cannot be
    built, under "auto") keeps `F.linear`; returns how many Linears read packed bf16."""
    from hqtflow.quantize import bf16_linear, cpu_kernel
    from hqtflow.quantize.fp8_linear import resolve_backend

    if backend not in ("auto", "cpu") or (backend == "auto" and not cpu_kernel.available()):
        return 0
    resolve_backend(backend, "cpu")  # an explicit "cpu" without a kernel: refused in its words
    return bf16_linear.use_kernel(model, True)


_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("fp16_overflow_deferred", default=False)


class Fp16Overflow:
    """A forward hook on a model's lm_head: logits holding NaN or infinity (activations past fp16's largest value,
    65504, overflowed) raise a ModelError in one sentence, kept in `tripped` for callers whose engine thread turns
    exceptions into a request's error, instead of text decoded from NaN logits or a NaN perplexity. Not checked
    inside torch.compile'd code (the compiled engine's decode steps; its prefill is), in CUDA graph captures, nor
    `deferred` (the serving engine checks its logits itself, request by request, graph replays included)."""

    def __init__(self, name: str):
        self.name, self.tripped = name, None

    def __call__(self, module, inputs, output):
        import torch

        if torch.compiler.is_compiling():  # a torch.compile'd decode step (--engine compiled): no graph break
            return
        if output.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph capture: no host sync there
            return
        if _DEFERRED.get():
            return
        if not bool(torch.isfinite(output).all()):
            raise self.trip()

    def trip(self):
        """The ModelError of overflowed logits (also kept in `tripped`)."""
        from hqtflow.errors import ModelError

        self.tripped = ModelError(f"{self.name} computes NaN or infinite logits in fp16 (its activations pass "
                                  "fp16's largest value, 65504): run it with --dtype bf16 or fp32.")
        return self.tripped

    @contextlib.contextmanager
    def deferred(self):
        """No check on this thread within: its caller checks the logits itself (Engine._overflowed)."""
        token = _DEFERRED.set(True)
        try:
            yield
        finally:
            _DEFERRED.reset(token)


def raise_fp16_overflow(model) -> None:
    """Raise again the error `model`'s Fp16Overflow guard (guard_fp16) tripped on, if it did: for callers whose
    serving engine turned it into a request's error (its own sentence, exit 4, not the engine's failure)."""
    guard = getattr(model, "fp16_guard", None)
    if guard is not None and guard.tripped:
        raise guard.tripped


def guard_fp16(model, name: str) -> Fp16Overflow:
    """Install an Fp16Overflow hook on `model`'s output embeddings (its lm_head); returns it (also `model.fp16_guard`)."""
    guard = Fp16Overflow(name)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_hook(guard)
    model.fp16_guard = guard
    return guard
