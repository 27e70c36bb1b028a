"""`hqtflow run RECIPE`: measure -> (unify, for a recipe on several cards) -> quantize -> eval, each stage skipped while its artifact is valid and was made
from the same inputs by this hqtflow version (its manifest says so), and redone when an input or the version changed
(the version changes whenever what a stage writes changes)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from hqtflow.errors import ArtifactError, NewerArtifactError


UNIFIED = "measure-unified"  # beside the recipe's measurement: its ranks unified to one, which quantize reads

# settings added after artifacts were written: one recorded without them was made with this default
ADDED_SETTINGS = {"hessians": False, "gptq": False}


def other_version(written) -> str | None:
    """Why an output `written` by another hqtflow version (a manifest's tool.hqtflow, a report's hqtflow) is redone,
    or None when this version wrote it: the version changes whenever what a stage writes changes."""
    from hqtflow import __version__

    if written == __version__:
        return None
    return f"written by hqtflow {written if isinstance(written, str) else '(version unknown)'}, this is {__version__}: redone"


def _newer(written) -> bool:
    from packaging.version import InvalidVersion, Version

    from hqtflow import __version__

    try:
        return isinstance(written, str) and Version(written) > Version(__version__)
    except InvalidVersion:
        return False


def check_not_newer(out: Path, kind: str | None = None, report: dict | None = None) -> None:
    """`run` never replaces what a newer hqtflow wrote (an artifact of a newer schema or version, or such a report):
    redoing it would lose a colleague's newer output."""
    from hqtflow import __version__
    from hqtflow.formats.artifact import MANIFEST, read_manifest

    written = report.get("hqtflow") if report is not None else None
    if kind is not None and (out / MANIFEST).is_file():
        try:
            written = read_manifest(out, kind, verify=False).written_by
        except NewerArtifactError as e:
            raise ArtifactError(f"{e} `hqtflow run` does not replace it: move it away or choose another output "
                                "(nothing was written).") from None
        except ArtifactError:
            return
    if _newer(written):
        raise ArtifactError(f"{out} was written by hqtflow {written}, newer than this {__version__}: `hqtflow run` does "
                            "not replace it; upgrade hqtflow, or move it away (nothing was written).")


ABSENT = "absent"  # a stale reason: no artifact of this kind there yet (nothing to say about it)


def stale(check: Callable[[], str | None]) -> str | None:
    """check(): why an artifact is redone, None when it is current; a manifest recording its inputs in a shape this
    hqtflow does not write (damaged, or another version's) is redone too, not a traceback."""
    try:
        return check()
    except (TypeError, KeyError, AttributeError, ValueError):
        return "its manifest records its inputs in a shape this hqtflow does not read"


def _settings_changed(recorded: dict, current: dict) -> str | None:
    """Which settings a stage ran with differ from `current` (at most three named, recorded -> now), None when none
    does. The recipe file's path is provenance, not a setting (`run smollm2` and `run recipes/smollm2.yaml` read one
    recipe through a symlink or a copy); settings added since an artifact was written count at their defaults."""
    plain = lambda d: {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()  # noqa: E731
                       if k not in ("overwrite", "recipe")}
    was = plain({**{k: v for k, v in ADDED_SETTINGS.items() if k in current}, **recorded})
    now, gone = plain(current), object()
    keys = [k for k in dict.fromkeys([*was, *now]) if was.get(k, gone) != now.get(k, gone)]
    if not keys:
        return None
    short = lambda v: r if len(r := repr(v)) <= 40 else r[:37] + "..."  # noqa: E731
    return "its settings changed (" + ", ".join(f"{k}: {short(was.get(k))} -> {short(now.get(k))}" for k in keys[:3]) \
        + (", ..." if len(keys) > 3 else "") + ")"


def _say_why(stage: str, out, why: str | None, echo: Callable[[str], None]) -> None:
    """Say why `run` redoes a stage whose artifact exists (another version's wrote it, an input changed)."""
    if why not in (None, ABSENT):
        echo(f"{stage}: {out} {'was' if why.startswith('written by') else 'is redone:'} {why}.")


def measurement_is_current(s) -> bool:
    return measurement_stale(s) is None


