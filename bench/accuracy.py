"""Accuracy of FP8 SmolLM2 against bf16 on real data, for every scale method that runs off Gaudi.

Calibration: the first `--calib-chunks` x `--calib-len` tokens of WikiText-2 *valid* (disjoint from every
evaluation text). Evaluation: lm-eval `acc` on the offline copies of lambada_openai, hellaswag, piqa, winogrande and
arc_easy (`--limit` documents each), and WikiText-2 *test* perplexity over disjoint 512-token windows. bf16 and
each method side by side, with Neural Compressor's published CPU figures for the same methods (its deltas; they
come from ../shared/reference/hqt-formats.md, measured with 16x256 calibration tokens and 8 windows).

    python bench/accuracy.py                 # the full table (>= 500 examples per task)
    python bench/accuracy.py --smoke         # a minute-long version (CI runs it)
    python bench/accuracy.py --kl            # mean KL / top-1 vs bf16 per method, hqtflow and INC side by side
    python bench/accuracy.py --kl --gptq     # ... and each method again with GPTQ-rounded weights (quantize --gptq)
    python bench/accuracy.py --kl --calibrations 4   # ... on 4 calibration slices, hqtflow vs INC pair by pair

`--kl`: one hqtflow measurement (`--calib-chunks` x `--calib-len` tokens of WikiText-2 valid) feeds both sides;
each method's mean KL(bf16 || FP8) and top-1 agreement on the first `--kl-tokens` tokens of WikiText-2 test
(512-token windows, `hqtflow.accuracy`), for hqtflow (CPU kernel) and for Neural Compressor 3.10's `convert()`
of the same method from the same measurement (CPU QDQ, lm_head in bf16 on both sides). INC refuses dynamic
quantization on CPU, so its dynamic methods have no figure here; hqtflow's `fp8_dynamic` is not an INC method.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hqtflow import lmeval, models  # noqa: E402
from hqtflow.evaluate import EvalSettings, evaluate  # noqa: E402
from hqtflow.formats.quant_config import QuantConfig  # noqa: E402
from hqtflow.measure.calibration import batches, token_chunks  # noqa: E402
from hqtflow.measure.hooks import ObserverSession  # noqa: E402
from hqtflow.quantize.convert import convert_model  # noqa: E402
from hqtflow.scales import scale_method  # noqa: E402

TASKS = ["lambada_openai_local", "hellaswag_local", "piqa_local", "winogrande_local", "arc_easy_local"]
METHODS = ["maxabs_arbitrary", "maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2",
           "act_maxabs_pow2_weights_pcs_opt_pow2", "maxabs_hw", "unit_scale"]
# Neural Compressor 3.10 on CPU (use_qdq), SmolLM2 bf16 ppl 19.148 on its own 8 windows: relative ppl change.
INC_PPL_DELTA = {"maxabs_arbitrary": 1.9, "maxabs_pow2": 5.4, "act_maxabs_pow2_weights_pcs_maxabs_pow2": 4.9,
                 "unit_scale": 7.6, "maxabs_hw": None, "act_maxabs_pow2_weights_pcs_opt_pow2": None}


def calibrate(model, tok, data: Path, chunks: int, length: int, batch: int):
    session = ObserverSession(model, QuantConfig(mode="MEASURE"))
    ids = token_chunks([data.read_text()], tok, length, chunks)
    device = next(model.parameters()).device
    with torch.inference_mode():
        for b in batches(ids, batch):
            with session.batch(b.attention_mask):
                model(input_ids=b.input_ids.to(device), attention_mask=b.attention_mask.to(device))
    session.close()
    from hqtflow.formats.measurement import Measurement

    return Measurement(session.stats(), None, session.samples, "DynamicRange")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the prepared SmolLM2)")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--limit", type=int, default=500)
    p.add_argument("--ppl-windows", type=int, default=64)
    p.add_argument("--calib-chunks", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny limits: a check that the bench runs")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--kl", action="store_true", help="the KL / top-1 table instead of lm-eval and perplexity")
    p.add_argument("--kl-tokens", type=int, default=8192)
    p.add_argument("--calibrations", type=int, default=1,
                   help="--kl: repeat on this many calibration slices of WikiText-2 valid and compare hqtflow with "
                        "INC pair by pair (KL moves by a few percent with sub-ulp scale changes)")
    p.add_argument("--checkpoint", action="append", default=[],
                   help="--kl: also an FP8 checkpoint made elsewhere (e.g. by `hqtflow tune`); repeatable")
    p.add_argument("--gptq", action="store_true",
                   help="--kl: measure with --hessians and add each method with GPTQ-rounded weights (`quantize --gptq`)")
    p.add_argument("--backend", default="auto", choices=("auto", "qdq", "cpu", "scaled_mm"),
                   help="--kl: hqtflow's FP8 backend (qdq is Neural Compressor's arithmetic; auto the fastest here)")
    a = p.parse_args()
    if a.kl:
        return kl_table(a)
    if a.smoke:
        a.limit, a.ppl_windows, a.calib_chunks = 4, 1, 2
        a.methods, a.tasks = "maxabs_arbitrary", "piqa_local,winogrande_local"
    data = Path(a.data_dir)
    path = models.resolve_model(a.model)
    tok = models.load_tokenizer(path)
    bf16 = models.load_model(path, "bf16").to(a.device)
    from hqtflow.hardware import machine_line

    print(f"model {path.name}, device {a.device}, torch {torch.__version__}, threads {torch.get_num_threads()}; "
          f"{machine_line()}")
    tasks = [t for t in a.tasks.split(",") if t]
    manager = lmeval.task_manager([], data, tasks)
    settings = EvalSettings(tasks=tuple(tasks), limit=a.limit, batch_size=a.batch_size,
                            ppl_file=str(data / "wikitext2_test.txt"), ppl_windows=a.ppl_windows)
    t0 = time.perf_counter()
    meas = calibrate(bf16, tok, data / "wikitext2_valid.txt", a.calib_chunks, a.calib_len, a.batch_size)
    results = {"bf16": evaluate(bf16, tok, settings, manager)}
    names = [n for n, m in bf16.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    for method in a.methods.split(","):
        fp8 = copy.deepcopy(bf16)
        with torch.no_grad():
            convert_model(fp8, names, meas, scale_method(method, "cpu"), target="cpu", fp8="E4M3", hp_dtype="bf16")
        results[method] = evaluate(fp8, tok, settings, manager)
        del fp8
        print(f"  {method} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(results, tasks, a)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))


KL_METHODS = ["maxabs_arbitrary", "maxabs_pow2", "act_maxabs_pow2_weights_pcs_maxabs_pow2", "fp8_dynamic", "fp8_dynamic_mse",
              "maxabs_pcs_pow2", "act_maxabs_pcs_pow2_weight_maxabs_pts_pow2_hw"]


def kl_table(a) -> None:
    import platform
    import shutil
    import tempfile

    from hqtflow.accuracy import divergence, log_probs, token_windows
    from hqtflow.measure.run import MeasureSettings, measure
    from hqtflow.quantize.fp8_linear import set_backend
    from hqtflow.quantize.run import QuantizeSettings, quantize_in_memory
    from hqtflow.scales import DYNAMIC_METHODS

    data = Path(a.data_dir)
    path = models.resolve_model(a.model)
    methods = [m for m in (a.methods.split(",") if a.methods != ",".join(METHODS) else KL_METHODS) if m]
    flags = sorted({f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
                    if f in Path("/proc/cpuinfo").read_text()}) if Path("/proc/cpuinfo").exists() else []
    print(f"model {path.name}, torch {torch.__version__}, {platform.machine()} CPU flags {flags}, "
          f"threads {torch.get_num_threads()}, hqtflow backend {a.backend}")
    tmp = Path(tempfile.mkdtemp(prefix="hqtflow-kl-"))
    rows: dict[str, dict] = {}
    try:
        tok = models.load_tokenizer(path)
        windows = token_windows(tok, data / "wikitext2_test.txt", a.kl_tokens, 512)
        ref = log_probs(models.load_model(path, "bf16"), windows)
        for c, calib in enumerate(calibration_slices(data / "wikitext2_valid.txt", a.calibrations, tmp)):
            tag = f" [calibration {c}]" if a.calibrations > 1 else ""
            meas = measure(MeasureSettings(output=str(tmp / f"meas{c}"), model=str(path), text=(str(calib),),
                                           limit=a.calib_chunks, max_length=a.calib_len, batch_size=a.batch_size,
                                           hessians=a.gptq), show_progress=False)
            for method in methods:
                model, _ = quantize_in_memory(QuantizeSettings(measurement=str(meas), output="-", scale_method=method))
                set_backend(model, a.backend)
                ours = divergence(ref, model, windows)
                del model
                theirs = None
                if method not in DYNAMIC_METHODS:
                    from neural_compressor.torch import quantization as inc

                    work = tmp / f"inc{c}-{method}"
                    shutil.copytree(meas, work)
                    cfg = inc.FP8Config(mode="QUANTIZE", observer="maxabs", scale_method=method, use_qdq=True,
                                        dump_stats_path=str(work / "measure"), blocklist={"names": ["lm_head"]})
                    qmodel = inc.convert(models.load_model(path, "bf16"), cfg)
                    theirs = divergence(ref, qmodel, windows)
                    del qmodel
                rows[method + tag] = {"hqtflow": ours.as_dict(), "inc": theirs.as_dict() if theirs else None,
                                      "method": method, "calibration": c}
                print(f"  {method}{tag}: hqtflow KL {ours.mean_kl:.5f} top-1 {ours.top1:.4f}; INC "
                      + (f"KL {theirs.mean_kl:.5f} top-1 {theirs.top1:.4f}" if theirs else "n/a"), flush=True)
                if a.gptq:  # the same method, weights rounded by GPTQ; INC has no such rounding
                    model, _ = quantize_in_memory(QuantizeSettings(measurement=str(meas), output="-",
                                                                   scale_method=method, gptq=True))
                    set_backend(model, a.backend)
                    g = divergence(ref, model, windows)
                    del model
                    rows[f"{method} + gptq{tag}"] = {"hqtflow": g.as_dict(), "inc": theirs.as_dict() if theirs else None,
                                                     "method": f"{method} + gptq", "calibration": c}
                    print(f"  {method} + gptq{tag}: hqtflow KL {g.mean_kl:.5f} top-1 {g.top1:.4f}", flush=True)
        for ckpt in a.checkpoint:
            import hqtflow

            model, _ = hqtflow.load(ckpt, backend=a.backend, dtype="bf16")
            ours = divergence(ref, model, windows)
            del model
            rows[f"checkpoint {ckpt}"] = {"hqtflow": ours.as_dict(), "inc": None}
            print(f"  {ckpt}: hqtflow KL {ours.mean_kl:.5f} top-1 {ours.top1:.4f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = sum(w.shape[1] for w in windows)
    print(f"\nmean KL(bf16 || FP8) and top-1 agreement on {n} tokens of WikiText-2 test; calibration "
          f"{a.calib_chunks} x {a.calib_len} tokens of WikiText-2 valid"
          + (f" ({a.calibrations} slices)" if a.calibrations > 1 else "") + "; lm_head bf16")
    head = ["method", "hqtflow KL", "hqtflow top-1", "INC KL", "INC top-1", "KL ratio hqtflow/INC"]
    table = [head]
    for m, r in rows.items():
        h, i = r["hqtflow"], r["inc"]
        table.append([m, f"{h['mean_kl']:.5f}", f"{h['top1']:.4f}", "n/a" if i is None else f"{i['mean_kl']:.5f}",
                      "n/a" if i is None else f"{i['top1']:.4f}", "n/a" if i is None else f"{h['mean_kl'] / i['mean_kl']:.3f}"])
    print_columns(table)
    summary = paired_summary(rows) if a.calibrations > 1 else []
    if summary:
        print(f"\nover the {a.calibrations} calibration slices (paired: the same measurement feeds both sides)")
        print_columns([["method", "mean hqtflow KL", "mean INC KL", "ratio of means", "per-slice ratios",
                        "hqtflow lower in"], *summary])
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tokens": n, "results": rows}, indent=2))


def calibration_slices(valid: Path, n: int, tmp: Path) -> list[Path]:
    """Calibration texts: the whole file, then (for n > 1) the file from the line after each j/n of its length.

    Slice 0 is the calibration of a single run; the others start at other paragraphs, so each measurement sees
    different first `--calib-chunks` windows."""
    if n <= 1:
        return [valid]
    text = valid.read_text()
    out = []
    for j in range(n):
        start = text.find("\n", j * len(text) // n) + 1 if j else 0
        out.append(tmp / f"calib{j}.txt")
        out[-1].write_text(text[start:])
    return out


def paired_summary(rows: dict) -> list[list[str]]:
    """Per method with an INC figure: mean KL of each side over the slices, and the per-slice ratios."""
    by_method: dict[str, list[tuple[float, float]]] = {}
    for r in rows.values():
        if r.get("inc") is not None and "calibration" in r:
            by_method.setdefault(r["method"], []).append((r["hqtflow"]["mean_kl"], r["inc"]["mean_kl"]))
    out = []
    for method, pairs in by_method.items():
        ours, theirs = (sum(x) / len(pairs) for x in zip(*pairs))
        ratios = [h / i for h, i in pairs]
        out.append([method, f"{ours:.5f}", f"{theirs:.5f}", f"{ours / theirs:.3f}",
                    f"{min(ratios):.3f}-{max(ratios):.3f}", f"{sum(h < i for h, i in pairs)} of {len(pairs)}"])
    return out


def print_columns(table: list[list[str]]) -> None:
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def print_table(results: dict, tasks: list[str], a) -> None:
    base = results["bf16"]
    short = [t.replace("_local", "").replace("_openai", "") for t in tasks]
    head = ["method", "mean acc", "Δ pts", *short, "wikitext ppl", "Δ ppl", "INC Δ ppl"]
    rows = [head]
    bmean = sum(base["tasks"][t]["acc"] for t in tasks) / len(tasks)
    bppl = base["wikitext"]["perplexity"]
    for name, r in results.items():
        mean = sum(r["tasks"][t]["acc"] for t in tasks) / len(tasks)
        ppl = r["wikitext"]["perplexity"]
        inc = INC_PPL_DELTA.get(name)
        rows.append([name, f"{mean:.4f}", "-" if name == "bf16" else f"{100 * (mean - bmean):+.2f}",
                     *[f"{r['tasks'][t]['acc']:.3f}" for t in tasks], f"{ppl:.3f}",
                     "-" if name == "bf16" else f"{100 * (ppl - bppl) / bppl:+.2f}%",
                     "-" if name == "bf16" else ("n/a" if inc is None else f"+{inc:.1f}%")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    print(f"\nlimit {a.limit} docs/task, {base['wikitext']['windows']} x 512-token windows, calibration "
          f"{a.calib_chunks} x {a.calib_len} tokens of wikitext2_valid; Δ pts = mean acc change in points")
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


if __name__ == "__main__":
    main()
