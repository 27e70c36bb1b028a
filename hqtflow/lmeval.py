"""lm-eval integration: an `lm_eval` LM backed by an already-loaded model, and task resolution.

The LM batches requests itself with right padding and an attention mask, so the caller knows exactly which
positions are padding (the measurement stage must not observe them) and sees every forward it runs.
Offline copies of common tasks ship as `<task>_local` YAMLs that read `--data-dir` (e.g. ../shared/data).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from hqtflow.errors import CalibrationError, not_a_directory, not_a_file
from hqtflow.task_yaml import is_task_file, load_task_yaml, task_yaml_files

TASKS_DIR = Path(__file__).parent / "tasks"
LOCAL_TASKS = tuple(sorted(p.stem for p in TASKS_DIR.glob("*.yaml")))

# forward(input_ids [B, S], attention_mask [B, S]) -> logits [B, S, V]
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# progress(samples, tokens) after each forward
Progress = Callable[[int, int], None]


def local_task_dir(data_dir: str | Path) -> Path:
    """Write the bundled `<task>_local` YAMLs, pointed at `data_dir`, into a temp include path."""
    given = Path(data_dir)
    if not given.is_dir():
        raise CalibrationError(f"Data directory {given} {not_a_directory(given)}.")
    data_dir = given.resolve()
    out = Path(tempfile.mkdtemp(prefix="hqtflow-tasks-"))
    atexit.register(shutil.rmtree, out, True)  # lm-eval reads it until the command ends
    for p in TASKS_DIR.glob("*.yaml"):
        (out / p.name).write_text(p.read_text().replace("{data_dir}", str(data_dir)))
    return out


def local_data_file(task: str, data_dir: str | Path) -> tuple[Path, list[str]]:
    """The data file a bundled `<task>_local` YAML reads from `data_dir`, and the record fields its templates use."""
    text = (TASKS_DIR / f"{task}.yaml").read_text()
    name = re.search(r"\{data_dir\}/([^\"\s]+)", text)[1]
    fields = re.findall(r"\{\{\s*(?:'[^']*'\s*\+\s*)?(\w+)\s*\}\}", text)
    return Path(data_dir) / name, sorted(set(fields))


def record_problem(doc: dict) -> str | None:
    """What is wrong with a bundled task's record (None: nothing): texts are strings, the choices a non-empty list
    of strings, `gold` an index into them."""
    for f in ("query", "context", "continuation"):
        if f in doc and not isinstance(doc[f], str):
            return f"has a {f!r} that is not a string"
    options = next((doc[f] for f in ("choices", "context_options") if f in doc), None)
    if options is not None and (not isinstance(options, list) or not options
                                or not all(isinstance(o, str) for o in options)):
        return "has choices that are not a non-empty list of strings"
    gold = doc.get("gold")
    if options is not None and "gold" in doc and (type(gold) is not int or not 0 <= gold < len(options)):
        return f"has gold {gold!r}, not the index of one of its {len(options)} choices"
    return None


def check_local_data(task: str, data_dir: str | Path) -> None:
    """Refuse a bundled task's data file that is missing, empty, not UTF-8 JSON lines, or lacks a field it uses."""
    path, fields = local_data_file(task, data_dir)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        why = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"cannot be read ({e.strerror})"
        raise CalibrationError(f"Data file {path} of task {task} {why}.") from None
    records = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):
            doc = None
        missing = [f for f in fields if f not in doc] if isinstance(doc, dict) else None
        if missing is None or missing:
            what = f"has no field {missing[0]!r}" if missing else "is not a JSON object"
            raise CalibrationError(f"Data file {path} of task {task}: line {n} {what} (a record needs "
                                   f"{', '.join(fields)}).")
        wrong = record_problem(doc)
        if wrong:
            raise CalibrationError(f"Data file {path} of task {task}: line {n} {wrong}.")
        records += 1
    if not records:
        raise CalibrationError(f"Data file {path} of task {task} is empty.")


