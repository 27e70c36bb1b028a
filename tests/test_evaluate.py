"""In-process evaluation through the serving engine: the model's attention comes back after it (for the perplexity
pass and any later use), also when the engine fails to start; a model the engine cannot run is scored in padded
batches instead."""

import pytest
import torch


@pytest.fixture(scope="module")
def setup(tiny_llama, data_dir):
    from hqtflow import lmeval, models
    from hqtflow.evaluate import EvalSettings

    model, tok = models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama)
    s = EvalSettings(tasks=("piqa_local",), data_dir=str(data_dir), limit=3, batch_size=2,
                     ppl_file=str(data_dir / "wikitext2_test.txt"), ppl_window=64, ppl_windows=1)
    return model, tok, s, lmeval.task_manager([], data_dir, list(s.tasks))


def test_attention_is_given_back(setup, monkeypatch):
    from hqtflow.evaluate import evaluate, serving_engine
    from hqtflow.runtime import paged

    model, tok, s, manager = setup
    before = model.config._attn_implementation
    out = evaluate(model, tok, s, manager, show_progress=False)
    assert model.config._attn_implementation == before and out["wikitext"]["perplexity"] > 1
    monkeypatch.setattr(paged, "num_blocks", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("no room")))
    with pytest.raises(MemoryError), serving_engine(model, tok, batch_size=2, max_length=64):
        pass
    assert model.config._attn_implementation == before


def test_a_model_the_engine_cannot_run_is_scored_in_padded_batches(setup, monkeypatch):
    from hqtflow.evaluate import evaluate
    from hqtflow.runtime import paged

    model, tok, s, manager = setup
    engine = evaluate(model, tok, s, manager, show_progress=False)["tasks"]
    monkeypatch.setattr(paged, "install", lambda m: (_ for _ in ()).throw(ValueError("no kernel for this attention")))
    padded = evaluate(model, tok, s, manager, show_progress=False)["tasks"]
    assert padded["piqa_local"]["acc"] == engine["piqa_local"]["acc"]  # (fp32: the two paths agree)


