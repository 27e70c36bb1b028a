"""An FP8 Linear: FP8 weight [out, in] with a per-tensor or per-channel scale, and either a static per-tensor
input scale (W8A8, like HQT) or none (weight-only).

The QDQ backend is the reference every faster backend is checked against: it quantizes the input with its
static scale and dequantizes it, dequantizes the weight, and multiplies in the high-precision dtype, with the
same arithmetic as Neural Compressor's CPU QDQ path (float32 scaling, saturation at the FP8 format's maximum).

For FP8 checkpoints made by other tools (`load_checkpoint`) it also runs: dynamic activations (`activation`
"dynamic_token": each token row quantized with its own scale = row maxabs / F at run time, "dynamic_tensor": one
scale = tensor maxabs / F per call, "dynamic_group": per token and per `group_size` input columns) and block-wise
weights (`block_size` (b0, b1): weight_scale [ceil(out/b0), ceil(in/b1)], each scale applies to its block).
Dynamic scales are computed in float32 (amax / F, compressed-tensors' and vLLM's rule), or, when the layer has a
`dynamic_rule` (`hqtflow.scales.Rule`, from Neural Compressor's dynamic methods: backoff 0.5, power-of-two
rounding, INC's arithmetic), with `hqtflow.scales.dynamic_activation_scale`. The static path is unchanged.

Backends (`set_backend`):
- "qdq": the reference, any layout, any device.
- "cpu": hqtflow's CPU kernel (`cpu_kernel.py`): the FP8 weight stays FP8 in memory and is widened in registers or
  per panel (on AVX2 from a second FP8 copy in the kernel's layout, `pack_for_cpu`); static, dynamic or no
  activation quantization, per-tensor or per-channel weights. The same function
  as "qdq" (input QDQ and dequantized weight bit-identical, products exact, fp32 sums in another but fixed order),
  batch-invariant: a row's output does not depend on M, its neighbours or padding rows.
- "scaled_mm": `torch._scaled_mm`, a real FP8 GEMM with fp32 accumulation on CUDA compute capability >= 8.9 (it
  also runs, slowly, on CPU, which lets CI check its layout and numerics); static per-tensor activations and
  per-tensor weights, or per-token dynamic activations with per-tensor or per-channel weights (row-wise scales:
  [M, 1] for the input, [1, N] for the weight). On CUDA the input's quantization is one fused kernel
  (`torch.compile` of the same float32 arithmetic, compiled once per process): unfused, its four elementwise passes
  cost more than the FP8 GEMM saves (measured on an H100: 0.56-0.89x bf16 at M >= 256).
  CUDA's `_scaled_mm` refuses what the CPU's runs (`scaled_mm_refusal`): K or N not a multiple of 16, E5M2 inputs
  with E5M2 weights, a bias with float32 output, per-token scales without bf16 output; on CUDA such a layer is not
  given "scaled_mm".
- "auto": "scaled_mm" on a CUDA GPU with FP8 tensor cores, "cpu" on CPU when the kernel builds, else "qdq".
Layers a backend cannot run keep "qdq"; an explicit "scaled_mm" for a layer CUDA's `_scaled_mm` refuses is refused.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
from torch import nn

from hqtflow.choices import Backend, parse
from hqtflow.errors import BackendError  # noqa: F401 - re-exported (it lived here)
from hqtflow.quantize.bf16_linear import weight_tag
from hqtflow.quantize.cpu_kernel import quantize_weight
from hqtflow.scales import FP8_DTYPES, Rule, dequantize, dynamic_activation_scale, inc_code_scale, quantize


ACTIVATION_MODES = ("static", "dynamic_token", "dynamic_tensor", "dynamic_group", None)


def quantize_per_token(x: torch.Tensor, fp8: str = "E4M3") -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 x, float32 scales [M, 1]): each row's scale amax(|row|) / F (at least 1e-12), in float32."""
    F = float(torch.finfo(FP8_DTYPES[fp8]).max)
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / F).clamp(min=1e-12)
    return quantize(xf, scale, fp8), scale


