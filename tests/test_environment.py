"""hqtflow/environment.py: every environment variable hqtflow reads or sets goes through it."""

import re
from pathlib import Path

import pytest

from conftest import ROOT
from hqtflow import environment
from hqtflow.errors import ConfigError


def test_no_other_module_touches_the_environment():
    """os.environ / os.getenv appear only in environment.py."""
    allowed = {"environment.py"}
    found = []
    for p in sorted((ROOT / "hqtflow").rglob("*.py")):
        rel = p.relative_to(ROOT / "hqtflow").as_posix()
        if rel not in allowed and re.search(r"os\.environ|os\.getenv|getenv\(", p.read_text()):
            found.append(rel)
    assert found == []


def test_tgi_knobs_are_typed_like_their_default(monkeypatch):
    monkeypatch.delenv("MAX_BATCH_SIZE", raising=False)
    assert environment.tgi_knob("MAX_BATCH_SIZE", 8) == 8
    monkeypatch.setenv("MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("WARMUP_ENABLED", "true")
    assert environment.tgi_knob("MAX_BATCH_SIZE", 8) == 3 and environment.tgi_knob("WARMUP_ENABLED", False) is True
    with pytest.raises(KeyError):
        environment.tgi_knob("HOME", "")
    monkeypatch.setenv("MAX_BATCH_TOTAL_TOKENS", "2048")
    assert environment.tgi_knob("MAX_BATCH_TOTAL_TOKENS", None) == 2048  # no default: an int
    monkeypatch.setenv("MAX_BATCH_SIZE", "eight")
    with pytest.raises(ConfigError, match="MAX_BATCH_SIZE='eight' is not a valid int"):
        environment.tgi_knob("MAX_BATCH_SIZE", 8)
    for raw, value in (("TRUE", True), ("on", True), ("0", False), ("false", False), ("No", False)):
        monkeypatch.setenv("WARMUP_ENABLED", raw)
        assert environment.tgi_knob("WARMUP_ENABLED", True) is value
    monkeypatch.setenv("WARMUP_ENABLED", "maybe")  # not read as false
    with pytest.raises(ConfigError, match="WARMUP_ENABLED='maybe' is not a boolean"):
        environment.tgi_knob("WARMUP_ENABLED", False)


def test_tgi_knobs_read_their_older_name(monkeypatch):
    monkeypatch.delenv("MAX_INPUT_TOKENS", raising=False)
    monkeypatch.setenv("MAX_INPUT_LENGTH", "32")
    assert environment.tgi_variable("MAX_INPUT_TOKENS") == "MAX_INPUT_LENGTH"
    assert environment.tgi_knob("MAX_INPUT_TOKENS", 4095) == 32
    monkeypatch.setenv("MAX_INPUT_TOKENS", "16")
    with pytest.raises(ConfigError, match="MAX_INPUT_TOKENS and MAX_INPUT_LENGTH .its older name. are both set"):
        environment.tgi_knob("MAX_INPUT_TOKENS", 4095)


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HQTFLOW_CACHE", str(tmp_path))
    assert environment.cache_dir() == tmp_path
    assert Path(environment.__file__).parent == ROOT / "hqtflow"