def measurement_stale(s) -> str | None:
    """Why the measurement at s.output is redone for settings `s` (ABSENT: there is none), None when it is current."""
    from hqtflow import lmeval, models
    from hqtflow.formats.artifact import ArtifactKind, read_manifest, sha256_file
    from hqtflow.measure.run import load_measure_config, resolve_max_length

    try:
        m = read_manifest(Path(s.output), ArtifactKind.MEASUREMENT)
    except ArtifactError:
        return ABSENT
    if why := other_version(m.written_by):
        return why
    model_dir = models.resolve_model(s.model)
    s = resolve_max_length(s, model_dir)  # the manifest records the max_length measured with, not None
    if why := _settings_changed(m.data.get("settings", {}), s.to_json()):
        return why
    if m.raw.get("config") != load_measure_config(s.config).to_dict():
        return "its QUANT_CONFIG changed"
    if not models.same_calibration_model(m.model, models.fingerprint(model_dir)):  # a new chat template alone: current
        return "the model's weights or tokenizer changed"
    for src in m.data["calibration"]["sources"]:
        if src["kind"] == "text" and (not Path(src["path"]).is_file() or sha256_file(Path(src["path"])) != src["sha256"]):
            return f"the calibration text {src['path']} changed"
        if src["kind"] == "lm-eval" and src["files"] != lmeval.task_files(  # (none recorded, by an older hqtflow: redone)
                list(s.tasks), s.include_path, lmeval.task_manager(list(s.include_path), s.data_dir, list(s.tasks))):
            return "its lm-eval tasks' files changed"
    return None


def checkpoint_stale(q, model: str | None) -> str | None:
    """Why the checkpoint at q.output is redone (ABSENT: there is none), None when it is current."""
    from hqtflow import models
    from hqtflow.formats.artifact import ArtifactKind, read_manifest
    from hqtflow.formats.measurement import load_measurement
    from hqtflow.quantize.run import quant_config

    try:
        m = read_manifest(Path(q.output), ArtifactKind.CHECKPOINT)
        meas = load_measurement(q.measurement)
    except ArtifactError:
        return ABSENT
    if why := other_version(m.written_by):
        return why
    if why := _settings_changed(m.data.get("settings", {}), asdict(q)):
        return why
    if m.data.get("source_digest") != meas.digest():
        return "its measurement changed"
    if not models.same_fingerprint(m.model, models.fingerprint(models.resolve_model(model))):  # its chat template too
        return "the model's weights, tokenizer or chat template changed"
    if m.raw.get("config") != quant_config(q).to_dict():
        return "its quantization config changed"
    return None


def unified_is_current(measurement: Path, out: Path) -> bool:
    """`out` is this hqtflow's one-rank unification of every rank of `measurement` as its files are now."""
    from hqtflow.formats.artifact import ArtifactKind, read_manifest, sha256_file
    from hqtflow.formats.measurement import load_measurement

    try:
        m = read_manifest(out, ArtifactKind.MEASUREMENT)
        src = load_measurement(measurement)
    except ArtifactError:
        return False
    made = m.data.get("unified_from") or {}
    files = {f"{s}.json": sha256_file(src.directory / f"{s}.json") for s in src.stems}
    return (not other_version(m.written_by) and m.data["world_size"] == 1 and made.get("files") == files
            and made.get("groups") == [list(range(src.world_size))])


def check_own_output(out: Path, kind: str) -> None:
    """`run` replaces its own artifacts when stale; anything else already at `out` is refused, never clobbered."""
    from hqtflow.formats.artifact import artifact_kind

    if not (out.exists() or out.is_symlink()):
        return
    try:
        found = artifact_kind(out)
    except ArtifactError:
        found = None
    if found != kind:
        raise ArtifactError(f"{out} exists and is not an hqtflow {kind.split('.')[-1]} artifact; `hqtflow run` replaces "
                            "only its own outputs: move it away or choose another output (nothing was written).")


def check_not_anothers(checkpoint: Path, measurement: Path, force: bool = False) -> None:
    """`run` writes `fp8/` and `eval.json` beside the recipe's measurement: a checkpoint there quantized from another
    measurement that still exists is another recipe's (sharing the parent directory), never replaced; with `force`,
    one quantized from a measurement outside that directory is replaced (a copied project records the original's)."""
    from hqtflow.formats.artifact import MANIFEST, ArtifactKind, read_manifest

    if not (checkpoint / MANIFEST).is_file():
        return
    try:
        source = read_manifest(checkpoint, ArtifactKind.CHECKPOINT, verify=False).data.get("source_measurement")
    except ArtifactError:
        return  # a damaged checkpoint is redone
    if isinstance(source, str) and Path(source).is_dir() and Path(source).resolve() != measurement.resolve():
        if force and not Path(source).resolve().is_relative_to(checkpoint.parent.resolve()):
            return
        raise ArtifactError(f"{checkpoint} was quantized from {source}, another recipe's measurement, not from "
                            f"{measurement}: give each recipe an output directory of its own (or, for a copied "
                            "project, --force redoes it from this one's; nothing was written).")


