"""Every recipe in recipes/ is dry-run through the real CLI on a tiny random model of its architecture.

What cannot run here is overridden with CLI flags (the point of "flags override recipe values"): the model
(a tiny folder), --tp 1, a small --limit and --max-length, and hub-only lm-eval tasks (hellaswag, ...) which
become the offline `piqa_local` copy. Everything else (the QUANT_CONFIG, dtype, batch size, local tasks and
text files) comes from the recipe itself, and the artifact is checked against it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY, run_cli

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY_LIMIT = 2
TINY_MAX_LENGTH = 32


def _raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _manifest(out: Path) -> dict:
    return json.loads((out / "hqtflow_manifest.json").read_text())


def _nodes(out: Path, manifest: dict) -> dict:
    (rank,) = manifest["data"]["ranks"]
    return json.loads((out / f"{rank['stem']}.json").read_text())["Nodes"]


def _maxabs(stat) -> float:
    import numpy as np

    return float(np.abs(np.asarray(stat, dtype=np.float32)).max())


_MODULES: dict = {}


def _modules(model_dir: Path) -> list[tuple[str, object]]:
    """named_modules of the tiny model, built on the meta device (no weights: fast)."""
    if model_dir not in _MODULES:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        _MODULES[model_dir] = list(model.named_modules())
    return _MODULES[model_dir]


def _fused_experts(model_dir: Path) -> dict[str, int]:
    """MoE containers with fused 3-D expert weights -> number of experts."""
    out = {}
    for name, mod in _modules(model_dir):
        gu = getattr(mod, "gate_up_proj", None)
        if gu is not None and getattr(gu, "dim", lambda: 0)() == 3:
            out[name] = gu.shape[0]
    return out


def _calibration_overrides(settings, data_dir: Path, wiki: Path) -> list[str]:
    """Flags replacing calibration sources this machine cannot use (hub tasks, absent local paths)."""
    from hqtflow.lmeval import LOCAL_TASKS

    args: list[str] = []
    tasks = settings.tasks
    if tasks and (any(t not in LOCAL_TASKS for t in tasks) and not settings.include_path):
        args += ["--tasks", "piqa_local", "--data-dir", data_dir]  # the offline copy of a hub task
    elif settings.data_dir and not Path(settings.data_dir).is_dir():
        args += ["--data-dir", data_dir]
    if settings.text and not all(Path(t).is_file() for t in settings.text):
        args += ["--text", wiki]
    return args


# ---- static checks ------------------------------------------------------------------------------
def test_recipes_exist():
    assert len(RECIPES) >= 9, f"expected the seed recipes in {ROOT / 'recipes'}, found {[p.name for p in RECIPES]}"


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_is_complete(path):
    from hqtflow.formats.quant_config import QuantConfig
    from hqtflow.recipes import load_recipe

    raw = _raw(path)
    r = load_recipe(path)
    s = r.measure
    assert r.name == path.stem, "the recipe's name should match its file name"
    assert raw.get("version") == 1, "every shipped recipe states its schema (`version: 1`), as docs/reference.md says"
    assert raw.get("model") and isinstance(raw["model"], str) and s.model == raw["model"]
    assert r.model_type in TINY, f"model_type must be one of {sorted(TINY)} so it can be dry-run"
    assert isinstance(raw.get("cards"), int) and raw["cards"] >= 1 and s.tp == raw["cards"]
    assert QuantConfig.from_file(s.config).mode == "MEASURE"
    assert QuantConfig.from_file(r.quantize.config).mode == "QUANTIZE"
    assert s.tasks or s.text, "a recipe needs calibration data"
    assert s.output and r.notes, "output and notes (the seed command followed) are expected"


@pytest.mark.parametrize("path", [p for p in RECIPES if _raw(p).get("model") == "smollm2"],
                         ids=lambda p: p.stem)
def test_smollm2_recipe_cards_split_the_real_model(path, smollm2):
    """The card count of a SmolLM2 recipe divides its heads and MLP (what --tp N checks before spawning)."""
    from hqtflow.measure.distributed import check_tp_split
    from hqtflow.models import load_config

    check_tp_split(load_config(smollm2), _raw(path)["cards"])


# ---- dry run on a tiny model of the same architecture ---------------------------------------------
@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_dry_run(path, tiny_factory, data_dir, tmp_path):
    from torch import nn

    from hqtflow.formats.quant_config import QuantConfig
    from hqtflow.recipes import load_recipe

    raw = _raw(path)
    recipe = load_recipe(path).measure
    model_dir = tiny_factory(raw["model_type"])
    out = tmp_path / "m"
    r = run_cli("measure", "--recipe", path, model_dir, "-o", out, "--tp", "1", "--limit", str(TINY_LIMIT),
                "--max-length", str(TINY_MAX_LENGTH),
                *_calibration_overrides(recipe, data_dir, data_dir / "wikitext2_valid.txt"))
    assert r.exit_code == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"

    m = _manifest(out)
    s = m["data"]["settings"]
    # the recipe is recorded, its config is the one used, and unoverridden values come from it
    assert s["recipe"] == str(path)
    assert Path(s["config"]).resolve() == Path(recipe.config).resolve()
    cfg = QuantConfig.from_file(recipe.config)
    assert m["config"] == cfg.to_dict()
    assert (s["tp"], s["limit"], s["max_length"], s["model"]) == (1, TINY_LIMIT, TINY_MAX_LENGTH, str(model_dir))
    assert (s["dtype"], s["batch_size"]) == (recipe.dtype, recipe.batch_size)
    assert m["data"]["model_dtype"] == recipe.dtype
    assert m["model"]["model_type"] == raw["model_type"]
    assert m["data"]["world_size"] == 1 and m["data"]["calibration"]["tokens"] > 0
    inc_cfg = json.loads((out / "quant_config.json").read_text())
    assert inc_cfg["mode"] == "QUANTIZE" and inc_cfg["measure_exclude"] == cfg.measure_exclude

    # a node for every Linear the config selects, with real statistics
    nodes = _nodes(out, m)
    modules = _modules(model_dir)
    expected = {n for n, mod in modules if isinstance(mod, nn.Linear) and cfg.selects(n, type(mod).__name__)}
    assert expected, "the config selects no Linear of the tiny model"
    missing = expected - set(nodes)
    assert not missing, f"selected Linears without a measurement node: {sorted(missing)[:10]}"
    for name in expected:
        node = nodes[name]
        assert len(node["inputs"]) == 1 and _maxabs(node["inputs"][0]) > 0, name
        assert _maxabs(node["params"]["weight"]) > 0, name
        assert ("outputs" in node) == cfg.measures_outputs, name
        if cfg.measures_outputs:
            assert _maxabs(node["outputs"][0]) > 0, name

    # MoE: each expert observed on the tokens routed to it
    experts = _fused_experts(model_dir)
    if raw["model_type"] == "mixtral":
        assert experts, "the tiny Mixtral has no fused expert container: MoE would not be measured"
    unmeasured = set(m["data"]["ranks"][0]["unmeasured"])
    layers = m["data"]["ranks"][0]["layers"]
    top_k = TINY[raw["model_type"]].get("num_experts_per_tok", 1)
    for container, n_experts in experts.items():
        want = {f"{container}.{e}.{p}" for e in range(n_experts) for p in ("gate_up_proj", "down_proj")
                if cfg.selects(f"{container}.{e}.{p}", "Linear")}
        got = want & set(nodes)
        assert got | (want & unmeasured) == want, f"{container}: expert nodes neither measured nor listed unmeasured"
        routed = {n.rsplit(".", 2)[1] for n in got}
        # every token goes to top_k distinct experts, so at least top_k of them saw tokens
        assert len(routed) >= min(top_k, n_experts), f"{container}: only experts {sorted(routed)} measured"
        for e in routed:
            for proj in ("gate_up_proj", "down_proj"):
                name = f"{container}.{e}.{proj}"
                node = nodes[name]
                assert _maxabs(node["inputs"][0]) > 0 and _maxabs(node["params"]["weight"]) > 0, name
                assert layers[name]["expert"] == int(e)


# ---- flags override recipe values ------------------------------------------------------------------
def test_flags_override_recipe_values(tiny_factory, data_dir, tmp_path):
    from hqtflow.recipes import load_recipe

    path = ROOT / "recipes" / "smollm2.yaml"
    recipe = load_recipe(path).measure
    need_local = _calibration_overrides(recipe, data_dir, data_dir / "wikitext2_valid.txt")
    out = tmp_path / "m"
    r = run_cli("measure", "--recipe", path, tiny_factory("llama"), "-o", out, "--tp", "1",
                "--limit", "3", "--batch-size", "2", "--dtype", "fp32", *need_local)
    assert r.exit_code == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    d = _manifest(out)["data"]
    s = d["settings"]
    assert (s["limit"], s["batch_size"], s["dtype"], s["tp"]) == (3, 2, "fp32", 1)
    assert recipe.limit != 3 and recipe.batch_size != 2 and recipe.dtype != "fp32"
    assert d["calibration"]["batch_size"] == 2 and d["model_dtype"] == "fp32"
    # what no flag overrode still comes from the recipe
    assert s["max_length"] == recipe.max_length == d["calibration"]["max_length"]
    assert tuple(s["tasks"]) == recipe.tasks
    by_kind = {src["kind"]: src for src in d["calibration"]["sources"]}
    assert by_kind["text"]["chunks"] == 3 and by_kind["lm-eval"]["limit"] == 3
    assert set(by_kind["lm-eval"]["results"]) == set(recipe.tasks)


# ---- invalid recipes are refused with one sentence ------------------------------------------------
GOOD = {"model": "smollm2", "cards": 1, "calibration": {"text": "x.txt"}}


def _refused(tmp_path: Path, recipe: dict):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "m"
    r = run_cli("measure", "--recipe", path, "-o", out)
    assert r.exit_code == 2, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    msg = r.stderr.strip()
    assert msg.startswith("Error: ") and len(msg.splitlines()) == 1, msg
    assert "Traceback" not in r.output and not out.exists()
    return msg


@pytest.mark.parametrize("key,where", [("modle", None), ("taks", "calibration")])
def test_unknown_key_refused(tmp_path, key, where):
    recipe = json.loads(json.dumps(GOOD))
    (recipe[where] if where else recipe)[key] = "x"
    msg = _refused(tmp_path, recipe)
    assert key in msg and "bad.yaml" in msg


@pytest.mark.parametrize("cards", ["eight", 2.5, True])
def test_non_integer_cards_refused(tmp_path, cards):
    msg = _refused(tmp_path, {**GOOD, "cards": cards})
    assert "bad.yaml" in msg and "integer" in msg and "'cards'" in msg


# ---- the SmolLM2 recipe for real --------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_recipe_real_model(smollm2, data_dir, tmp_path):
    path = ROOT / "recipes" / "smollm2.yaml"
    from hqtflow.recipes import load_recipe

    recipe = load_recipe(path).measure
    out = tmp_path / "m"
    r = run_cli("measure", "--recipe", path, "-o", out, "--limit", "2", "--max-length", "64",
                *_calibration_overrides(recipe, data_dir, data_dir / "wikitext2_valid.txt"))
    assert r.exit_code == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    m = _manifest(out)
    assert Path(m["data"]["model_path"]).resolve() == smollm2.resolve()
    assert len(_nodes(out, m)) == 30 * 7 + 1  # q,k,v,o,gate,up,down per layer + lm_head


def test_kv_cache_key(tmp_path):
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    assert load_recipe(ROOT / "recipes" / "smollm2.yaml").quantize.kv_cache == "fp8"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2\noutput: out\nkv_cache: int4\n")
    with pytest.raises(ConfigError, match="kv_cache must be bf16 or fp8"):
        load_recipe(bad)


def test_gptq_key(tmp_path):
    """`gptq: true`: the measurement records Hessians and the quantization rounds with GPTQ; a flag still overrides."""
    from hqtflow.recipes import load_recipe, measure_settings

    path = tmp_path / "g.yaml"
    path.write_text("model: smollm2\noutput: out/m\ngptq: true\n")
    r = load_recipe(path)
    assert measure_settings(r, {}).hessians and r.quantize.settings("m", "q").gptq
    assert not measure_settings(load_recipe(ROOT / "recipes" / "smollm2.yaml"), {}).hessians
    assert not load_recipe(ROOT / "recipes" / "smollm2.yaml").quantize.settings("m", "q").gptq


def test_a_task_yamls_path_is_read_from_the_recipes_folder(tmp_path):
    """A task given by its YAML's path is an input path like the others: relative to the recipe's folder."""
    from hqtflow.recipes import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("model: smollm2\noutput: out/m\ncalibration: {tasks: [piqa_local, tasks/mine.yaml]}\n"
                    "eval: {tasks: tasks/mine.yaml}\n")
    r = load_recipe(path)
    assert r.measure.tasks == ("piqa_local", str(tmp_path / "tasks" / "mine.yaml"))
    assert r.eval.tasks == (str(tmp_path / "tasks" / "mine.yaml"),)


def test_a_models_path_is_read_from_the_recipes_folder(tmp_path, monkeypatch):
    """`model` is an input path like the others: a folder beside the recipe wins wherever hqtflow runs; a bundled name,
    a hub id or a folder from the current directory stays as given; two different folders by one name are refused."""
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    (tmp_path / "proj" / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "elsewhere" / "models" / "other").mkdir(parents=True)
    path = tmp_path / "proj" / "r.yaml"
    monkeypatch.chdir(tmp_path / "elsewhere")
    for given, read in (("models/tiny", str(tmp_path / "proj" / "models" / "tiny")), ("smollm2", "smollm2"),
                        ("org/name", "org/name"), ("models/other", "models/other"), ("/abs/m", "/abs/m")):
        path.write_text(f"model: {given}\noutput: out/m\n")
        assert load_recipe(path).measure.model == read, given
    (tmp_path / "elsewhere" / "models" / "tiny").mkdir()
    path.write_text("model: models/tiny\noutput: out/m\n")
    with pytest.raises(ConfigError, match="'model' models/tiny names .*proj/models/tiny .*beside the recipe.* and "
                                          ".*elsewhere/models/tiny .*give an absolute path"):
        load_recipe(path)
    monkeypatch.chdir(tmp_path / "proj")  # both spellings name one folder: no ambiguity
    assert load_recipe(path).measure.model == str(tmp_path / "proj" / "models" / "tiny")


def test_one_recipe_flag_merge(tmp_path):
    """`measure --recipe` and `run` share recipes.merge_flags: flags given override, flags not given (None) keep the
    recipe's value, and a run without any output directory is refused."""
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import merge_flags

    recipe = {"model": "m", "limit": 32, "output": "out/a", "data_dir": None}
    assert merge_flags(recipe, {"limit": 4, "output": None, "model": None}) == {"model": "m", "limit": 4, "output": "out/a"}
    with pytest.raises(ConfigError, match="No output directory"):
        merge_flags({"model": "m"}, {"output": None})
    with pytest.raises(ConfigError, match="No output directory"):
        merge_flags(None, {"model": "m"})


