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
from hqtflow.errors import ConfigError
from hqtflow.formats.quant_config import QuantConfig
from hqtflow.recipes import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_bundled_folders_are_the_repositorys():
    assert bundled.names(bundled.RECIPES, ".yaml") == sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
    assert bundled.names(bundled.CONFIGS, ".json") == sorted(p.stem for p in (ROOT / "quantization_config").glob("*.json"))


def test_a_bare_name_is_the_bundled_recipe_or_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_name = load_recipe("smollm2")
    assert Path(by_name.path) == bundled.RECIPES / "smollm2.yaml"
    # its QUANT_CONFIGs are the bundled ones, in a checkout (links) as in a wheel or sdist (copies)
    assert Path(by_name.measure.config).read_bytes() == (bundled.CONFIGS / "maxabs_measure.json").read_bytes()
    assert Path(by_name.quantize.config).read_bytes() == (bundled.CONFIGS / "cpu_quant.json").read_bytes()
    assert load_recipe("smollm2.yaml").measure == by_name.measure
    assert QuantConfig.from_file("pow2_quant") == QuantConfig.from_file(ROOT / "quantization_config" / "pow2_quant.json")


def test_a_file_of_that_name_in_the_working_directory_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "maxabs_quant.json").write_text('{"mode": "QUANTIZE", "scale_method": "unit_scale"}')
    assert QuantConfig.from_file("maxabs_quant.json").scale_method == "unit_scale"
    assert QuantConfig.from_file("maxabs_quant").scale_method != "unit_scale"  # no such file here: the bundled one
    (tmp_path / "smollm2").mkdir()  # a folder of that name (an artifact's, say) is no recipe
    assert Path(load_recipe("smollm2").path) == bundled.RECIPES / "smollm2.yaml"


def test_a_copied_recipe_names_bundled_configs_and_takes_its_data_from_a_folder(tmp_path, monkeypatch):
    """A recipe copied out of the package names its QUANT_CONFIGs by bundled name; `run --data-dir` takes a recipe's
    data files by name from one folder (a bundled recipe's data is the checkout's ../shared/data)."""
    from hqtflow.errors import CalibrationError
    from hqtflow.recipes import with_data_dir

    monkeypatch.chdir(tmp_path)
    text = (bundled.RECIPES / "smollm2.yaml").read_text()
    text = text.replace("../quantization_config/maxabs_measure.json", "maxabs_measure")
    (tmp_path / "mine.yaml").write_text(text.replace("../quantization_config/cpu_quant.json", "cpu_quant.json"))
    mine = load_recipe("mine.yaml")
    assert (Path(mine.measure.config), Path(mine.quantize.config)) == (bundled.CONFIGS / "maxabs_measure.json",
                                                                       bundled.CONFIGS / "cpu_quant.json")
    data = tmp_path / "data"
    data.mkdir()
    moved = with_data_dir(load_recipe("smollm2"), data)
    assert moved.measure.data_dir == moved.eval.data_dir == str(data)
    assert moved.measure.text == (str(data / "wikitext2_valid.txt"),) and moved.eval.ppl_file == str(data / "wikitext2_test.txt")
    with pytest.raises(CalibrationError, match=r"--data-dir nowhere does not exist \(looked for in"):
        with_data_dir(mine, "nowhere")


def test_an_unknown_name_lists_the_bundled_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"Recipe nosuch does not exist \(looked for in .*\); bundled: .*smollm2"):
        load_recipe("nosuch")
    with pytest.raises(ConfigError, match=r"does not exist \(looked for in .*\); bundled: .*maxabs_quant"):
        QuantConfig.from_file("nosuch")
    from hqtflow.errors import ArtifactError
    from hqtflow.handoff import plan_job

    with pytest.raises(ArtifactError, match=r"Artifact nosuch does not exist \(looked for in .*\); bundled recipes: .*smollm2"):
        plan_job("nosuch")
    with pytest.raises(ConfigError) as e:  # a path is the user's: no list of bundled names
        load_recipe("sub/nosuch.yaml")
    assert "bundled" not in str(e.value)


def test_a_recipes_misspelled_config_name_is_named_when_read(tmp_path, monkeypatch):
    """A copied recipe's misspelled bare config name (resolved beside the recipe, where no such file is) names the
    bundled config it nearly spells when the config is read, not when the recipe loads (a recipe whose quantize config
    is wrong still measures)."""
    monkeypatch.chdir(tmp_path)
    text = (bundled.RECIPES / "smollm2.yaml").read_text()
    (tmp_path / "typo.yaml").write_text(text.replace("../quantization_config/cpu_quant.json", "cpu_qaunt"))
    recipe = load_recipe("typo.yaml")
    with pytest.raises(ConfigError, match=r"cpu_qaunt does not exist \(did you mean the bundled cpu_quant\?\)\.$"):
        QuantConfig.from_file(recipe.quantize.config)
    with pytest.raises(ConfigError) as e:  # no near miss: nothing suggested
        QuantConfig.from_file(tmp_path / "mine.json")
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


def test_run_takes_a_bundled_recipe_and_its_data_folder_by_flag(tmp_path, monkeypatch):
    from conftest import run_cli

    monkeypatch.chdir(tmp_path)
    r = run_cli("run", "smollm2", "--data-dir", "nowhere")
    assert r.exit_code == 5 and r.stderr.strip() == f"Error: --data-dir nowhere does not exist (looked for in {tmp_path}).", r.output