def task_manager(include_paths: list[str | Path], data_dir: str | Path | None, tasks: list[str] = ()):
    """An lm-eval TaskManager that also knows the user's include paths and the local tasks (a task YAML given by path is
    read by itself, as lm-eval's CLI reads it: its folder is no include path).

    lm-eval's ~14k built-in task YAMLs take seconds to index: when every task named (a group YAML's members too) is
    found in the include paths and local tasks alone, the built-ins are left out.
    """
    from lm_eval.tasks import TaskManager

    for p in map(Path, include_paths):
        if not p.is_dir():
            raise CalibrationError(f"lm-eval include path {p} {not_a_directory(p)}; give the folder of its task YAMLs.")
    for f in map(Path, filter(is_task_file, tasks)):
        if not f.is_file():
            raise CalibrationError(f"lm-eval task file {f} {not_a_file(f)}.")
    configs = _task_configs(tasks)
    groups = [Path(f).parent for f, cfg in configs.items() if "group" in cfg]  # (run_tasks: a group goes by name)
    paths = []
    for p in [*map(Path, include_paths), *groups]:  # each once (a folder indexed twice warns of every task)
        if p.resolve() not in [q.resolve() for q in paths]:
            paths.append(p)
    if data_dir is not None:
        paths.append(local_task_dir(data_dir))
    named = [n for t in tasks for n in ([t] if t not in configs else _group_members(configs[t]))]
    if tasks:
        small = TaskManager(include_path=[str(p) for p in paths] or None, include_defaults=False)
        if all(t in small.all_tasks for t in named):
            small.hqtflow_configs = configs
            return small
    manager = TaskManager(include_path=[str(p) for p in paths] or None)
    manager.hqtflow_configs = configs
    return manager


def _task_configs(tasks) -> dict[str, dict]:
    """{path: config (its `include:`s merged, its `!function`s left as paths)} of each task YAML given by path."""
    configs = {}
    for t in filter(is_task_file, tasks):
        try:
            cfg = load_task_yaml(t, resolve_functions=False)
        except Exception as e:  # noqa: BLE001 (yaml's, an include's OSError, lm-eval's ValueError)
            raise CalibrationError(f"lm-eval task file {t} cannot be read: {str(e)[:300]}") from None
        if not isinstance(cfg.get("group") if "group" in cfg else cfg.get("task"), str):
            raise CalibrationError(f"lm-eval task file {t} defines no task (a task YAML names it with `task:`, a "
                                   "group YAML with `group:`).")
        configs[t] = cfg
    return configs


def _group_members(cfg: dict) -> list[str]:
    """The tasks a group YAML's `task:` list names (none for a task YAML, or a member defined inline)."""
    if "group" not in cfg:
        return []
    items = cfg.get("task") or []
    return [i for i in (items if isinstance(items, list) else [items]) if isinstance(i, str)]


def _configs(manager) -> dict[str, dict]:
    return getattr(manager, "hqtflow_configs", None) or {}


def _walk_tasks(root: Path) -> list[Path]:
    """The task YAMLs and modules under an include path, as lm-eval indexes it, less hidden folders and virtualenvs'
    (a `.venv`, a `site-packages`: lm-eval's own ~14k YAMLs would be hashed for every stage)."""
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("site-packages", "__pycache__")
                         and not (Path(top) / d / "pyvenv.cfg").is_file())
        found += [Path(top) / n for n in names if n.endswith((".yaml", ".yml", ".py"))]
    return sorted(found)


