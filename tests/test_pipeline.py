"""`hqtflow run RECIPE` (stages skipped while current, redone when inputs change), `generate` and `eval`."""

import json
import re
from pathlib import Path

import yaml

from conftest import ROOT, count_skeletons, run_cli
from hqtflow import __version__
from hqtflow.formats.artifact import MANIFEST, ArtifactKind, read_manifest


def edit_json(path, fn):
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw))


def edit_manifest(d, fn):
    edit_json(d / MANIFEST, fn)


def write_recipe(path, model, data_dir, limit):
    path.write_text(yaml.safe_dump({
        "name": "tiny", "model": str(model), "cards": 1, "dtype": "bf16",
        "config": str(ROOT / "quantization_config/maxabs_measure.json"),
        "calibration": {"text": str(data_dir / "wikitext2_valid.txt"), "limit": limit},
        "batch_size": 2, "max_length": 64, "output": str(path.parent / "run" / "measure"),
        "quant_config": str(ROOT / "quantization_config/cpu_quant.json"),
        "eval": {"ppl_file": str(data_dir / "wikitext2_test.txt"), "ppl_windows": 2},
    }))
    return path


def test_run_recipe_skips_current_stages(tiny_llama, data_dir, tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    first = run_cli("run", recipe)
    assert first.exit_code == 0, first.output
    assert "measure: writing" in first.stdout and "quantize: writing" in first.stdout
    assert f"eval: writing {tmp_path / 'run' / 'eval.json'}" in first.stdout
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert set(report["results"]) == {"bf16", "fp8"} and report["comparison"][0]["task"] == "wikitext2_test"  # the --ppl-file's name
    second = run_cli("run", recipe)
    assert second.exit_code == 0, second.output
    assert second.stdout.count("up to date, skipped") == 3
    assert "wikitext2" in second.stdout and "Δ fp8" in second.stdout  # the table is printed again
    # outputs of another hqtflow version (0.1.0 wrote no version into its report) are read, and redone by `run`
    for d in ("measure", "fp8"):
        edit_manifest(tmp_path / "run" / d, lambda m: m["tool"].update(hqtflow="0.1.0"))
        assert run_cli("inspect", tmp_path / "run" / d).exit_code == 0
    edit_json(tmp_path / "run" / "eval.json", lambda r: r.pop("hqtflow"))
    old = run_cli("run", recipe)
    assert old.exit_code == 0 and "up to date" not in old.stdout, old.output
    for stage, out in (("measure", "measure"), ("quantize", "fp8"), ("eval", "eval.json")):
        assert f"{stage}: {tmp_path / 'run' / out} was written by hqtflow 0.1.0, this is {__version__}: redone." in old.stdout
    assert read_manifest(tmp_path / "run" / "fp8", ArtifactKind.CHECKPOINT).written_by == __version__
    write_recipe(recipe, tiny_llama, data_dir, 3)  # an input changed: every stage is redone, saying why
    third = run_cli("run", recipe)
    assert "measure: writing" in third.stdout and "quantize: writing" in third.stdout
    assert f"measure: {tmp_path / 'run' / 'measure'} is redone: its settings changed (limit: 2 -> 3)." in third.stdout
    assert f"quantize: {tmp_path / 'run' / 'fp8'} is redone: its measurement changed." in third.stdout
    assert third.exit_code == 0 and "up to date" not in third.stdout
    # the same recipe through a symlink or a copy (`run smollm2` reads the bundled one, a symlink into recipes/ in an
    # editable install): every stage current
    (tmp_path / "alias.yaml").symlink_to(recipe)
    (tmp_path / "copy.yaml").write_text(recipe.read_text())
    for alias in ("alias.yaml", "copy.yaml"):
        again = run_cli("run", tmp_path / alias)
        assert again.exit_code == 0 and again.stdout.count("up to date, skipped") == 3, again.output
    # a second recipe whose measurement sits beside the first's would share its fp8/ and eval.json: refused up front
    other = write_recipe(tmp_path / "other.yaml", tiny_llama, data_dir, 2)
    other.write_text(other.read_text().replace(str(tmp_path / "run" / "measure"), str(tmp_path / "run" / "measure2")))
    clash = run_cli("run", other)
    assert clash.exit_code == 3 and "another recipe's measurement" in clash.output, clash.output
    clash = run_cli("run", other, "--force")  # --force does not clobber a sibling recipe's outputs either
    assert clash.exit_code == 3 and "another recipe's measurement" in clash.output, clash.output
    assert not (tmp_path / "run" / "measure2").exists()


def test_run_never_replaces_newer_outputs_nor_trips_on_odd_ones(tiny_llama, data_dir, tmp_path):
    """What a newer hqtflow wrote (schema or version) is refused, not redone over; a manifest or report whose
    records are of another shape is redone, not a traceback; a copied project runs with --force."""
    import shutil

    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    assert run_cli("run", recipe).exit_code == 0
    run = tmp_path / "run"
    saved = {d: (run / d / MANIFEST).read_text() for d in ("measure", "fp8")}
    for d, edit in (("measure", lambda m: m.update(_version=3)), ("fp8", lambda m: m["tool"].update(hqtflow="99.0"))):
        edit_manifest(run / d, edit)
        r = run_cli("run", recipe)
        assert r.exit_code == 3 and "does not replace it" in r.stderr and "Traceback" not in r.output, r.output
        assert "writing" not in r.stdout
        (run / d / MANIFEST).write_text(saved[d])
    edit_json(run / "eval.json", lambda r: r.update(hqtflow="99.0"))
    r = run_cli("run", recipe)
    assert r.exit_code == 3 and "newer than this" in r.stderr, r.output
    edit_json(run / "eval.json", lambda r: r.update(hqtflow=__version__, comparison="?"))
    edit_manifest(run / "measure", lambda m: m["data"].update(settings=[]))
    r = run_cli("run", recipe)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert "measure: writing" in r.stdout and "eval: writing" in r.stdout
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(run, copy / "run")
    moved = write_recipe(copy / "tiny.yaml", tiny_llama, data_dir, 2)
    assert run_cli("run", moved).exit_code == 3  # its fp8 records the original's measurement
    forced = run_cli("run", moved, "--force")
    assert forced.exit_code == 0 and "quantize: writing" in forced.stdout, forced.output


TASK = """task: tiny_task
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{prefix}{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' ' + text.split(' ')[-1]}}}}"
metric_list:
  - metric: acc
"""


def test_run_redoes_the_stages_whose_task_files_changed(tiny_llama, data_dir, tmp_path):
    """A user task's YAML or data file that changed redoes measure and eval (quantize follows the measurement's
    statistics): their manifest and report record the hashes of the files lm-eval reads; a manifest or report without
    them (an older hqtflow's) is redone. So is the eval when its ppl_file changed."""
    tasks, recipe, ppl = tmp_path / "tasks", tmp_path / "tiny.yaml", tmp_path / "ppl.txt"
    wiki = (data_dir / "wikitext2_test.txt").read_text()
    ppl.write_text(wiki[:4000])
    tasks.mkdir()
    data, yaml_file = tasks / "docs.jsonl", tasks / "tiny_task.yaml"
    docs = lambda *texts: data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    docs("The tower is tall", "The river runs west")
    yaml_file.write_text(TASK.format(data=data, prefix=""))
    recipe.write_text(yaml.safe_dump({
        "name": "tiny", "model": str(tiny_llama), "dtype": "bf16", "batch_size": 2, "max_length": 64,
        "config": str(ROOT / "quantization_config/maxabs_measure.json"), "output": str(tmp_path / "run" / "measure"),
        "quant_config": str(ROOT / "quantization_config/cpu_quant.json"),
        "calibration": {"tasks": ["tiny_task"], "include_path": "tasks", "limit": 2},
        "eval": {"tasks": ["tiny_task"], "include_path": "tasks", "limit": 2, "ppl_file": "ppl.txt", "ppl_windows": 1},
    }))

    def run(*redone):
        r = run_cli("run", recipe)
        assert r.exit_code == 0, r.output
        assert [s for s in ("measure", "eval") if f"{s}: writing" in r.stdout] == list(redone), r.stdout

    run("measure", "eval")
    run()
    docs("A small town grew up", "The river runs west")  # the data changed
    run("measure", "eval")
    yaml_file.write_text(TASK.format(data=data, prefix="Text: "))  # the task changed
    run("measure", "eval")
    run()
    ppl.write_text(wiki[4000:8000])  # the eval's text changed
    run("eval")
    edit_manifest(tmp_path / "run" / "measure", lambda m: m["data"]["calibration"]["sources"][0].pop("files"))
    edit_json(tmp_path / "run" / "eval.json", lambda r: r.pop("files"))
    run("measure", "eval")


def test_run_redoes_the_stages_of_a_changed_model_only(tiny_llama, data_dir, tmp_path, monkeypatch):
    """The model's fingerprint hashes its whole weights and its tokenizer, chat template and generation config: a
    weight changed anywhere, or a tokenizer setting, redoes measure and quantize; a new chat template (a file, or
    tokenizer_config.json's) redoes quantize only (the checkpoint carries it; calibration applies none); the same
    recipe, output and model spelled otherwise (relative, absolute) redoes nothing; `model` is read from the recipe's
    folder wherever hqtflow runs."""
    import shutil

    from safetensors.torch import load_file, save_file

    from hqtflow import models

    proj = tmp_path / "proj"
    shutil.copytree(tiny_llama, proj / "model")
    recipe = write_recipe(proj / "tiny.yaml", "model", data_dir, 2)
    edit = yaml.safe_load(recipe.read_text())
    recipe.write_text(yaml.safe_dump({**edit, "output": "run/measure"}))  # from where hqtflow runs

    def run(*args, redone=()):
        r = run_cli("run", *args)
        assert r.exit_code == 0, r.output
        assert [s for s in ("measure", "quantize", "eval") if f"{s}: writing" in r.stdout] == list(redone), r.stdout

    monkeypatch.chdir(proj)
    run(recipe, redone=("measure", "quantize", "eval"))
    run("tiny.yaml", "-o", proj / "run" / "measure")
    run("./tiny.yaml", "--model", proj / "model", "-o", "run/../run/measure")
    monkeypatch.chdir(tmp_path)  # the model is the recipe's neighbour still; the output is another
    run(recipe, "-o", proj / "run" / "measure")
    weights = proj / "model" / "model.safetensors"
    tensors = load_file(weights)
    name = max(n for n in tensors if n.endswith("mlp.down_proj.weight"))  # the last layer's
    tensors[name][-1] *= 16  # the last row: far past any sampled first bytes
    save_file(tensors, weights, metadata={"format": "pt"})
    run(recipe, "-o", proj / "run" / "measure", redone=("measure", "quantize", "eval"))
    checkpoint = read_manifest(proj / "run" / "fp8", ArtifactKind.CHECKPOINT)
    assert checkpoint.model == models.fingerprint(proj / "model")
    (proj / "model" / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    run(recipe, "-o", proj / "run" / "measure", redone=("quantize", "eval"))
    assert "[{{ m['content'] }}]" in (proj / "run" / "fp8" / "chat_template.jinja").read_text()
    run(recipe, "-o", proj / "run" / "measure")
    config = proj / "model" / "tokenizer_config.json"
    edit_json(config, lambda c: c.update(chat_template="{{ messages[0]['content'] }}"))
    run(recipe, "-o", proj / "run" / "measure", redone=("quantize", "eval"))
    edit_json(config, lambda c: c.update(model_max_length=77))
    run(recipe, "-o", proj / "run" / "measure", redone=("measure", "quantize", "eval"))


def test_run_checks_every_stage_before_the_first(tiny_llama, data_dir, tmp_path):
    """A later stage's wrong setting (a MEASURE config as quant_config, an unknown eval task) is refused before
    measure runs, naming the recipe key; nothing is written."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    for key, value, words in (("quant_config", "maxabs_measure", r"'quant_config': .*maxabs_measure.json has mode MEASURE"),
                              ("config", "maxabs_quant", r"'config': .*maxabs_quant.json has mode QUANTIZE"),
                              ("eval", {"tasks": ["no_such_task"]}, r"'eval.tasks': Unknown lm-eval task 'no_such_task'")):
        recipe.write_text(yaml.safe_dump({**raw, key: value}))
        r = run_cli("run", recipe)
        assert r.exit_code != 0 and re.search(words, r.stderr) and "writing" not in r.stdout, r.output
        assert not (tmp_path / "run").exists()


def test_generate_and_eval(tiny_llama, wiki_text, data_dir, tmp_path):
    meas, ck = tmp_path / "m", tmp_path / "fp8"
    assert run_cli("measure", tiny_llama, "-o", meas, "--text", wiki_text, "--limit", "2").exit_code == 0
    assert run_cli("quantize", "-m", meas, "-o", ck).exit_code == 0
    g = run_cli("generate", ck, "-p", "The tower is", "--max-new-tokens", "5")
    assert g.exit_code == 0 and g.stdout.strip()
    rep = tmp_path / "r.json"
    e = run_cli("eval", ck, "--tasks", "piqa_local", "--data-dir", data_dir, "--limit", "4",
                "--ppl-file", data_dir / "wikitext2_test.txt", "--ppl-windows", "1", "--report", rep)
    assert e.exit_code == 0, e.output
    assert "piqa_local" in e.stdout and "Δ fp8" in e.stdout
    for bar in ("bf16: lm-eval piqa_local", "fp8: lm-eval piqa_local", "fp8: perplexity"):  # progress on stderr
        assert bar in e.stderr, e.stderr
    assert re.search(r"fp8: perplexity: 100%\|\S*\| 1/1 ", e.stderr) and re.search(r"fp8: lm-eval.* 8/8 ", e.stderr)
    assert not re.search(r": 0request ", e.stderr)  # no empty bar before lm-eval hands its requests over
    data = json.loads(rep.read_text())
    assert data["models"]["bf16"] == str(tiny_llama) and data["results"]["fp8"]["tasks"]["piqa_local"]["sample_len"] == 4
    recorded = [*data["models"].values(), data["settings"]["data_dir"], data["settings"]["ppl_file"]]
    assert all(Path(p).is_absolute() for p in recorded), recorded  # one convention: absolute paths
    again = run_cli("eval", ck, "--ppl-file", data_dir / "wikitext2_test.txt", "--report", rep)
    assert again.exit_code == 3 and "already exists" in again.stderr
    none = run_cli("eval", ck)
    assert none.exit_code == 2 and "Nothing to evaluate" in none.stderr


def test_run_recipe_on_several_cards_unifies_to_one_rank(tiny_llama, data_dir, tmp_path):
    """A recipe with `cards: 2` measures on 2 ranks, unifies them to one beside the measurement (measure-unified),
    quantizes that; a second run finds every stage up to date."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    raw["cards"] = 2
    del raw["eval"]
    recipe.write_text(yaml.safe_dump(raw))
    first = run_cli("run", recipe)
    assert first.exit_code == 0, first.output
    unified = tmp_path / "run" / "measure-unified"
    assert f"unify: writing {unified} (ranks 0-1 -> 1)" in first.stdout
    assert read_manifest(tmp_path / "run" / "measure", ArtifactKind.MEASUREMENT).data["world_size"] == 2
    assert read_manifest(tmp_path / "run" / "fp8", ArtifactKind.CHECKPOINT).data["source_measurement"] == str(unified)
    second = run_cli("run", recipe)
    assert second.exit_code == 0, second.output
    assert second.stdout.count("up to date, skipped") == 3, second.stdout


def test_run_recipe_evaluates_with_the_kv_cache_it_quantized_for(tiny_llama, data_dir, tmp_path):
    """A recipe quantizing with `kv_cache: fp8` is evaluated through the FP8 KV cache (it was scored with a bf16 one,
    unlike the checkpoint's use); its `eval.kv_cache` overrides that, and changing it redoes the eval only."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    raw["kv_cache"] = "fp8"
    recipe.write_text(yaml.safe_dump(raw))
    r = run_cli("run", recipe)
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["settings"]["kv_cache"] == "fp8" and report["eval"]["kv_cache"] == "fp8"
    rep = tmp_path / "kv.json"
    e = run_cli("eval", tmp_path / "run" / "fp8", "--no-baseline", "--ppl-file", data_dir / "wikitext2_test.txt",
                "--ppl-windows", "2", "--kv-cache", "fp8", "--report", rep)
    assert e.exit_code == 0, e.output
    assert json.loads(rep.read_text())["results"]["fp8"] == report["results"]["fp8"]
    raw["eval"]["kv_cache"] = "bf16"
    recipe.write_text(yaml.safe_dump(raw))
    r = run_cli("run", recipe)
    assert r.exit_code == 0, r.output
    assert [s for s in ("measure", "quantize", "eval") if f"{s}: writing" in r.stdout] == ["eval"], r.stdout
    bf16 = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert bf16["settings"]["kv_cache"] == "bf16" and bf16["results"]["fp8"] != report["results"]["fp8"]
    raw["kv_cache"], raw["eval"]["kv_cache"] = "bf16", "fp8"  # no k/v scales to score with: refused before measuring
    recipe.write_text(yaml.safe_dump(raw))
    r = run_cli("run", recipe)
    assert r.exit_code == 2 and "'eval.kv_cache'" in r.stderr and "writing" not in r.stdout, r.output


def test_run_recipe_names_eval_kv_cache_where_the_fp8_kv_cache_cannot_score(tiny_factory, data_dir, tmp_path):
    """Perplexity through the FP8 KV cache (FP8StaticCache) takes full-attention models only: a recipe with
    `kv_cache: fp8` over Gemma 2 (sliding-window layers) ran measure, quantize and the bf16 baseline, then ended in a
    ValueError traceback (exit 1); later it was refused before scoring, but after measuring and quantizing. It is
    refused before measuring, naming the recipe key `run` reads (eval.kv_cache); with eval's KV cache bf16 the recipe
    runs, and `hqtflow eval` over its checkpoint names its --kv-cache."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_factory("gemma2"), data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    raw["kv_cache"] = "fp8"
    recipe.write_text(yaml.safe_dump(raw))
    r = run_cli("run", recipe)
    assert r.exit_code == 2 and "Traceback" not in r.output and "writing" not in r.stdout, r.output
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("Error: ") and "'eval.kv_cache'" in err and "sliding-window" in err, r.stderr
    assert "set eval.kv_cache to bf16" in err and not list(tmp_path.glob("run/*")), r.stderr
    raw["eval"]["kv_cache"] = "bf16"
    recipe.write_text(yaml.safe_dump(raw))
    assert run_cli("run", recipe).exit_code == 0
    e = run_cli("eval", tmp_path / "run" / "fp8", "--no-baseline", "--ppl-file", data_dir / "wikitext2_test.txt",
                "--ppl-windows", "1", "--kv-cache", "fp8")
    assert e.exit_code == 2 and "give --kv-cache bf16" in e.stderr and "Traceback" not in e.output, e.output


def test_run_recipe_refuses_an_fp8_kv_cache_on_several_cards_before_measuring(tiny_llama, data_dir, tmp_path):
    """KV-cache statistics are recorded on one rank only: a recipe with `kv_cache: fp8` and `cards: 2` measured on
    2 ranks, unified them, then quantize refused naming `--tp 1` and `--kv-cache fp8` (flags run does not have).
    It is refused before measuring, naming the recipe keys."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    raw["kv_cache"], raw["cards"] = "fp8", 2
    recipe.write_text(yaml.safe_dump(raw))
    r = run_cli("run", recipe)
    assert r.exit_code == 2 and "writing" not in r.stdout and not (tmp_path / "run").exists(), r.output
    err = r.stderr.strip()
    assert err.startswith(f"Error: Recipe {recipe}, 'kv_cache'") and "cards: 1" in err and "--" not in err, err


def test_run_recipe_refuses_an_fp8_kv_cache_for_latent_attention(tiny_factory, data_dir, tmp_path):
    """A recipe with `kv_cache: fp8` over DeepSeek (multi-head latent attention: its cache holds a compressed latent,
    not keys and values) measured, then quantize refused the statistics' layer0 (exit 3). Refused before measuring,
    naming the recipe key and the architecture (exit 2)."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_factory("deepseek_v3"), data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    raw["kv_cache"] = "fp8"
    recipe.write_text(yaml.safe_dump(raw))
    r = run_cli("run", recipe)
    assert r.exit_code == 2 and "writing" not in r.stdout and not (tmp_path / "run").exists(), r.output
    assert r.stderr.strip().splitlines()[-1] == (
        f"Error: Recipe {recipe}, 'kv_cache': fp8 cannot be used with deepseek_v3: its multi-head latent attention "
        "caches a compressed latent, not keys and values, which hqtflow's FP8 KV cache does not hold; set kv_cache: bf16.")


def test_run_recipe_with_fp8_kv_cache_builds_the_skeleton_once(tiny_llama, data_dir, tmp_path, monkeypatch):
    """`run` of a recipe with `kv_cache: fp8` built the model's meta skeleton to check the FP8 KV cache can hold the
    model before measuring, then quantize built it twice more; quantize now plans on the one the check built."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_llama, data_dir, 2)
    raw = yaml.safe_load(recipe.read_text())
    raw["kv_cache"] = "fp8"
    del raw["eval"]
    recipe.write_text(yaml.safe_dump(raw))
    calls = count_skeletons(monkeypatch)
    r = run_cli("run", recipe)
    assert r.exit_code == 0 and "quantize: writing" in r.stdout, r.output
    assert calls == ["pipeline.py:check_recipe"], calls
