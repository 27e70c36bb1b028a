"""What a wheel of hqtflow carries (a user of `pip install hqtflow` has no checkout), and the bundled recipes and
QUANT_CONFIGs found by their bare names."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hqtflow import bundled
from hqtflow.config import QuantConfig
from hqtflow.errors import ConfigError
from hqtflow.recipes import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_folders_are_the_repositorys():
    assert bundled.names(bundled.RECIPES, ".yaml") == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert bundled.names(bundled.CONFIGS, ".json") == sorted(p.stem for p in (ROOT / "quantization_config").glob("*.json"))


def test_a_bare_name_is_the_bundled_recipe_or_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = load_recipe("smollm2")
    assert Path(by_name.path) == bundled.RECIPES / "smollm2.yaml"
    assert by_name.measure == load_recipe(ROOT / "recipes" / "smollm2.yaml").measure  # its relative paths resolve alike
    assert load_recipe("smollm2.yaml").measure == by_name.measure
    assert QuantConfig.from_file("pow2_quant") == QuantConfig.from_file(ROOT / "quantization_config" / "pow2_quant.json")


def test_a_file_of_that_name_in_the_working_directory_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "maxabs_quant.json").write_text('{"mode": "QUANTIZE", "scale_method": "unit_scale"}')
    assert QuantConfig.from_file("maxabs_quant.json").scale_method == "unit_scale"
    assert QuantConfig.from_file("maxabs_quant").scale_method != "unit_scale"  # no such file here: the bundled one


def test_an_unknown_name_lists_the_bundled_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"Recipe nosuch does not exist \(looked for in .*\); bundled: .*smollm2"):
        load_recipe("nosuch")
    with pytest.raises(ConfigError, match=r"does not exist \(looked for in .*\); bundled: .*maxabs_quant"):
        QuantConfig.from_file("nosuch")
    with pytest.raises(ConfigError) as e:  # a path is the user's: no list of bundled names
        load_recipe("sub/nosuch.yaml")
    assert "bundled" not in str(e.value)


def test_wheel_carries_recipes_configs_tasks_and_kernel_sources(tmp_path):
    src = tmp_path / "src"  # a copy, so the build's own folders stay out of the checkout
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".cache", "out", "build", "dist", "*.egg-info", "__pycache__", "hqt_output"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("hqtflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, pattern in (("recipes", "*.yaml"), ("quantization_config", "*.json")):
        for f in (ROOT / folder).glob(pattern):
            assert f"hqtflow/bundled/{folder}/{f.name}" in names
    for f in list((ROOT / "hqtflow" / "tasks").glob("*.yaml")) + list(ROOT.glob("hqtflow/*/csrc/*.cpp")):
        assert f.relative_to(ROOT).as_posix() in names
    assert not any(n.startswith(("tests/", "recipes/", "quantization_config/")) for n in names)