def scaled_mm_refusal(device_type: str, in_features: int, out_features: int, fp8: str, bias: bool,
                      out_dtype: torch.dtype, rowwise: bool = False) -> str | None:
    """Why `torch._scaled_mm` on `device_type` refuses a layer (inputs and weights both `fp8`; `rowwise`: per-token
    input scales), or None. CUDA checks what the CPU kernel does not (PyTorch's ScaledBlas.cpp): K and N multiples of
    16, not two E5M2 operands, a bias only with a bf16 or fp16 output, and row-wise scales only with a bf16 output."""
    if device_type != "cuda":
        return None
    if in_features % 16 or out_features % 16:
        return f"its in/out features ({in_features}, {out_features}) are not multiples of 16"
    if fp8 == "E5M2":
        return "its weights and inputs are both E5M2, which CUDA's _scaled_mm does not multiply"
    if bias and out_dtype == torch.float32:
        return "it has a bias and computes in float32, and CUDA's _scaled_mm takes a bias only with bf16 or fp16 output"
    if rowwise and out_dtype != torch.bfloat16:
        return (f"its per-token input scales need a bf16 output on CUDA's _scaled_mm, and it computes in "
                f"{str(out_dtype).removeprefix('torch.')}")
    return None


def _tensor_tag(t: torch.Tensor) -> tuple:
    """What identifies a tensor's current values for a cache: storage, device, and in-place version (inference
    tensors have none)."""
    return t.data_ptr(), t.device, None if t.is_inference() else t._version