DOCS = ["The tower is tall", "The river runs west", "A small town grew up"]
GEN_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{text.split(' ')[-1]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
filter_list:
  - name: first-word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
  - name: last-word
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def user_tasks(folder, **yamls) -> str:
    """Task YAMLs {name: text with {name} and {data}} in `folder`, over a 3-document JSON lines file; returns it."""
    import json

    folder.mkdir(exist_ok=True)
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    for name, text in yamls.items():
        (folder / f"{name}.yaml").write_text(text.format(name=name, data=data))
    return str(folder)


ROLLING_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def user_results(setup, tmp_path_factory):
    """The tiny model's results on a generate-until task of two filters, a rolling log-likelihood task and piqa."""
    from hqtflow import lmeval
    from hqtflow.evaluate import EvalSettings, evaluate

    model, tok, _, _ = setup
    folder = user_tasks(tmp_path_factory.mktemp("user") / "tasks", two_filters=GEN_TASK, rolling=ROLLING_TASK)
    s = EvalSettings(tasks=("two_filters", "rolling", "piqa_local"), include_path=(folder,), data_dir=setup[2].data_dir,
                     limit=2)
    return evaluate(model, tok, s, lmeval.task_manager([folder], s.data_dir, list(s.tasks)), show_progress=False)


def test_each_filter_keeps_its_value(user_results):
    """A task with two filter_list entries (as lm-eval's gsm8k: strict-match, flexible-extract) reports one value
    per filter; lm-eval's default filter `none` is left out of the key."""
    out = user_results["tasks"]
    assert {"exact_match,first-word", "exact_match,last-word"} <= set(out["two_filters"]), out
    assert "exact_match" not in out["two_filters"] and "acc" in out["piqa_local"]


def test_the_comparison_shows_every_metric_with_its_direction(user_results):
    """Every metric lm-eval reports gets a row (exact match, rolling perplexities, not only acc/acc_norm/perplexity),
    standard errors and the sample count none; lower-is-better metrics are marked so and get their delta in percent."""
    from hqtflow.evaluate import comparison_rows, format_table

    fp8 = {**user_results, "tasks": {t: {k: v * 1.5 for k, v in m.items()} for t, m in user_results["tasks"].items()}}
    rows = comparison_rows({"bf16": user_results, "fp8": fp8}, "bf16")
    got = {(r["task"], r["metric"]): r for r in rows}
    assert set(got) == {("two_filters", "exact_match,first-word"), ("two_filters", "exact_match,last-word"),
                        ("rolling", "word_perplexity"), ("rolling", "byte_perplexity"), ("rolling", "bits_per_byte"),
                        ("piqa_local", "acc"), ("piqa_local", "acc_norm")}, set(got)
    ppl = got["rolling", "word_perplexity"]
    assert ppl["higher_is_better"] is False and ppl["delta_pct"]["fp8"] == pytest.approx(50)
    assert got["piqa_local", "acc"]["higher_is_better"] is True and "delta_pct" not in got["piqa_local", "acc"]
    table = format_table(rows, ["bf16", "fp8"], "bf16")
    assert "word_perplexity ↓" in table and "exact_match,last-word ↑" in table and "(+50.00%)" in table, table


def test_a_task_yamls_path_names_the_task(setup, tmp_path):
    """A task YAML given by path (lm-eval's `--tasks DIR/task.yaml`): read by itself, as lm-eval's CLI reads it, and the
    results are the task's, under the name the file gives it."""
    from hqtflow import lmeval
    from hqtflow.evaluate import EvalSettings, evaluate

    model, tok, _, _ = setup
    path = str(tmp_path / "tasks" / "rolling.yaml")
    user_tasks(tmp_path / "tasks", rolling=ROLLING_TASK.replace("task: {name}", "task: my_rolling"))
    manager = lmeval.task_manager([], None, [path])
    lmeval.check_tasks([path], manager, None)
    out = evaluate(model, tok, EvalSettings(tasks=(path,), limit=1), manager, show_progress=False)
    assert list(out["tasks"]) == ["my_rolling"] and "word_perplexity" in out["tasks"]["my_rolling"]


def test_a_task_yaml_by_path_reads_its_include_and_function_not_its_folder(setup, tmp_path):
    """A task YAML given by path with an `include:` (relative to it) and a `!function` module beside it runs; neither
    lm-eval nor the record of task files reads the folder around it (a sub-folder of other tasks, a virtualenv's):
    the files are the YAML, its include, the module and the data."""
    from hqtflow import lmeval
    from hqtflow.eval_run import input_files
    from hqtflow.evaluate import EvalSettings, evaluate

    model, tok, _, _ = setup
    folder = tmp_path / "project"
    folder.mkdir()
    user_tasks(folder / "base", base=ROLLING_TASK.replace("task: {name}\n", ""))
    (folder / "fn.yml").write_text("include: base/base.yaml\ntask: my_fn\nprocess_docs: !function utils.shout\n")
    (folder / "utils.py").write_text("def shout(docs):\n    open(__file__ + '.ran', 'w').close()\n"
                                   "    return docs.map(lambda d: {'text': d['text'].upper()})\n")
    for junk in (folder / "other", folder / ".venv" / "lib" / "site-packages" / "lm_eval"):
        junk.mkdir(parents=True)
        (junk / "broken.yaml").write_text("task: [not, a, name\n")  # (lm-eval would refuse to index it)
        (junk / "mod.py").write_text("raise SystemExit('read')\n")
    path = str(folder / "fn.yml")
    manager = lmeval.task_manager([], None, [path])
    lmeval.check_tasks([path], manager, None)
    assert "my_fn" not in manager.all_tasks  # (the folder is no include path)
    files = input_files((path,), (), None, None, manager)
    assert sorted(files) == sorted(str(f) for f in (folder / "fn.yml", folder / "base" / "base.yaml",
                                                    folder / "utils.py", folder / "base" / "docs.jsonl"))
    out = evaluate(model, tok, EvalSettings(tasks=(path,), limit=1), manager, show_progress=False)
    assert list(out["tasks"]) == ["my_fn"] and "word_perplexity" in out["tasks"]["my_fn"]
    assert (folder / "utils.py.ran").exists()  # (the function ran)
    # an include path still walks its folder, less the virtualenv: the sub-folder's files are recorded
    walked = lmeval.task_files([path], [str(folder)], manager)
    assert str(folder / "other" / "broken.yaml") in walked and not any(".venv" in f for f in walked)


def test_lm_eval_context_is_capped_at_a_short_models_context(tiny_factory, data_dir):
    """lm-eval's context was a fixed 512 tokens: on a model with 32 learned positions a long document ran past the
    table (an IndexError, reported as a resource error). It is capped at the model's context, as perplexity is."""
    from hqtflow import lmeval, models
    from hqtflow.evaluate import EvalSettings, evaluate

    path = tiny_factory("gpt_bigcode", n_positions=32)
    model, tok = models.load_model(path, "fp32"), models.load_tokenizer(path)
    s = EvalSettings(tasks=("lambada_openai_local",), data_dir=str(data_dir), limit=2, batch_size=2)
    out = evaluate(model, tok, s, lmeval.task_manager([], data_dir, list(s.tasks)), show_progress=False)
    assert out["tasks"]["lambada_openai_local"]["perplexity"] > 1


def test_perplexity_runs_without_autograd(setup, data_dir, monkeypatch):
    """The perplexity pass runs under inference mode (a misplaced decorator once left it building autograd graphs
    for every window)."""
    from hqtflow.evaluate import perplexity

    model, tok, _, _ = setup
    modes = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **kw: modes.append(torch.is_inference_mode_enabled())
                        or forward(*a, **kw))
    perplexity(model, tok, (data_dir / "wikitext2_test.txt").read_text()[:4000], window=32, max_windows=2)
    assert modes and all(modes)


