"""Task YAMLs given by path (`--tasks DIR/task.yaml`), read as lm-eval's own CLI reads them: the one file, its
`include:` chain and the `!function` modules they name, never the folder around it (no torch or lm-eval import here:
recipes and the CLI use `is_task_file`)."""

from __future__ import annotations

from pathlib import Path

import yaml


def is_task_file(task: str) -> bool:
    """Whether a --tasks entry is a task YAML's path (lm-eval's `--tasks DIR/task.yaml`) rather than a task name."""
    return task.endswith((".yaml", ".yml"))


def load_task_yaml(path: str | Path, *, resolve_functions: bool = True) -> dict:
    """The task (or group) config of the YAML at `path` as lm-eval's CLI passes it to `simple_evaluate`: its `include:`
    chain merged and its `!function`s imported (lm-eval's `load_yaml`; with `resolve_functions=False`, left as the
    paths they name)."""
    try:
        from lm_eval.tasks._yaml_loader import load_yaml
    except ImportError:  # lm-eval before its task-loader rewrite: the same reader, in lm_eval.utils
        from lm_eval.utils import load_yaml_config

        return load_yaml_config(yaml_path=str(path), mode="full" if resolve_functions else "simple")
    return load_yaml(path, resolve_func=resolve_functions)


class _Function(str):
    """A `!function module.name` value, as written."""


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    pass


_Loader.add_constructor("!function", lambda loader, node: _Function(loader.construct_scalar(node)))


def _functions(value) -> list[str]:
    if isinstance(value, _Function):
        return [value]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _functions(v)]
    if isinstance(value, list):
        return [f for v in value for f in _functions(v)]
    return []


def task_yaml_files(path: str | Path) -> list[Path]:
    """The files lm-eval reads for the task YAML at `path`: the YAML, each file of its `include:` chain (relative to the
    file that includes it, as lm-eval resolves it) and the module (`module.py` beside the YAML naming it) of each of
    their `!function`s that is there (else lm-eval imports an installed module: not a task file)."""
    files: list[Path] = []

    def visit(p: Path) -> None:
        p = p.expanduser().resolve()
        if p in files:
            return
        files.append(p)
        try:
            cfg = yaml.load(p.read_bytes(), Loader=_Loader)  # noqa: S506 (a safe loader, plus !function)
        except (OSError, yaml.YAMLError):
            return  # (recorded: missing, or lm-eval refuses it when it loads)
        if not isinstance(cfg, dict):
            return
        for qual in _functions(cfg):
            module = qual.rpartition(".")[0]
            found = p.parent / f"{module.replace('.', '/')}.py"
            if module and found.is_file() and found.resolve() not in files:
                files.append(found.resolve())
        includes = cfg.get("include") or []
        for inc in includes if isinstance(includes, list) else [includes]:
            if isinstance(inc, str):
                visit(Path(inc) if Path(inc).is_absolute() else p.parent / inc)

    visit(Path(path))
    return files
