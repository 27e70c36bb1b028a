"""The quantize settings (no heavy imports: the CLI reads its option defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizeSettings:
    measurement: str
    output: str
    model: str | None = None  # default: the model folder recorded in the measurement manifest
    config: str | None = None  # QUANTIZE QUANT_CONFIG; None = maxabs_arbitrary, lm_head kept in bf16
    scale_method: str | None = None
    scales_for: str | None = None  # gaudi2 | gaudi3 | cpu | cuda (HQT's device_for_scales)
    scales_only: bool = False
    weight_only: bool = False
    overwrite: bool = False
    disk_offload: bool = False  # stream weights from the safetensors files; the bf16 model is never in RAM
    gptq: bool = False  # round weights with GPTQ from the measurement's Hessians (`measure --hessians`)
    kv_cache: str = "bf16"  # "fp8": k_scale/v_scale from the measurement's KV statistics in the checkpoint