def _same_place(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both None, or tensors of one device, shape and dtype (`b` can be copied into `a`)."""
    if a is None or b is None:
        return a is b
    return a.device == b.device and a.shape == b.shape and a.dtype == b.dtype


@functools.cache
def fused(fn):
    """`fn` compiled into one kernel for CUDA inputs (shapes dynamic: one compile per process, not per M)."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


_CAPTURING: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8_linear_capturing", default=False)
_SHARING: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8_linear_sharing", default=False)


@contextlib.contextmanager
def _flag(var: contextvars.ContextVar) -> Iterator[None]:
    token = var.set(True)
    try:
        yield
    finally:
        var.reset(token)


def capturing() -> contextlib.AbstractContextManager:
    """Around a CUDA graph's warm-up runs and capture (`runtime.cuda_graphs.capture`): inputs are quantized by the one
    compiled kernel (fewest kernels to replay), compiled in the warm-up, not while the graph records."""
    return _flag(_CAPTURING)


def sharing_inputs() -> contextlib.AbstractContextManager:
    """Around a forward whose activations are new tensors that nothing changes in place (the serving engine's
    steps): a CUDA FP8Linear with a static scale keeps its FP8 input on the input tensor, and the next Linear reading
    that tensor with a scale of equal value takes it (q/k/v and gate/up read one tensor: two quantizations per layer
    instead of five)."""
    return _flag(_SHARING)


@dataclass
class QuantizedLinear:
    """A Linear's stored FP8 tensors: `weight_blocks` yields the FP8 weight in row blocks (concatenated: [out, in]);
    `weight_scale` is [1] or [out, 1] and `input_scale` [1] or None, both in the weight's dtype."""

    weight_blocks: Iterator[torch.Tensor]
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None


def quantize_linear(w: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None, fp8: str = "E4M3",
                    *, rows: int | None = None, inc_codes: bool = False) -> QuantizedLinear:
    """The one arithmetic that turns a 2-D weight and its scales into what an FP8Linear (or a checkpoint) stores,
    shared by `FP8Linear.from_linear` (in memory) and `quantize --disk-offload` (streamed). The cast is element-wise,
    so quantizing `rows` rows at a time gives the same bytes as the whole weight at once. `inc_codes`: the codes are
    picked with `inc_code_scale` of the stored scale, as Neural Compressor picks them (the stored scale is the same)."""
    per_channel = weight_scale.numel() > 1
    ws = weight_scale.detach().to(w.dtype).reshape((w.shape[0], 1) if per_channel else (1,))
    codes = inc_code_scale(ws) if inc_codes else ws
    s_in = None if input_scale is None else input_scale.detach().to(w.dtype).reshape(1)
    step = rows or max(1, w.shape[0])

    def blocks() -> Iterator[torch.Tensor]:
        if w.dim() != 2:  # not a Linear's matrix: the reference cast, whole
            yield quantize(w, codes, fp8)
            return
        for r in range(0, w.shape[0], step):
            yield quantize_weight(w[r:r + step], codes[r:r + step] if per_channel else codes, fp8)

    return QuantizedLinear(blocks(), ws, s_in)


class _MMScales(NamedTuple):
    """An FP8Linear's `_scaled_mm` scales, cast once: the stored scales' tags they were cast from, the float32
    input scale [] (None when dynamic) and weight scale, and the input scale's value on the host (the key of
    `_shared_quantized`; an object equal to nothing when there is none)."""
    key: tuple
    a: torch.Tensor | None
    b: torch.Tensor
    value: object

    def pair(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self.a, self.b


class FP8Linear(nn.Module):
    backend = "qdq"
    dynamic_rule: Rule | None = None  # INC's dynamic scale rule; None: amax / F in float32
    packed: torch.Tensor | None = None  # the "cpu" backend's copy of the weight in its kernel's layout
    _packed_from: tuple[int, int] | None = None  # (data_ptr, version) of the weight `packed` was made from
    fast_accum = False  # "scaled_mm": Hopper's fast FP8 accumulation (cuBLAS's default is the exact fp32 one)
    # "scaled_mm" on CUDA, static input scale, outside a compiled step or `capturing()`: how the input is quantized.
    # "aten": three eager kernels. "triton": one Triton kernel (`triton_quantize`; "aten" where Triton is absent): on
    # an H200, 8B, 32 prompts' prefill, 1.3 ms of GPU time against aten's 11.5 ms, but the step is host-bound there
    # and was no faster (71 ms against 66 ms, one run), and its bytes were checked on a GPU in one case only (bf16,
    # E4M3), so it is not the default. "compiled": torch.compile's one kernel, whose dispatch costs more host time
    # than the two kernels it saves (162 ms against 121 ms for "aten" in that prefill, 2026-11-30).
    eager_quantizer = "aten"
    _mm_scales: "_MMScales | None" = None  # "scaled_mm": its float32 scales, made once, not per call

    def __init__(self, in_features: int, out_features: int, *, bias: bool, hp_dtype: torch.dtype,
                 fp8: str = "E4M3", per_channel: bool = False, static_input: bool = True, device=None,
                 activation: str | None = "default", block_size: tuple[int, int] | None = None,
                 group_size: int | None = None):
        super().__init__()
        if activation == "default":
            activation = "static" if static_input else None
        if activation not in ACTIVATION_MODES:
            raise ValueError(f"activation must be one of {ACTIVATION_MODES}, not {activation!r}")
        static_input = activation == "static"
        self.in_features, self.out_features = in_features, out_features
        self.hp_dtype, self.fp8 = hp_dtype, fp8
        self.activation, self.group_size = activation, group_size
        self.block_size = tuple(block_size) if block_size else None
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8_DTYPES[fp8], device=device))
        if self.block_size:
            b0, b1 = self.block_size
            scale_shape = (-(-out_features // b0), -(-in_features // b1))
        else:
            scale_shape = (out_features, 1) if per_channel else (1,)
        self.register_buffer("weight_scale", torch.ones(scale_shape, dtype=hp_dtype, device=device))
        self.register_buffer("input_scale", torch.ones(1, dtype=hp_dtype, device=device) if static_input else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=hp_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                    fp8: str = "E4M3", dynamic: Rule | None = None, weight: torch.Tensor | None = None,
                    inc_codes: bool = False) -> FP8Linear:
        """Quantize `linear`'s weight with `weight_scale` (0-d or [out]); `input_scale` None = weight-only, or
        dynamic activations when `dynamic` is a dynamic activation rule (per token for PCS, per call for PTS).
        `weight`: quantized instead of linear's own (GPTQ's, already on the grid). `inc_codes`: see `quantize_linear`."""
        w = (linear.weight if weight is None else weight).detach()
        per_channel = weight_scale.numel() > 1
        activation = "static" if input_scale is not None else None
        if dynamic is not None:
            activation = "dynamic_token" if dynamic.granularity == "PCS" else "dynamic_tensor"
        m = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, hp_dtype=w.dtype, fp8=fp8,
                per_channel=per_channel, activation=activation, device=w.device)
        if dynamic is not None and dynamic.dynamic == "inc":
            m.dynamic_rule = dynamic
        q = quantize_linear(w, weight_scale, input_scale, fp8, inc_codes=inc_codes)
        m.weight_scale.copy_(q.weight_scale.reshape(m.weight_scale.shape))
        m.weight.copy_(torch.cat(list(q.weight_blocks)))
        if q.input_scale is not None:
            m.input_scale.copy_(q.input_scale)
        if linear.bias is not None:
            m.bias.copy_(linear.bias.detach())
        return m

    @property
    def per_channel(self) -> bool:
        return self.block_size is None and self.weight_scale.numel() > 1

    def dequantized_weight(self) -> torch.Tensor:
        if self.block_size:
            b0, b1 = self.block_size
            s = self.weight_scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
            return (self.weight.float() * s[: self.out_features, : self.in_features]).to(self.hp_dtype)
        return dequantize(self.weight, self.weight_scale, self.hp_dtype)

    def _dynamic_qdq(self, x: torch.Tensor) -> torch.Tensor:
        F = float(torch.finfo(FP8_DTYPES[self.fp8]).max)
        xf = x.float()
        if self.activation == "dynamic_group":
            g = self.group_size
            shape = xf.shape
            xf = xf.reshape(*shape[:-1], shape[-1] // g, g)
            scale = (xf.abs().amax(-1, keepdim=True) / F).clamp(min=1e-12)
            return dequantize(quantize(xf, scale, self.fp8), scale, self.hp_dtype).reshape(shape)
        scale = self._dynamic_scale(x)
        return dequantize(quantize(xf, scale, self.fp8), scale, self.hp_dtype)

    def _dynamic_scale(self, x: torch.Tensor) -> torch.Tensor:
        """Per token ([..., 1]) or per call (0-d) activation scale of a dynamic_token / dynamic_tensor layer."""
        if self.dynamic_rule is not None:
            return dynamic_activation_scale(x.to(self.hp_dtype), self.dynamic_rule, fp8=self.fp8)
        F = float(torch.finfo(FP8_DTYPES[self.fp8]).max)
        xf = x.float()
        amax = xf.abs().amax(-1, keepdim=True) if self.activation == "dynamic_token" else xf.abs().amax()
        return (amax / F).clamp(min=1e-12)

    def supports(self, backend: str) -> bool:
        if backend == "qdq":
            return True
        if backend == "scaled_mm":
            return self.block_size is None and self.scaled_mm_refusal() is None and (
                (self.activation == "static" and not self.per_channel) or self.activation == "dynamic_token")
        if backend == "cpu":
            return (self.weight.device.type == "cpu" and self.block_size is None
                    and self.activation in ("static", "dynamic_token", "dynamic_tensor", None))
        return False

    def scaled_mm_refusal(self) -> str | None:
        """Why `_scaled_mm` on this layer's device refuses it (`scaled_mm_refusal`), or None."""
        return scaled_mm_refusal(self.weight.device.type, self.in_features, self.out_features, self.fp8,
                                 self.bias is not None, self.hp_dtype, rowwise=self.activation == "dynamic_token")

    def pack_for_cpu(self) -> None:
        """Lay the FP8 weight out the way this machine's CPU kernel reads it (`fp8_pack`: groups of rows, column
        after column, on AVX2; chunks of 16 rows transposed on the bf16 dot-product paths, which only bf16 inputs
        take, so none for an fp32 or fp16 layer there; nothing where the kernel reads [out, in] as it is).
        `set_backend("cpu")` calls it; the packed copy is remade when the weight changes in place."""
        from hqtflow.quantize.bf16_linear import kernel_dtype

        bf16_path = kernel_dtype() == torch.bfloat16
        packed = torch.ops.hqtflow.fp8_pack(self.weight) if not bf16_path or self.hp_dtype == torch.bfloat16 else None
        self.packed = packed if packed is not None and packed.numel() else None
        self._packed_from = weight_tag(self.weight)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation not in ("static", None):
            x = self._dynamic_qdq(x)
        if torch.compiler.is_compiling():
            return torch.ops.hqtflow.fp8_linear(x.to(self.hp_dtype), self.weight, self.weight_scale, self.input_scale,
                                                self.bias, self.packed)
        # eager: a decode step runs this ~200 times, so the buffers come from one dict lookup each (not
        # nn.Module.__getattr__) and the op from its overload (not the packet's overload resolution)
        b = self._buffers
        w = b["weight"]
        if self._packed_from != weight_tag(w):
            self.pack_for_cpu()
        if x.dtype != self.hp_dtype:
            x = x.to(self.hp_dtype)
        return torch.ops.hqtflow.fp8_linear.default(x, w, b["weight_scale"], b["input_scale"], b["bias"], self.packed)

    def gated(self, gate: torch.Tensor, up: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """`self(hp(act(gate) * up))` on the CPU kernel, the input made inside the kernel call (`gated_mlp`); `act` is
        `gated_mlp.act_table(act_fn, dtype)`. For a "cpu" layer with a static input scale or none."""
        b = self._buffers
        w = b["weight"]
        if self._packed_from != weight_tag(w):
            self.pack_for_cpu()
        return torch.ops.hqtflow.fp8_linear_gated.default(gate, up, act, w, b["weight_scale"], b["input_scale"],
                                                          b["bias"], self.packed)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x_fp8 [M, K] (row-major) @ W_fp8^T (a column-major view of the stored [N, K]), scaled in fp32.

        Dynamic per-token activations use row-wise scaling: scale_a [M, 1] (one per token), scale_b [1, N]."""
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        cuda = x2.is_cuda and not torch.compiler.is_compiling()  # inside a compiled step: fused with its neighbours
        static_a, sb = self._float_scales()
        if self.activation == "dynamic_token":
            if self.dynamic_rule is None:
                xq, sa = (fused(quantize_per_token) if cuda else quantize_per_token)(x2, self.fp8)
            else:
                sa = self._dynamic_scale(x2).float().reshape(-1, 1)
                xq = quantize(x2, sa, self.fp8)
        else:
            sa = static_a
            xq = self._shared_quantized(x, x2, sa) if cuda else quantize(x2, sa, self.fp8)
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=sa, scale_b=sb, bias=self.bias, out_dtype=self.hp_dtype,
                             use_fast_accum=self.fast_accum)
        return y.reshape(*shape[:-1], self.out_features)

    def _shared_quantized(self, x: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """CUDA, outside a compiled step: `quantize(x2, scale)`, in a graph (`capturing()`) by one compiled kernel,
        else as `eager_quantizer` says; under `sharing_inputs()` kept on x for the next Linear reading x with an equal
        scale."""
        share = _SHARING.get()
        key = (self._mm_scales.value, self.fp8)
        kept = getattr(x, "_hqtflow_fp8", None) if share else None
        if kept is not None and kept[0] == key and kept[1].shape == x2.shape:
            return kept[1]
        xq = self._cuda_quantizer()(x2, scale, self.fp8)
        if share:
            x._hqtflow_fp8 = (key, xq)
        return xq

    def _cuda_quantizer(self):
        if _CAPTURING.get() or self.eager_quantizer == "compiled":
            return fused(quantize)
        if self.eager_quantizer == "triton":
            from hqtflow.quantize import triton_quantize
            if triton_quantize.available:
                return triton_quantize.quantize
        return quantize

    def _float_scales(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """_scaled_mm's float32 scales: the static input scale [] (None when dynamic) and the weight's, [] or [1, N]
        (row-wise). Cast once and kept while the stored scales are the same tensors at the same version: two casts
        per call were two of a decode step's kernels for every Linear (448 of an 8B model's, on an H100)."""
        w, a = self.weight_scale, self.input_scale if self.activation == "static" else None
        if torch.compiler.is_compiling():  # the eager calls' casts (a compiled step's inputs), else two casts per call
            return self._mm_scales.pair() if self._mm_scales is not None else self._cast_scales(w, a)
        key = (_tensor_tag(w), None if a is None else _tensor_tag(a))
        if self._mm_scales is None or self._mm_scales.key != key:
            new = self._cast_scales(w, a)
            old = self._mm_scales.pair() if self._mm_scales is not None else None
            if old is not None and all(_same_place(o, n) for o, n in zip(old, new)):
                for o, n in zip(old, new):  # new stored values: cast into the tensors graphs captured
                    if o is not None:
                        o.copy_(n)
                new = old
            # else (first call, a device move, a new shape): new tensors
            value = object() if a is None or a.is_meta else float(a)  # one host sync per new scale
            self._mm_scales = _MMScales(key, *new, value)
        return self._mm_scales.pair()

    def _cast_scales(self, w: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        sb = w.float().reshape(()) if w.numel() == 1 and self.activation == "static" else \
            w.float().reshape(1, -1).expand(1, self.out_features).contiguous()
        return None if a is None else a.float().reshape(()), sb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "cpu":
            return self._cpu(x)
        if self.backend == "scaled_mm":
            return self._scaled_mm(x)
        if self.input_scale is not None:
            x = dequantize(quantize(x, self.input_scale, self.fp8), self.input_scale, self.hp_dtype)
        elif self.activation is not None:
            x = self._dynamic_qdq(x)
        y = torch.matmul(x.to(self.hp_dtype), self.dequantized_weight().t())
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        mode = {"static": "W8A8 static", None: "weight-only"}.get(self.activation, f"W8A8 {self.activation}")
        if self.dynamic_rule is not None:
            mode += f" (INC rule: backoff {self.dynamic_rule.backoff}, {self.dynamic_rule.rounding})"
        gran = f"block {self.block_size}" if self.block_size else ("per-channel" if self.per_channel else "per-tensor")
        return f"in={self.in_features}, out={self.out_features}, {self.fp8} {gran} weights, {mode}, bias={self.bias is not None}"


def resolve_backend(backend: str, device: torch.device | str) -> Backend:
    """"auto" -> the fastest backend for `device`; other names are checked and returned."""
    device = torch.device(device)
    backend = parse(Backend, backend, "FP8 backend", BackendError)
    if backend == "auto":
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            return Backend.SCALED_MM
        if device.type == "cpu":
            from hqtflow.quantize import cpu_kernel

            if cpu_kernel.available():
                return Backend.CPU
            import warnings

            from hqtflow.errors import FallbackWarning

            warnings.warn(f"The CPU FP8 kernel could not be built here ({cpu_kernel.build_error()}); FP8 layers run "
                          "on the slower QDQ reference (--backend qdq chooses it and silences this).", FallbackWarning,
                          stacklevel=2)
            return Backend.QDQ
        return Backend.QDQ
    if backend == "cpu":
        from hqtflow.quantize import cpu_kernel

        if not cpu_kernel.available():
            raise BackendError(f"The CPU FP8 kernel could not be built here ({cpu_kernel.build_error()}); "
                             "use --backend qdq.")
    return backend


def set_backend(model: nn.Module, backend: str) -> int:
    """Switch every FP8Linear of `model` to `backend` ("auto" picks per device); returns how many switched.

    Layers the backend cannot run keep the reference path (and are counted out), except that an explicit "scaled_mm"
    is refused (BackendError) when CUDA's `_scaled_mm` would refuse a layer at its first call. With "cpu", the model's
    high-precision Linears whose weights are bf16 values in an fp32 model run on the kernel too (`bf16_linear.py`).
    """
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, FP8Linear)]
    layers = [m for _, m in named]
    if backend == "auto" and layers:
        backend = resolve_backend("auto", layers[0].weight.device)
    elif backend != "auto":
        backend = resolve_backend(backend, "cpu")
        if backend == "scaled_mm":
            for name, mod in named:
                if (why := mod.scaled_mm_refusal()) is not None:
                    raise BackendError(f"--backend scaled_mm cannot run layer {name or 'the model'}: {why} (--backend "
                                       "auto keeps such layers on qdq).")
    n = 0
    for mod in layers:
        use = mod.supports(backend)
        mod.backend = backend if use else "qdq"
        if mod.backend == "cpu":
            mod.pack_for_cpu()
        else:
            mod.packed, mod._packed_from = None, None
        n += use
    if layers:  # the model's high-precision Linears too (an lm_head kept in bf16, computed in fp32), and gated MLPs
        from hqtflow.quantize import bf16_linear, gated_mlp

        bf16_linear.use_kernel(model, backend == "cpu")
        gated_mlp.use_kernel(model, backend == "cpu")
    return n


def compute_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Run `model`'s high-precision parts in `dtype` (e.g. bf16 -> fp32 on CPUs without native bf16): every
    parameter and buffer in the model's current high-precision dtype is cast (FP8 weights and every scale keep
    theirs: a bf16 scale below 2^-14 has no float16 equivalent), and each FP8Linear computes in `dtype`. The same
    model as loading its checkpoint with that dtype."""
    old = next((p.dtype for p in model.parameters() if p.is_floating_point()), dtype)
    if old == dtype:
        return model
    for mod in model.modules():
        for name, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if t is not None and t.dtype == old and not name.endswith("_scale"):
                t.data = t.data.to(dtype)
        if isinstance(mod, FP8Linear):
            mod.hp_dtype = dtype
    if hasattr(model, "config"):
        model.config.dtype = dtype
    return model