@pytest.fixture(scope="module")
def kv_checkpoint(tiny_kv):
    """The tiny model quantized with `--kv-cache fp8` (k_scale/v_scale in the checkpoint)."""
    return tiny_kv[1]


def _bench_fp8_kv_perplexity(model, tok, text, **kw):
    """bench/kv_cache_ppl.py's method: each window through its own FP8StaticCache with the checkpoint's scales."""
    import importlib.util
    from pathlib import Path

    from hqtflow.evaluate import perplexity
    from hqtflow.runtime.kv_cache import FP8StaticCache, kv_scales

    spec = importlib.util.spec_from_file_location("kv_cache_ppl", Path(__file__).parents[1] / "bench" / "kv_cache_ppl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    scales = kv_scales(model)
    return perplexity(bench._Cached(model, lambda n: FP8StaticCache(model.config, n, scales)), tok, text, **kw)


def test_a_ppl_files_byte_order_mark_is_no_text(tmp_path):
    """A --ppl-file saved with a UTF-8 byte order mark scores the same text (the mark was 3 tokens, and every window
    shifted), as calibration files read."""
    from hqtflow.evaluate import read_ppl_text

    (tmp_path / "plain.txt").write_text("The tower is tall.\n")
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "plain.txt").read_bytes())
    assert read_ppl_text(tmp_path / "bom.txt") == read_ppl_text(tmp_path / "plain.txt") == "The tower is tall.\n"


def test_fp8_kv_cache_perplexity_and_scores(kv_checkpoint, data_dir):
    """kv_cache "fp8": perplexity reads keys and values back through the FP8 KV cache (what bench/kv_cache_ppl.py
    measures, to the bit; not the bf16 number), and lm-eval's log-likelihoods come from the engine's FP8 KV cache."""
    import hqtflow
    from hqtflow.evaluate import perplexity, read_ppl_text, serving_engine

    model, tok = hqtflow.load(kv_checkpoint, backend="qdq")
    text = read_ppl_text(data_dir / "wikitext2_test.txt")
    bf16 = perplexity(model, tok, text, window=64, max_windows=3)
    fp8 = perplexity(model, tok, text, window=64, max_windows=3, kv_cache="fp8")
    assert fp8["perplexity"] != bf16["perplexity"] and fp8["windows"] == 3
    assert fp8["perplexity"] == _bench_fp8_kv_perplexity(model, tok, text, window=64, max_windows=3)["perplexity"]
    items = [(tok.encode(text[i * 300:(i + 1) * 300], add_special_tokens=False)[:40], 20) for i in range(3)]
    scores = {}
    for kv in ("bf16", "fp8"):
        with serving_engine(model, tok, batch_size=2, max_length=64, kv_cache=kv) as engine:
            scores[kv] = [lp for lp, _ in engine[0](items)]
    assert scores["fp8"] != scores["bf16"]


