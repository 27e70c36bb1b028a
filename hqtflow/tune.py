"""`hqtflow tune`: which Linear layers to keep in bf16 so that the FP8 model stays close enough to bf16.

1. Sensitivity: on calibration text (the first `tokens` tokens of `--text`, in windows), the mean KL of the
   next-token distribution vs bf16 (`hqtflow.accuracy`) with just that one layer quantized (the QUANT_CONFIG's
   scale method, per-layer rules included), every other layer bf16. The model runs in the fastest
   high-precision dtype here (`hqtflow.hardware`): a bf16 model on a CPU without native bf16 dot products is upcast
   to fp32 (exactly) for these passes, several times faster there; the checkpoint is still made from the stored weights.
2. Selection: all selected layers quantized; then the most sensitive layers go back to bf16 one at a time (the
   whole model re-measured each time) until the mean KL <= `target_kl` and/or the perplexity on the same text is
   at most `max_ppl_increase` (relative, 0.01 = +1%) above bf16's: the smallest such prefix of the sensitivity
   order. If no prefix meets the targets, tune says so and writes nothing.
3. Output: `quant_config.json`, the input QUANT_CONFIG with the kept layers added to `blocklist.names` as
   anchored regexes (`^name$`), which Neural Compressor's FP8Config accepts as is, so Gaudi runs the same mix;
   `sensitivity.json` (per layer KL, the chosen set, before/after figures); `checkpoint/`, the FP8 checkpoint
   `hqtflow quantize` makes from that config; an `hqtflow.tune` manifest, written last.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from hqtflow.errors import CalibrationError, ConfigError
from hqtflow.formats.artifact import ArtifactKind



@dataclass(frozen=True)
class TuneSettings:
    measurement: str
    output: str
    text: str
    model: str | None = None
    config: str | None = None  # QUANT_CONFIG (default: hqtflow quantize's default, maxabs_arbitrary)
    scale_method: str | None = None
    target_kl: float | None = None
    max_ppl_increase: float | None = None  # relative: 0.01 = +1%
    tokens: int = 1024
    window: int = 256
    gptq: bool = False  # GPTQ-rounded weights (the measurement's Hessians), as `quantize --gptq`
    overwrite: bool = False

    def __post_init__(self):
        if self.target_kl is None and self.max_ppl_increase is None:
            raise ConfigError("tune needs a target: --target-kl and/or --max-ppl-increase.")
        for name in ("target_kl", "max_ppl_increase"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, not {v}.")
        if self.window < 2:
            raise ConfigError(f"--window must be >= 2, not {self.window}.")
        if self.tokens < self.window:
            raise ConfigError(f"--tokens ({self.tokens}) must be at least one window (--window {self.window}).")


def _ppl(nll: float) -> float:
    import math

    return math.exp(nll)


def _meets(s: TuneSettings, d, base_nll: float) -> bool:
    ok = True
    if s.target_kl is not None:
        ok &= d.mean_kl <= s.target_kl
    if s.max_ppl_increase is not None:
        ok &= _ppl(d.nll) <= _ppl(base_nll) * (1 + s.max_ppl_increase)
    return ok


def tune(s: TuneSettings, progress=None, *, trust_pickle: bool = False) -> Path:
    """Per-layer sensitivity, then the fewest layers kept in high precision that meet the target: the tune artifact
    (`trust_pickle`: load a model whose weights are only pickles, models.load_model)."""
    import torch

    from hqtflow import models
    from hqtflow.accuracy import divergence, log_probs, token_windows
    from hqtflow.formats.artifact import check_output_dir, staged_output, write_manifest
    from hqtflow.hardware import fastest_dtype
    from hqtflow.quantize.convert import _set_module, convert_model
    from hqtflow.quantize.experts import unfuse_experts
    from hqtflow.quantize.run import QuantizeSettings, plan_job, quant_config, quantize, weight_rounding

    out = Path(s.output)
    check_output_dir(out, s.overwrite, [s.measurement, s.config])
    qs = QuantizeSettings(measurement=s.measurement, output=str(out / "checkpoint"), model=s.model, config=s.config,
                          scale_method=s.scale_method, gptq=s.gptq)
    job = plan_job(qs, trust_pickle=trust_pickle)
    cfg = quant_config(qs)
    say = progress or (lambda msg: None)
    compute = fastest_dtype() if job.dtype == "bf16" else job.dtype
    tok = models.load_tokenizer(job.model_dir)
    windows = token_windows(tok, s.text, s.tokens, s.window, "--text")  # refused before the model is loaded
    if not windows:
        raise CalibrationError(f"--text {s.text} has fewer than {s.window} tokens (one --window).")
    model = models.load_model(job.model_dir, compute, trust_pickle=trust_pickle)
    unfuse_experts(model, job.plan["unfused"])
    ref = log_probs(model, windows)
    base_nll = _reference_nll(ref, windows)
    names = list(job.plan["quantize"])
    originals = {n: model.get_submodule(n) for n in names}
    rounding = weight_rounding(job, show_progress=False)
    quantized, sensitivity = {}, {}
    with torch.no_grad():
        for i, name in enumerate(names):
            convert_model(model, [name], job.meas.ranks[0], job.method, target=job.target, fp8=cfg.fp8_config,
                          hp_dtype=cfg.hp_dtype, round_weight=rounding)
            sensitivity[name] = divergence(ref, model, windows).mean_kl
            quantized[name] = model.get_submodule(name)  # kept: the full model reuses it
            _set_module(model, name, originals[name])
            say(f"sensitivity {i + 1}/{len(names)} {name}: KL {sensitivity[name]:.5f}")
        order = sorted(names, key=lambda n: -sensitivity[n])
        for name in names:
            _set_module(model, name, quantized[name])
        d = divergence(ref, model, windows)
        full = d
        kept: list[str] = []
        while not _meets(s, d, base_nll):
            if len(kept) == len(order):
                raise ConfigError(f"No set of bf16 layers meets the target (bf16 perplexity {_ppl(base_nll):.3f}); "
                                  "even with every layer in bf16 the check failed.")
            kept.append(order[len(kept)])
            _set_module(model, kept[-1], originals[kept[-1]])
            d = divergence(ref, model, windows)
            say(f"kept {len(kept)} in bf16: KL {d.mean_kl:.5f}, ppl {_ppl(d.nll):.3f}")
    raw = cfg.to_dict()
    raw["blocklist"] = {"types": list(cfg.blocklist.types),
                        "names": list(cfg.blocklist.names) + [f"^{re.escape(n)}$" for n in kept]}
    raw.pop("dump_stats_path", None)
    report = {"target_kl": s.target_kl, "max_ppl_increase": s.max_ppl_increase, "text": str(Path(s.text).resolve()),
              "tokens": sum(w.shape[1] for w in windows), "window": s.window, "compute_dtype": compute,
              "bf16_ppl": _ppl(base_nll), "all_quantized": {**full.as_dict(), "ppl": _ppl(full.nll)},
              "tuned": {**d.as_dict(), "ppl": _ppl(d.nll)}, "kept_bf16": kept,
              "weight_rounding": "gptq" if s.gptq else "nearest",
              "linear_layers": len(names), "sensitivity": dict(sorted(sensitivity.items(), key=lambda kv: -kv[1]))}
    with staged_output(out, overwrite=s.overwrite, inputs=[s.measurement, s.config]) as tmp:
        (tmp / "quant_config.json").write_text(json.dumps(raw, indent=2))
        (tmp / "sensitivity.json").write_text(json.dumps(report, indent=2))
        quantize(QuantizeSettings(measurement=s.measurement, output=str(tmp / "checkpoint"), model=s.model,
                                  config=str(tmp / "quant_config.json"), gptq=s.gptq), trust_pickle=trust_pickle)
        write_manifest(tmp, ArtifactKind.TUNE, model=job.fingerprint, config=raw,
                       data={**{k: v for k, v in report.items() if k != "sensitivity"}, "settings": asdict(s)})
    return out


def _reference_nll(ref, windows) -> float:
    """bf16's mean negative log-likelihood of each window's next tokens."""
    total, n = 0.0, 0
    for lp, w in zip(ref, windows):
        tgt = w[0, 1:]
        total -= float(lp[:-1].gather(-1, tgt[:, None]).sum())
        n += tgt.numel()
    return total / n


def summary(out: Path) -> str:
    r = json.loads((Path(out) / "sensitivity.json").read_text())
    t, a = r["tuned"], r["all_quantized"]
    return (f"Wrote {out}: {len(r['kept_bf16'])} of {r['linear_layers']} Linear layers kept in bf16; mean KL "
            f"{a['mean_kl']:.5f} -> {t['mean_kl']:.5f}, ppl {a['ppl']:.3f} -> {t['ppl']:.3f} (bf16 {r['bf16_ppl']:.3f}) "
            f"on {r['tokens']} tokens; QUANT_CONFIG in quant_config.json, checkpoint in checkpoint/.")


def sensitivity_chart(path: str | Path, top: int = 20) -> tuple[dict, str]:
    """`hqtflow inspect` of a tune artifact: (the report, a text bar chart of the `top` most sensitive layers)."""
    from hqtflow.formats.artifact import read_manifest

    path = Path(path)
    read_manifest(path, ArtifactKind.TUNE)
    r = json.loads((path / "sensitivity.json").read_text())
    items = list(r["sensitivity"].items())[:top]
    kept = set(r["kept_bf16"])
    hi = max((v for _, v in items), default=0.0) or 1.0
    width = max((len(n) for n, _ in items), default=4)
    lines = [f"tune artifact {path.resolve()}", "",
             f"  bf16 ppl {r['bf16_ppl']:.3f}; all quantized: KL {r['all_quantized']['mean_kl']:.5f}, "
             f"top-1 {r['all_quantized']['top1']:.4f}, ppl {r['all_quantized']['ppl']:.3f}",
             f"  tuned ({len(kept)} of {r['linear_layers']} Linear layers in bf16): KL {r['tuned']['mean_kl']:.5f}, "
             f"top-1 {r['tuned']['top1']:.4f}, ppl {r['tuned']['ppl']:.3f}", "",
             f"Sensitivity (mean KL vs bf16 with only that layer quantized), top {len(items)}; * = kept in bf16:"]
    for n, v in items:
        lines.append(f"  {'*' if n in kept else ' '} {n.ljust(width)}  {v:.6f}  {'#' * max(1, round(40 * v / hi))}")
    return {"artifact": str(path.resolve()), "kind": "tune", **r}, "\n".join(lines)