def test_recipe_version(tmp_path):
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    assert load_recipe(ROOT / "recipes" / "smollm2.yaml").name == "smollm2"  # `version: 1` is read
    newer = tmp_path / "newer.yaml"
    newer.write_text("version: 2\nmodel: smollm2\n")
    with pytest.raises(ConfigError, match="has version 2; this hqtflow reads recipe version 1"):
        load_recipe(newer)
    for bad, msg in (("version: 0\n", "'version' must be a positive integer, not 0"),
                     ("version: one\n", "'version' must be a positive integer, not 'one'")):
        newer.write_text(bad + "model: smollm2\n")
        with pytest.raises(ConfigError, match=msg):
            load_recipe(newer)


def test_recipe_sections_are_the_stage_settings():
    """Each stage's section is typed and its fields are the stage settings' own: the flat YAML keys land in the
    measure section (cards -> tp), quant_config/kv_cache in quantize, `eval` in eval (batch size: the recipe's)."""
    from dataclasses import fields

    from hqtflow.choices import KVCache
    from hqtflow.measure.run import MeasureSettings
    from hqtflow.quantize.run import QuantizeSettings
    from hqtflow.recipes import MeasureSection, QuantizeSection, load_recipe, measure_settings

    assert {f.name for f in fields(MeasureSection)} <= {f.name for f in fields(MeasureSettings)}
    assert {f.name for f in fields(QuantizeSection)} <= {f.name for f in fields(QuantizeSettings)}
    for section, settings in ((MeasureSection, MeasureSettings), (QuantizeSection, QuantizeSettings)):
        defaults = {f.name: f.default for f in fields(settings)}
        assert all(f.default == defaults[f.name] for f in fields(section) if f.default is not None), section

    path = ROOT / "recipes" / "smollm2.yaml"
    r = load_recipe(path)
    data = (ROOT / "../shared/data").resolve()
    assert r.measure.tp == 1 and r.measure.tasks == ("piqa_local", "lambada_openai_local")
    assert r.measure.data_dir == str(data) and r.measure.text == (str(data / "wikitext2_valid.txt"),)
    assert r.quantize.kv_cache is KVCache.FP8
    assert r.quantize.config == str((ROOT / "quantization_config" / "cpu_quant.json").resolve())
    assert (r.eval.limit, r.eval.ppl_windows, r.eval.batch_size) == (50, 8, r.measure.batch_size)
    q = r.quantize.settings("m", "q")
    assert (q.config, q.kv_cache, q.measurement, q.output) == (r.quantize.config, "fp8", "m", "q")
    s = measure_settings(r, {"limit": 4, "output": None}, overwrite=True)
    assert (s.limit, s.output, s.recipe, s.overwrite, s.max_length) == (4, "out/smollm2/measure", str(path), True, 256)
    assert measure_settings(None, {"output": "o", "tasks": ("piqa_local",)}) == MeasureSettings(output="o", tasks=("piqa_local",))