def task_files(tasks: list[str], include_paths, manager) -> dict[str, str | None]:
    """What lm-eval reads for `tasks` ({absolute path: sha256}, None where the file is not there), for `run` to redo a
    stage when one changed: every task YAML and Python module (`!function`) in the include paths (hidden and virtualenv
    folders left out), each task YAML given by path with its `include:` chain and `!function` modules (not its
    folder), the bundled `<task>_local` YAMLs used, and the `dataset_kwargs.data_files` of every task run (a group's or
    tag's members too; a bundled task's data file in --data-dir)."""
    import glob

    from hqtflow.formats.artifact import sha256_file

    index = manager.task_index
    files = [f for root in map(Path, include_paths) for f in _walk_tasks(root)]
    files += [f for t in tasks if is_task_file(t) for f in task_yaml_files(t)]
    for task in dict.fromkeys(t for name in task_names(tasks, manager) for t in _members(name, index, manager)):
        if task in LOCAL_TASKS:
            files.append(TASKS_DIR / f"{task}.yaml")
        for f in _data_files(manager, task):
            files += map(Path, sorted(glob.glob(f)) or [f])
    return {str(f.resolve()): sha256_file(f) if f.is_file() else None
            for f in dict.fromkeys(files) if "__pycache__" not in f.parts}


def _members(name: str, index, manager=None, seen: frozenset = frozenset()) -> list[str]:
    """The tasks lm-eval runs for `name`: a group's or tag's members (through nested groups), else the task itself."""
    given = _given_config(manager, name)
    entry = index.get(name)
    kind = "GROUP" if given is not None and "group" in given else \
        None if given is not None else getattr(getattr(entry, "kind", None), "name", None)
    if kind == "GROUP":
        items = (given if given is not None else entry.cfg or {}).get("task") or []
        names = [i.get("task") if isinstance(i, dict) else i for i in (items if isinstance(items, list) else [items])]
    elif kind == "TAG":
        names = sorted(entry.tags)
    else:
        return [name]
    return [t for n in names if isinstance(n, str) and n not in seen
            for t in _members(n, index, manager, seen | {name})]


def _given_config(manager, name: str) -> dict | None:
    """The config of the task YAML given by path that defines `name` (None: none does)."""
    return next((c for c in _configs(manager).values() if (c.get("group") or c.get("task")) == name), None)


def task_names(tasks: list[str], manager) -> list[str]:
    """lm-eval's names of `tasks`: a task YAML given by path is named by the task (or group) it defines."""
    configs = _configs(manager)
    configs = {**_task_configs([t for t in tasks if t not in configs]), **configs}
    return [(configs[t].get("group") or configs[t]["task"]) if t in configs else t for t in tasks]


def check_tasks(tasks: list[str], manager, data_dir: str | Path | None) -> None:
    given = {task_names([t], manager)[0] for t in tasks if is_task_file(t)}
    tasks = task_names(tasks, manager)
    known = set(manager.all_tasks) | given
    for t in tasks:
        if t in known:
            continue
        hint = ""
        if t in LOCAL_TASKS and data_dir is None:
            raise CalibrationError(f"The bundled task {t!r} reads local data: pass --data-dir, e.g. ../shared/data.")
        elif f"{t}_local" in LOCAL_TASKS:
            hint = f" (no hub access here? use the offline copy '{t}_local' with --data-dir)"
        else:
            hint = " (define it in a task YAML and pass --include-path DIR, or give the YAML's path)"
        raise CalibrationError(f"Unknown lm-eval task {t!r}{hint}.")
    for t in tasks:
        if t in LOCAL_TASKS and data_dir is not None:
            check_local_data(t, data_dir)
        for yaml_file in _task_yamls(t, manager):
            check_task_keys(yaml_file)
            check_functions(yaml_file)
        for f in _data_files(manager, t):  # before the model loads (run_tasks still catches what this misses)
            if Path(f).is_absolute() and not any(c in f for c in "*?[") and not Path(f).is_file():
                raise CalibrationError(f"The data file {f} of lm-eval task {t} does not exist.")


def _task_yamls(name: str, manager) -> list[str]:
    """The task YAMLs lm-eval loads for the task, group or tag `name` (given by path, or indexed by lm-eval)."""
    given = [path for path, cfg in _configs(manager).items() if (cfg.get("group") or cfg.get("task")) == name]
    index = getattr(manager, "task_index", None) or {}
    indexed = [getattr(index.get(t), "yaml_path", None) for t in _members(name, index, manager)]
    return list(dict.fromkeys(given + [str(p) for p in indexed if p is not None]))


