"""User-facing errors: the CLI prints their message as one sentence and exits with the code of their kind.

| code | kind |
|---|---|
| 2 | usage or configuration: a wrong flag value, QUANT_CONFIG, recipe or backend (also click's usage errors) |
| 3 | artifact: an input artifact missing, partial, damaged, of the wrong kind or stale; an output in the way |
| 4 | model: a model that cannot be found, read, loaded or split as asked |
| 5 | calibration or evaluation data: missing, empty, unreadable or unusable |
| 6 | resource: not enough memory or disk, a port in use |

1 is left to Python for bugs (a traceback); a run stopped by a signal exits 128 + its number (130: Ctrl-C, SIGINT;
143: SIGTERM).
"""


class HqtflowError(Exception):
    """A problem with the user's input or environment (not a bug): printed without a traceback."""

    exit_code = 2


class ConfigError(HqtflowError):
    """A flag, QUANT_CONFIG or recipe value is missing, unknown or out of range."""

    exit_code = 2


class BackendError(ConfigError, ValueError):
    """An FP8 backend that does not exist or cannot run here."""


class ArtifactError(HqtflowError):
    """An artifact directory is missing, partial, mismatched or of a newer schema; or an output is in the way."""

    exit_code = 3


class NewerArtifactError(ArtifactError):
    """An artifact of a newer schema than this hqtflow reads."""


class InspectError(ArtifactError):
    """The artifact(s) given to `hqtflow inspect` cannot be inspected as asked."""


class ModelError(HqtflowError):
    """A model cannot be found, loaded or split as asked."""

    exit_code = 4


class CalibrationError(HqtflowError):
    """Calibration (or evaluation) data is missing, empty or unusable."""

    exit_code = 5


class ResourceError(HqtflowError):
    """The machine lacks what the step needs: free memory, free disk, a free port."""

    exit_code = 6


EXIT_CODES = {"usage/config": 2, "artifact": 3, "model": 4, "calibration data": 5, "resource": 6}


class ProvenanceWarning(UserWarning):
    """Something is read whose origin hqtflow cannot check (a foreign dump): the CLI prints it as one line."""


class FallbackWarning(UserWarning):
    """A faster path cannot run here and a slower one is used (the CPU FP8 kernel not built): one line on the CLI."""


class LeftoverWarning(UserWarning):
    """An unfinished output of another host or container is kept beside a stage's output: one line on the CLI."""


class AccuracyWarning(UserWarning):
    """What was asked for runs, but its result is known to be unusable (a fixed scale far off the weights): one line on the CLI."""


def does_not_exist(path) -> str:
    """"does not exist", for a user-given path: a relative one names the directory it was looked for in (the current
    one), since a command run from elsewhere than its author meant is the usual cause. The end of a one-sentence error."""
    import os
    from pathlib import Path

    if Path(path).expanduser().is_absolute():
        return "does not exist"
    try:
        return f"does not exist (looked for in {os.getcwd()})"
    except OSError:  # the current directory was removed
        return "does not exist (the current directory was removed)"


def not_there(path) -> str:
    """Why `path`, which `Path.exists()` denies, is not there: a symlink loop, else it does not exist (does_not_exist)."""
    import errno
    import os

    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (or lies behind one)"
    return does_not_exist(path)


def not_a_file(path) -> str:
    """Why `path`, which is not a regular file, cannot be read as one: the end of a one-sentence error."""
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        return not_there(p)
    return "is a directory, not a file" if p.is_dir() else "is not a regular file (a device or a pipe)"


def not_a_directory(path) -> str:
    """Why `path`, which is not a directory, cannot be read as one: the end of a one-sentence error."""
    from pathlib import Path

    return "is not a directory" if Path(path).exists() else not_there(path)


def brief(value) -> str:
    """A short repr of a user-given value for a message: cut, and never walking a whole structure (a YAML
    "billion laughs" of shared aliases would otherwise take forever to print)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxset, r.maxdict = 2, 4, 4, 4, 4
    r.maxstring, r.maxother, r.maxlong = 80, 80, 40
    return r.repr(value)


def non_finite(value) -> str | None:
    """The key path (`a.b.0`) of the first NaN or infinity in a parsed JSON value, else None: JSON has neither, but
    Python's parser takes both (iterative: no recursion limit)."""
    import math

    todo = [("", value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return where or "a value"
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        todo += reversed([(f"{where}.{k}" if where else str(k), x) for k, x in items])
    return None


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` is not a usable regex (a syntax error, a repeat count past any limit, nesting past the stack), or
    None: the end of a one-sentence error."""
    import re

    try:
        re.compile(pattern)
    except (re.error, OverflowError, RecursionError) as e:
        return str(e) or type(e).__name__
    return None


def parse_problem(e: Exception) -> str:
    """The first line of a JSON or YAML reader's error, for a message (Python's integer-size limit in words, not the
    interpreter setting it suggests)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return "an integer of more than 4300 digits" if "integer string conversion" in text else text