@pytest.mark.parametrize("text,msg", [
    ("eval: {tasks: [piqa_local], limt: 3}", "'eval' has unknown key(s) limt; valid keys are batch_size, data_dir, include_path"),
    ("calibration: [a]", "'calibration' must be a mapping"),
    ("eval: {limit: 0}", "'eval.limit' must be a positive integer, not 0"),
    ("calibration: {tasks: [1, 2]}", "'calibration.tasks' must be a list of names"),
    ("calibration: {text: 3}", "'calibration.text' must be a list, not 3"),
    ("config: [a]", "'config' must be a path"),
    ("dtype: 16", "'dtype' must be bf16, fp16 or fp32, not 16"),
    ("dtype: bfloat17", "'dtype' must be bf16, fp16 or fp32, not 'bfloat17'"),  # refused on reading, by its key
    ("gptq: yes please", "'gptq' must be true or false, not 'yes please'"),
])
def test_recipe_values_refused(tmp_path, text, msg):
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2\n" + text + "\n")
    with pytest.raises(ConfigError, match=re.escape(msg)):
        load_recipe(bad)


def test_merge_keys_are_read_and_duplicates_still_refused(tmp_path):
    """YAML merge keys (`<<:`) work as in yaml.safe_load (a key beside them overrides the merged one); a key given
    twice is still refused, in a mapping and in a merged one."""
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("model: smollm2\ncalibration:\n  <<: {limit: 4, text_field: body}\n  limit: 8\n")
    assert (load_recipe(path).measure.limit, load_recipe(path).measure.text_field) == (8, "body")
    path.write_text("model: smollm2\ncalibration:\n  <<: [{limit: 4}, {text_field: body}]\n")
    assert (load_recipe(path).measure.limit, load_recipe(path).measure.text_field) == (4, "body")
    # chained: a mapping that merged and overrode a key (flattened in place once read) merged again elsewhere
    path.write_text('model: smollm2\ngaudi:\n  measure: {script: s, env: &e {<<: {A: "1"}, A: "2"}}\n'
                    '  quantize: {script: s, env: {<<: *e, B: "3"}}\n')
    assert load_recipe(path).gaudi["quantize"]["env"] == yaml.safe_load(path.read_text())["gaudi"]["quantize"]["env"]
    for text in ("calibration:\n  <<: {limit: 4}\n  limit: 8\n  limit: 9\n", "calibration:\n  <<: {limit: 4, limit: 5}\n"):
        path.write_text("model: smollm2\n" + text)
        with pytest.raises(ConfigError, match="gives the key 'limit' twice"):
            load_recipe(path)