def check_task_keys(yaml_file: str) -> None:
    """A task YAML's keys and `output_type` as lm-eval's TaskConfig takes them, checked before the model loads (lm-eval
    raises a TypeError or ValueError from deep inside once it builds the task). Groups and Python tasks (`class:`)
    are lm-eval's to check."""
    import dataclasses
    import difflib

    from lm_eval.api.task import ALL_OUTPUT_TYPES, TaskConfig

    try:
        cfg = load_task_yaml(yaml_file, resolve_functions=False)
    except Exception:  # noqa: BLE001 - a file that cannot be read is named where it is read
        return
    if not isinstance(cfg, dict) or "class" in cfg or not isinstance(cfg.get("task"), str):
        return
    known = {f.name for f in dataclasses.fields(TaskConfig)} | {"include", "group", "group_alias"}
    if unknown := next((k for k in cfg if k not in known), None):
        near = difflib.get_close_matches(str(unknown), sorted(known), 1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise CalibrationError(f"lm-eval task file {yaml_file} has the key {unknown!r}, which lm-eval's task config "
                               f"does not know{hint}.")
    kind = cfg.get("output_type")
    if kind is not None and kind not in ALL_OUTPUT_TYPES:
        raise CalibrationError(f"lm-eval task file {yaml_file} has output_type {kind!r}; valid values are "
                               f"{', '.join(ALL_OUTPUT_TYPES)}.")


def check_functions(yaml_file: str) -> None:
    """Import the `!function`s of a task YAML (and its `include:`s) as lm-eval will, refusing one that cannot be
    (a module missing, or without the function) in one sentence before a model loads."""
    try:
        load_task_yaml(yaml_file)
    except (ImportError, AttributeError) as e:
        why = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise CalibrationError(f"lm-eval task file {yaml_file} names a `!function` that cannot be loaded: "
                               f"{str(e).rstrip('.')}{why}.") from None


def _data_files(manager, task: str) -> list[str]:
    """The `dataset_kwargs.data_files` a task's YAML names (none where lm-eval's index does not tell)."""
    cfg = _given_config(manager, task)
    if cfg is None:
        cfg = getattr((getattr(manager, "task_index", None) or {}).get(task), "cfg", None)
    files = ((cfg or {}).get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg, dict) else None
    if isinstance(files, dict):
        files = list(files.values())
    files = files if isinstance(files, list) else [files]
    return [f for v in files for f in (v if isinstance(v, list) else [v]) if isinstance(f, str) and "://" not in f]


def build_lm(forward: Forward | None, tokenizer, *, batch_size: int, max_length: int, generate=None, progress=None,
             announce=None, score=None):
    """An `lm_eval.api.model.TemplateLM` over `forward` (class built lazily: lm-eval imports slowly), or over
    `score([(tokens, n)]) -> [(log-likelihood of the last n tokens, greedy)]` when given (the serving engine's).

    `progress(samples, tokens)` after each forward or generation; `announce(n)` when lm-eval hands over n more
    requests (for a progress bar's total)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class HqtflowLM(TemplateLM):
        def __init__(self):
            super().__init__()
            self.tokenizer = tokenizer
            self.batch_size = batch_size
            self.max_length = max_length

        @property
        def eot_token_id(self) -> int:
            return tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:  # a rolling window's first token: BOS where there is one, as lm-eval's models
            return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

        def tok_decode(self, tokens, **kwargs) -> str:
            return tokenizer.decode(tokens)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            # each request: ((context, continuation), context_enc, continuation_enc)
            if announce:
                announce(len(requests))
            items = []
            for i, (_, ctx, cont) in enumerate(requests):
                whole = (ctx + cont)[-(self.max_length + 1):]
                n_cont = min(len(cont), len(whole) - 1)
                items.append((i, whole[:-1], whole[-n_cont:]))
            items.sort(key=lambda it: -len(it[1]))  # similar lengths together: little padding
            results: list = [None] * len(requests)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            for start in range(0, len(items), self.batch_size):
                chunk = items[start:start + self.batch_size]
                if score is not None:
                    for (i, inp, cont), result in zip(chunk, score([(inp + cont[-1:], len(cont)) for _, inp, cont in chunk])):
                        results[i] = result
                    if progress:
                        progress(len(chunk), sum(len(inp) for _, inp, _ in chunk))
                    continue
                width = len(chunk[0][1])
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for row, (_, inp, _) in enumerate(chunk):
                    ids[row, : len(inp)] = torch.tensor(inp)
                    mask[row, : len(inp)] = 1
                logits = forward(ids, mask)
                for row, (i, inp, cont) in enumerate(chunk):
                    n = len(cont)
                    logp = F.log_softmax(logits[row, len(inp) - n: len(inp)].float(), dim=-1)
                    target = torch.tensor(cont, device=logp.device)
                    greedy = bool((logp.argmax(dim=-1) == target).all())
                    results[i] = (float(logp.gather(-1, target[:, None]).sum()), greedy)
                if progress:
                    progress(len(chunk), int(mask.sum()))
            return results

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            out = []
            for req in requests:
                (text,) = req.args
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=self.tok_encode(text),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                scores = self._loglikelihood_tokens([((None, None), c, t) for c, t in windows])
                out.append(sum(s for s, _ in scores))
            return out

        def generate_until(self, requests, disable_tqdm: bool = False):
            if generate is None:
                raise CalibrationError("This run cannot generate text; pick loglikelihood or multiple-choice tasks.")
            if announce:
                announce(len(requests))
            out = []
            for req in requests:
                context, gen_kwargs = req.args
                until = gen_kwargs.get("until") or [tokenizer.decode([self.eot_token_id])]
                until = [until] if isinstance(until, str) else list(until)
                # prompt + generation within max_length, as lm-eval's hf model: the prompt cut on the left to leave
                # max_gen_toks, the generation cut to leave the prompt one token
                max_new = min(int(gen_kwargs.get("max_gen_toks", 256)), self.max_length - 1)
                ids = self.tok_encode(context)[-(self.max_length - max_new):]
                text = generate(torch.tensor([ids]), max_new, until)  # (a generator may stop at them early)
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
                if progress:
                    progress(1, len(ids))
            return out

    return HqtflowLM()


def greedy_generate(model, tokenizer, ids: torch.Tensor, max_new: int, until=(), **kwargs) -> tuple[str, int]:
    """Greedy text after `ids` [1, S] (on the model's device), ending at EOS or at the token that completes one of
    the `until` strings (transformers' stop_strings, as lm-eval's hf model stops: no token past it is generated, nor
    observed); and how many tokens went through the model for it: the prompt and every generated token but the last
    (which no forward took in)."""
    stops = [u for u in until if u]
    if stops:
        kwargs.update(stop_strings=stops, tokenizer=tokenizer)
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), out.shape[1] - 1


@contextmanager
def _patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _git_hash_quietly():
    """lm-eval records `git describe` of the current directory by shelling out with git's stderr shown, so every
    run outside a checkout printed `fatal: not a git repository`; the same probe, with that stderr dropped."""
    import subprocess

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, OSError):
        return None


def _task_naming(file: str, tasks: list[str], manager) -> str:
    """The task whose YAML names `file` (all of `tasks` where lm-eval's index cannot tell)."""
    index = getattr(manager, "task_index", None) or {}
    named = [t for t in tasks if file in str(getattr(index.get(t), "cfg", ""))]
    return ", ".join(named or tasks)


def _task_raising(error: BaseException, tasks: list[str]) -> str:
    """The name of the lm-eval task whose method raised `error` (all of `tasks` where no task's frame is in its
    traceback)."""
    import traceback

    from lm_eval.api.task import Task

    selves = [frame.f_locals.get("self") for frame, _ in traceback.walk_tb(error.__traceback__)]
    task = next((t for t in reversed(selves) if isinstance(t, Task)), None)
    name = getattr(getattr(task, "config", None), "task", None)
    return name if isinstance(name, str) else ", ".join(tasks)


def metric_key(key: str) -> str:
    """lm-eval's result key `metric,filter` as hqtflow records it: the metric alone under lm-eval's default filter
    `none`, else the whole key (`exact_match,strict-match`), so each of a task's filters keeps its own value."""
    metric, _, filter_name = key.partition(",")
    return metric if filter_name in ("", "none") else key


def is_metric(key: str) -> bool:
    """Whether a recorded result key is one of a task's metrics (not a standard error, nor lm-eval's sample count)."""
    name = key.split(",")[0]
    return not name.endswith("_stderr") and name not in ("sample_len", "sample_count")


def run_tasks(lm, tasks: list[str], manager, *, limit: int | None) -> tuple[dict, dict]:
    """Run lm-eval tasks through `lm`; return ({task: {metric_key: value}}, {task: {metric_key: higher_is_better}}),
    the second as lm-eval's task configs say (None where they do not)."""
    import lm_eval.evaluator as evaluator
    from jinja2.exceptions import UndefinedError

    # a task YAML given by path: its config, as lm-eval's CLI passes it (`!function`s imported); a group YAML: its
    # name, indexed from its folder (lm-eval 0.4.13 cannot build a group from a config: "unhashable type: 'list'")
    configs = _configs(manager)
    specs = [t if not is_task_file(t) else configs[t]["group"] if "group" in configs.get(t, {}) else load_task_yaml(t)
             for t in tasks]
    tasks = task_names(tasks, manager)
    try:
        with _patched(evaluator, "get_git_commit_hash", _git_hash_quietly):
            res = evaluator.simple_evaluate(
                model=lm, tasks=specs, task_manager=manager, limit=limit, bootstrap_iters=0, log_samples=False,
                verbosity="ERROR",
            )
    except FileNotFoundError as e:  # a task YAML's data_files (datasets: "Unable to find '...'"); nothing else
        if "Unable to find" not in str(e):
            raise
        found = re.search(r"'([^']+)'", str(e))
        missing = e.filename or (found.group(1) if found else str(e))
        raise CalibrationError(f"The data file {missing} of lm-eval task {_task_naming(missing, tasks, manager)} "
                               "does not exist.") from None
    except UndefinedError as e:  # a template (doc_to_text, ...) names a field the task's records lack
        raise CalibrationError(f"The template of lm-eval task {_task_raising(e, tasks)} uses a field its data's "
                               f"records lack ({e}).") from None
    except ConnectionError as e:  # datasets: "Couldn't reach 'baber/piqa' on the Hub (LocalEntryNotFoundError)"
        local = [f"'{t}_local'" for t in tasks if f"{t}_local" in LOCAL_TASKS]
        hint = f"use the offline cop{'ies' if len(local) > 1 else 'y'} {', '.join(local)} with --data-dir" if local else \
            "give a task YAML whose dataset_kwargs.data_files are local files"
        many = len(tasks) > 1
        raise CalibrationError(f"lm-eval task{'s' * many} {', '.join(tasks)} read{'' if many else 's'} "
                               f"{'their datasets' if many else 'its dataset'} from the Hugging Face Hub, which cannot be "
                               f"reached here ({str(e)[:160]}): {hint}.") from None
    except Exception as e:  # datasets could not read a task's data file (empty, truncated, not its format)
        from datasets.exceptions import DatasetGenerationError

        if not isinstance(e, (DatasetGenerationError, StopIteration)):
            raise
        cause = e.__cause__ or e
        raise CalibrationError(f"The data of lm-eval task {', '.join(tasks)} cannot be read: a data file is empty, cut "
                               f"short or not in its format ({type(cause).__name__}: {str(cause)[:160]}).") from None
    results = {
        task: {metric_key(k): v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "alias"}
        for task, metrics in (res or {}).get("results", {}).items()
    }
    better = (res or {}).get("higher_is_better", {})
    return results, {task: {k: better.get(task, {}).get(k.split(",")[0]) for k in metrics if is_metric(k)}
                     for task, metrics in results.items()}