def read_own_report(report: Path) -> dict | None:
    """The report an earlier `run` wrote at `report` (None: there is none); any other file there is refused."""
    if not (report.exists() or report.is_symlink()):
        return None
    try:
        old = json.loads(report.read_text())
    except (OSError, ValueError, RecursionError):
        old = None
    if not isinstance(old, dict) or "checkpoint_digest" not in old:
        raise ArtifactError(f"{report} exists and is not a report of `hqtflow run`; it is never overwritten: move it "
                            "away or choose another output (nothing was written).")
    return old


def absolute_paths(ms):
    """The settings `run` records, with their paths absolute (the output, the recipe file and a model folder), so a
    path spelled otherwise (relative, absolute, `./`) is the same input and no stage is redone for it."""
    model = ms.model
    if model is not None and Path(model).expanduser().exists():  # a folder, not a bundled name or hub id
        model = os.path.abspath(Path(model).expanduser())
    return replace(ms, output=os.path.abspath(ms.output), model=model,
                   recipe=os.path.abspath(ms.recipe) if ms.recipe else None)


def check_recipe(r, ms):
    """Every stage's settings, checked before any stage runs (a later stage's refusal after hours of measuring
    wastes them); a refusal names the recipe key. Returns the model's skeleton when a check built one (quantize
    plans on it), else None."""
    from hqtflow.choices import KVCache
    from hqtflow.errors import CalibrationError, ConfigError
    from hqtflow.measure.run import load_measure_config
    from hqtflow.recipes import kv_cache_for

    skeleton = None

    def checked(key: str, check: Callable[[], object]) -> None:
        try:
            check()
        except (ConfigError, CalibrationError) as e:  # (the same kind, so the same exit status)
            raise type(e)(f"Recipe {r.path}, '{key}': {e}") from None

    ms.validate()
    checked("config", lambda: load_measure_config(ms.config))
    from hqtflow.quantize.run import plan_config

    checked("quant_config", lambda: plan_config(r.quantize.settings(ms.output, ms.output)))
    if kv_cache_for(r) == KVCache.FP8 and r.quantize.kv_cache != KVCache.FP8 and not r.eval.empty:
        raise ConfigError(f"Recipe {r.path}, 'eval.kv_cache': fp8 reads the checkpoint's k/v scales, which only "
                          "`kv_cache: fp8` quantizes: set it, or eval's kv_cache to bf16.")
    if r.quantize.kv_cache == KVCache.FP8 and ms.tp > 1:  # quantize would refuse it after measuring and unifying
        raise ConfigError(f"Recipe {r.path}, 'kv_cache': fp8 takes its k/v scales from KV-cache statistics, which a "
                          f"measurement on several cards ('cards': {ms.tp}) does not record: set cards: 1, or kv_cache: bf16.")
    if r.quantize.kv_cache == KVCache.FP8:  # an attention whose cache is not keys and values (DeepSeek's MLA)
        from hqtflow import models

        skeleton = models.skeleton(models.resolve_model(ms.model))
        models.check_kv_cache(skeleton, f"Recipe {r.path}, 'kv_cache': fp8", "set kv_cache: bf16")
        if kv_cache_for(r) == KVCache.FP8 and r.eval.ppl_file:  # perplexity's FP8StaticCache: full attention only
            from hqtflow.evaluate import bf16_kv_hint
            from hqtflow.runtime.kv_cache import fp8_kv_refusal

            if why := fp8_kv_refusal(skeleton.config, static=("Perplexity's", bf16_kv_hint("eval.kv_cache"))):
                raise ConfigError(f"Recipe {r.path}, 'eval.kv_cache': {why}")
    if r.eval.tasks:
        from hqtflow import lmeval

        ev = r.eval
        checked("eval.tasks", lambda: lmeval.check_tasks(
            list(ev.tasks), lmeval.task_manager(list(ev.include_path), ev.data_dir, list(ev.tasks)), ev.data_dir))
    return skeleton