@pytest.mark.parametrize("text,label", [('model: "a\\0b"', "model"), ('calibration: {tasks: [piqa, "p\\0"]}', "calibration.tasks[1]"),
                                        ('gaudi: {measure: {script: s, env: {"A": "x\\0"}}}', "gaudi.measure.env.A"),
                                        ('notes: {"n\\0": 1}', "notes.n\\0")])
def test_a_nul_anywhere_is_refused(tmp_path, text, label):
    """A NUL in any recipe string (or key) is refused, naming where: no path or argument can hold one, and
    `handoff` would otherwise print commands with it silently dropped."""
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"'{label}' holds a NUL character")):
        load_recipe(path)


def _laughs(levels: int) -> str:
    """A YAML "billion laughs": `*a{levels}` names 9**(levels + 1) shared leaves."""
    lines = ["x: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "gaudi:\n" + "".join(f"  {line}\n" for line in lines)


@pytest.mark.parametrize("key", ["batch_size", "cards", "config", "dtype", "kv_cache", "model", "notes",
                                 "calibration.tasks", "calibration.text", "version"])
def test_alias_bomb_value_refused_in_a_short_sentence(tmp_path, key):
    from hqtflow.errors import ConfigError
    from hqtflow.recipes import load_recipe

    section, _, name = key.rpartition(".")
    value = f"{{{name}: *a6}}" if section else "*a6"
    bad = tmp_path / "bad.yaml"
    bad.write_text(_laughs(6) + f"{section or name}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(bad)
    assert key.split(".")[-1] in str(e.value) and len(str(e.value)) < 500, str(e.value)[:500]


def test_alias_bomb_in_gaudi_env_refused(tmp_path):
    from hqtflow.errors import ConfigError
    from hqtflow.handoff import _gaudi_section

    import yaml as _yaml
    bomb = _yaml.safe_load(_laughs(6))["gaudi"]["x6"]
    with pytest.raises(ConfigError, match="env must map variable names to values"):
        _gaudi_section("r.yaml", {"measure": {"script": "run_lm_eval.py", "env": {"X": bomb}}})
