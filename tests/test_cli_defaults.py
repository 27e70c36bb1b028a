"""Every option of `measure`, `quantize` and `serve` that is also a field of the stage's settings dataclass has the
dataclass's default, so what the tests build (the dataclasses) is what users run (the CLI)."""

from dataclasses import MISSING, fields

import pytest
import typer

from conftest import run_cli
from hqtflow.cli import app
from hqtflow.measure.run import MeasureSettings
from hqtflow.quantize.settings import QuantizeSettings
from hqtflow.runtime.api import ServeSettings

COMMANDS = {"measure": MeasureSettings, "quantize": QuantizeSettings, "serve fp8": ServeSettings,
            "serve bf16": ServeSettings}


def _command(path: str):
    command = typer.main.get_command(app)
    for name in path.split():
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", list(COMMANDS))
def test_cli_defaults_are_the_settings_defaults(path):
    defaults = {f.name: f.default for f in fields(COMMANDS[path]) if f.default is not MISSING}
    shared = [p for p in _command(path).params if p.name in defaults]
    assert len(shared) >= 5, [p.name for p in shared]
    drifted = {p.name: (p.default, defaults[p.name]) for p in shared if p.default != defaults[p.name]}
    assert drifted == {}, "CLI default != dataclass default"


def test_measure_flags_not_given_keep_the_recipe_values(tmp_path, monkeypatch):
    """`measure --recipe` with no --batch-size keeps the recipe's batch size (1), not the CLI default (8); a flag
    given at its default value (--batch-size 8) still overrides it."""
    from hqtflow.measure import run

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: smollm2\nbatch_size: 1\ndtype: fp16\ncalibration: {text: x.txt}\noutput: out\n")
    seen = []
    monkeypatch.setattr(run, "measure", lambda s, **kw: seen.append(s) or tmp_path)
    monkeypatch.setattr(run, "measurement_summary", lambda out: "ok")
    for extra in ([], ["--batch-size", "8"]):
        r = run_cli("measure", "--recipe", recipe, *extra)
        assert r.exit_code == 0, r.output
    assert [(s.batch_size, s.dtype, s.max_length) for s in seen] == [(1, "fp16", None), (8, "fp16", None)]  # None: the model's context, up to 512