def run_recipe(recipe: str | Path, *, overrides: dict, force: bool = False, echo: Callable[[str], None] = print,
               data_dir: str | Path | None = None, trust_pickle: bool = False) -> Path:
    """measure -> (unify) -> quantize -> eval of a recipe, each stage skipped when its artifact is current;
    `trust_pickle`: load a model whose weights are only pickles (models.load_model) in every stage."""
    from hqtflow import __version__
    from hqtflow.choices import KVCache
    from hqtflow.eval_run import input_files, run_eval
    from hqtflow.formats.artifact import ArtifactKind, read_manifest, write_json_atomic
    from hqtflow.formats.measurement import KV_FILE
    from hqtflow.measure.run import measure
    from hqtflow.quantize.run import quantize
    from hqtflow.recipes import kv_cache_for, load_recipe, measure_settings, with_data_dir
    from hqtflow.unify import unify

    r = load_recipe(recipe)
    r = with_data_dir(r, data_dir) if data_dir is not None else r
    ms = absolute_paths(measure_settings(r, overrides, overwrite=True))
    skeleton = check_recipe(r, ms)  # the model's, when checking built it (kv_cache: fp8)
    root = Path(ms.output).parent
    # a checkpoint is quantized from one rank: a measurement on several cards is unified to one beside it first
    one_rank = Path(ms.output) if ms.tp == 1 else root / UNIFIED
    for out, kind in ((Path(ms.output), ArtifactKind.MEASUREMENT), (one_rank, ArtifactKind.MEASUREMENT),
                      (root / "fp8", ArtifactKind.CHECKPOINT)):
        check_own_output(out, kind)
        check_not_newer(out, kind)
    check_not_anothers(root / "fp8", one_rank, force)
    if r.eval.ppl_file:  # the eval's inputs are checked before the stages before it run
        from hqtflow.evaluate import read_ppl_text

        read_ppl_text(r.eval.ppl_file, "The recipe's eval.ppl_file")
    if not r.eval.empty and (old := read_own_report(root / "eval.json")) is not None:
        check_not_newer(root / "eval.json", report=old)
    kv_missing = r.quantize.kv_cache == KVCache.FP8 and not (Path(ms.output) / KV_FILE).exists()
    why = None if force else stale(lambda: measurement_stale(ms)) or ("it has no KV-cache statistics" if kv_missing else None)
    if not force and why is None:
        echo(f"measure: {ms.output} is up to date, skipped.")
    else:
        _say_why("measure", ms.output, why, echo)
        echo(f"measure: writing {ms.output}")
        measure(ms, trust_pickle=trust_pickle)
    if one_rank != Path(ms.output):
        if not force and stale(lambda: None if unified_is_current(Path(ms.output), one_rank) else "stale") is None:
            echo(f"unify: {one_rank} is up to date, skipped.")
        else:
            echo(f"unify: writing {one_rank} (ranks 0-{ms.tp - 1} -> 1)")
            unify(ms.output, [f"0-{ms.tp - 1}"], one_rank, overwrite=True)
    qs = r.quantize.settings(str(one_rank), str(root / "fp8"), overwrite=True)
    why = None if force else stale(lambda: checkpoint_stale(qs, ms.model))
    if not force and why is None:
        echo(f"quantize: {qs.output} is up to date, skipped.")
    else:
        _say_why("quantize", qs.output, why, echo)
        echo(f"quantize: writing {qs.output}")
        quantize(qs, trust_pickle=trust_pickle, skeleton=skeleton)
    ev = replace(r.eval, kv_cache=kv_cache_for(r).value)  # recorded: another KV cache redoes the eval
    ev_json = ev.to_json()
    if ev.empty:
        echo("eval: the recipe names no eval tasks and no ppl_file, skipped.")
        return root
    report = root / "eval.json"
    digest = read_manifest(Path(qs.output), ArtifactKind.CHECKPOINT).digest()
    old = read_own_report(report)
    if old is not None and not force:
        why = other_version(old.get("hqtflow", "0.1.0"))  # (a report without it is 0.1.0's, which did not record it)
        if why:
            echo(f"eval: {report} was {why}.")
        elif (old.get("checkpoint_digest") == digest and old.get("eval") == ev_json
              and old.get("files") == input_files(ev.tasks, ev.include_path, ev.data_dir, ev.ppl_file)):
            from hqtflow.evaluate import format_table

            try:
                table = format_table(old["comparison"], list(old["results"]), old["baseline"])
            except (TypeError, KeyError, AttributeError, ValueError):  # not in the shape this hqtflow writes: redone
                table = None
            if table is not None:
                echo(f"eval: {report} is up to date, skipped.")
                echo(table)
                return root
    echo(f"eval: writing {report}")
    tmp = root / ".eval.json.partial"
    tmp.unlink(missing_ok=True)
    table = run_eval(qs.output, baseline=None, use_source=True, **asdict(ev), report=tmp, trust_pickle=trust_pickle,
                     kv_key="eval.kv_cache")
    data = json.loads(tmp.read_text())
    data.update({"checkpoint_digest": digest, "eval": ev_json, "hqtflow": __version__})
    write_json_atomic(report, data, default=str)
    tmp.unlink()
    echo(table)
    return root