def test_eval_cli_kv_cache(kv_checkpoint, tiny_llama, data_dir, tmp_path):
    """`hqtflow eval --kv-cache fp8`: the checkpoint's perplexity through its FP8 KV cache (bench/kv_cache_ppl.py's
    number, not the bf16-KV one); a model without KV scales is refused with generate's sentence, an unknown value
    with exit 2."""
    import json

    import hqtflow
    from conftest import run_cli
    from hqtflow.evaluate import perplexity, read_ppl_text

    ppl, rep = data_dir / "wikitext2_test.txt", tmp_path / "fp8.json"
    r = run_cli("eval", kv_checkpoint, "--no-baseline", "--backend", "qdq", "--ppl-file", ppl, "--ppl-windows", "1",
                "--kv-cache", "fp8", "--report", rep)
    assert r.exit_code == 0, r.output
    got = json.loads(rep.read_text())
    assert got["settings"]["kv_cache"] == "fp8"
    model, tok = hqtflow.load(kv_checkpoint, backend="qdq")
    text = read_ppl_text(ppl)
    want = _bench_fp8_kv_perplexity(model, tok, text, max_windows=1)["perplexity"]
    assert got["results"]["fp8"]["wikitext"]["perplexity"] == want != perplexity(model, tok, text, max_windows=1)["perplexity"]
    refused = run_cli("eval", tiny_llama, "--no-baseline", "--ppl-file", ppl, "--kv-cache", "fp8")
    generate = run_cli("generate", tiny_llama, "--kv-cache", "fp8", "--max-new-tokens", "1")
    assert refused.exit_code == generate.exit_code != 0 and "Traceback" not in refused.output
    last = lambda r: r.stderr.strip().splitlines()[-1]  # noqa: E731 (after the weight-loading bar)
    assert "no KV-cache scales (k_scale/v_scale)" in last(refused) and last(refused) == last(generate)
    assert run_cli("eval", kv_checkpoint, "--ppl-file", ppl, "--kv-cache", "int8").exit_code == 2


def test_eval_cli_max_length(kv_checkpoint, data_dir, tmp_path, monkeypatch):
    """`hqtflow eval --max-length N`: lm-eval's context and the perplexity window (fixed at 512 before, whatever the
    task's prompts: a few-shot prompt was cut to its last 512 tokens, with no way to raise it); recorded in the
    report; below 1 refused."""
    import json

    from conftest import run_cli
    from hqtflow import lmeval

    seen = []
    build_lm = lmeval.build_lm
    monkeypatch.setattr(lmeval, "build_lm", lambda *a, **kw: seen.append(kw["max_length"]) or build_lm(*a, **kw))
    rep = tmp_path / "r.json"
    r = run_cli("eval", kv_checkpoint, "--no-baseline", "--tasks", "lambada_openai_local", "--data-dir", data_dir,
                "--limit", "2", "--ppl-file", data_dir / "wikitext2_test.txt", "--ppl-windows", "2",
                "--max-length", "24", "--report", rep)
    assert r.exit_code == 0, r.output
    got = json.loads(rep.read_text())
    assert seen == [24] and got["settings"]["max_length"] == got["settings"]["ppl_window"] == 24
    assert got["results"]["fp8"]["wikitext"]["window"] == 24 and got["results"]["fp8"]["wikitext"]["tokens"] == 2 * 23
    for bad in ("0", "1"):  # a 1-token window predicts no token: no perplexity (was a ZeroDivisionError traceback)
        r = run_cli("eval", kv_checkpoint, "--ppl-file", data_dir / "wikitext2_test.txt", "--max-length", bad)
        assert r.exit_code == 2 and f"--max-length must be at least 2, not {bad}." in r.stderr, r.output
