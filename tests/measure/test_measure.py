"""`hqtflow measure` end to end on a tiny random Llama: INC's file layout, exact statistics, padding, manifest."""

import json
import os

import numpy as np
import pytest
import torch

from conftest import ROOT, run_cli
from hqtflow.formats.artifact import read_manifest
from hqtflow.measure.calibration import batches, read_texts, token_chunks

CFG = ROOT / "quantization_config"


def measure(model, out, *extra):
    r = run_cli("measure", model, "-o", out, *extra)
    assert r.exit_code == 0, r.output
    return out


def linear_names(model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir)
    return [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]


@pytest.fixture(scope="module")
def text_run(tiny_llama, wiki_text, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "meas"
    return measure(tiny_llama, out, "--text", wiki_text, "--limit", "6", "--max-length", "64", "--batch-size", "4")


def test_inc_file_layout(text_run, tiny_llama):
    names = {p.name for p in text_run.iterdir()}
    assert names == {"measure_hooks_maxabs.json", "measure_hooks_maxabs.npz", "measure_hooks_maxabs_mod_list.json",
                     "quant_config.json", "hqtflow_manifest.json", "kv_cache_maxabs.json"}  # the last: hqtflow's own
    js = json.loads((text_run / "measure_hooks_maxabs.json").read_text())
    assert list(js)[:4] == ["NumSamples", "GlobalRank", "LocalRank", "Mode"]
    assert js["Mode"] == "DynamicRange" and js["LocalRank"] is None and js["NumSamples"] == 6
    assert set(js["Nodes"]) == set(linear_names(tiny_llama))
    node = js["Nodes"]["model.layers.0.self_attn.q_proj"]
    assert np.array(node["inputs"]).shape == (1, 1, 1) and np.array(node["params"]["weight"]).shape == (1, 1)
    assert "outputs" not in node  # maxabs default: outputs excluded
    mods = json.loads((text_run / "measure_hooks_maxabs_mod_list.json").read_text())
    assert mods == list(js["Nodes"])
    # the .npz (for INC) holds the same numbers; it is our own file, so reading its pickle here is safe
    npz = np.load(text_run / "measure_hooks_maxabs.npz", allow_pickle=True)["arr_0"].item()
    for k, v in js["Nodes"].items():
        np.testing.assert_array_equal(npz["Nodes"][k]["inputs"][0], np.array(v["inputs"][0], dtype=np.float32))
    inc = json.loads((text_run / "quant_config.json").read_text())
    assert inc["mode"] == "QUANTIZE" and inc["dump_stats_path"] == str(text_run.resolve() / "measure")


def test_manifest(text_run, tiny_llama, wiki_text):
    from hqtflow.models import fingerprint

    m = read_manifest(text_run, "hqtflow.measurement")
    assert m.model == fingerprint(tiny_llama)
    assert set(m.files) == {"measure_hooks_maxabs.json", "measure_hooks_maxabs.npz",
                            "measure_hooks_maxabs_mod_list.json", "quant_config.json", "kv_cache_maxabs.json"}
    d = m.data
    assert d["world_size"] == 1 and d["statistics_dtype"] == "float32"
    cal = d["calibration"]
    assert cal["samples"] == 6 and cal["tokens"] == 6 * 64
    assert cal["sources"][0]["kind"] == "text" and len(cal["sources"][0]["sha256"]) == 64
    assert m.raw["config"]["mode"] == "MEASURE" and m.raw["tool"]["torch"] == torch.__version__
    assert d["ranks"][0]["layers"]["model.layers.0.mlp.down_proj"]["style"] == "replicated"


def reference_stats(model_dir, chunks, dtype=torch.bfloat16):
    """Independent maxabs: plain forward hooks, one sequence at a time (no padding at all)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    stats = {}

    def hook(name):
        def f(mod, args, out):
            a, o = args[0].abs().max().float().item(), out.abs().max().float().item()
            i0, o0 = stats.get(name, (0.0, 0.0))
            stats[name] = (max(i0, a), max(o0, o))
        return f

    for n, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(hook(n))
    with torch.inference_mode():
        for c in chunks:
            model(torch.tensor([c]))
    weights = {n: mod.weight.abs().max().float().item() for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    return stats, weights


def test_statistics_equal_reference(text_run, tiny_llama, wiki_text):
    from hqtflow.models import load_tokenizer

    chunks = token_chunks(read_texts(wiki_text, "text"), load_tokenizer(tiny_llama), 64, 6)
    ref, weights = reference_stats(tiny_llama, chunks)
    js = json.loads((text_run / "measure_hooks_maxabs.json").read_text())["Nodes"]
    for name, node in js.items():
        assert node["inputs"][0][0][0] == pytest.approx(ref[name][0], rel=1e-2), name
        assert node["params"]["weight"][0][0] == weights[name], name


def test_text_windows_are_batched_with_their_length_never_padded():
    """Windows of one length share a batch, longest first and otherwise in order: no row is padded (a padded batch
    changed SmolLM2's bf16 statistics by up to 4.7% between --batch-size 1 and 8)."""
    chunks = [[1] * 4, [2] * 2, [3] * 4, [4] * 3, [5] * 4, [6] * 2]
    got = [(b.input_ids.tolist(), bool(b.attention_mask.all())) for b in batches(chunks, 2)]
    assert got == [([[1] * 4, [3] * 4], True), ([[5] * 4], True), ([[4] * 3], True), ([[2] * 2, [6] * 2], True)]


def test_text_statistics_do_not_depend_on_the_batch_size(tiny_llama, tmp_path):
    """Records of different lengths give, in bf16, the same statistics bit for bit in batches as one by one: only
    windows of one length share a batch (padded to the longest, a batch's bf16 rounding changed its rows' values)."""
    recs = tmp_path / "c.jsonl"
    texts = ["The tower is 324 metres tall.", "A short one.", "The river is 776 km long.",
             "It was the first structure to reach a height of 300 metres, and it remained so for decades.", "Ok.",
             "The tower is 325 metres tall.", "It is the tallest structure in Paris.", "A short two."]
    recs.write_text("\n".join(json.dumps({"text": t}) for t in texts))
    cfg = CFG / "maxabs_measure_include_outputs.json"
    a = measure(tiny_llama, tmp_path / "batched", "--text", recs, "--batch-size", "8", "-c", cfg)
    b = measure(tiny_llama, tmp_path / "single", "--text", recs, "--batch-size", "1", "-c", cfg)
    for name in ("measure_hooks_maxabs.json", "measure_hooks_maxabs.npz", "kv_cache_maxabs.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    man = read_manifest(a, "hqtflow.measurement").data["calibration"]
    assert man["samples"] == len(texts) and man["tokens"] < len(texts) * 30


def test_outputs_per_channel_and_blocklist(tiny_llama, wiki_text, tmp_path):
    cfg = tmp_path / "pc.json"
    cfg.write_text(json.dumps({"mode": "MEASURE", "observer": "maxabs_per_channel", "measure_exclude": "NONE",
                               "blocklist": {"names": ["lm_head"]}, "dump_stats_path": "./x/stats"}))
    out = measure(tiny_llama, tmp_path / "pc", "--text", wiki_text, "--limit", "2", "--max-length", "32", "-c", cfg)
    js = json.loads((out / "stats_hooks_maxabs_per_channel.json").read_text())["Nodes"]
    assert "lm_head" not in js
    q = js["model.layers.0.self_attn.q_proj"]
    assert np.array(q["inputs"]).shape == (1, 64, 1)  # (C_in, 1) per input
    assert np.array(q["outputs"]).shape == (1, 64, 1)
    assert np.array(q["params"]["weight"]).shape == (64, 1)  # per output channel
    k = js["model.layers.0.self_attn.k_proj"]
    assert np.array(k["outputs"]).shape == (1, 32, 1)  # 2 KV heads x 16: KV-cache scales come from here
    man = read_manifest(out, "hqtflow.measurement").data
    assert man["ranks"][0]["skipped"] == {"lm_head": "excluded by allowlist/blocklist"}


def test_lm_eval_calibration(tiny_llama, data_dir, tmp_path):
    out = measure(tiny_llama, tmp_path / "ev", "--tasks", "piqa_local", "--data-dir", data_dir, "--limit", "3",
                  "--batch-size", "4")
    d = read_manifest(out, "hqtflow.measurement").data["calibration"]
    src = d["sources"][0]
    assert src["kind"] == "lm-eval" and src["tasks"] == ["piqa_local"]
    assert src["results"]["piqa_local"]["sample_len"] == 3
    assert d["samples"] == 6  # 3 documents x 2 choices


def test_lm_eval_padding_is_not_observed(tiny_factory, data_dir, tmp_path):
    """lm-eval's requests of different lengths batched together (right padding) give the statistics of one by one,
    inputs and outputs (in fp32, where batching changes no rounding that matters)."""
    model = tiny_factory("llama", dtype="float32")
    cfg = CFG / "maxabs_measure_include_outputs.json"
    runs = [measure(model, tmp_path / str(b), "--tasks", "piqa_local", "--data-dir", data_dir, "--limit", "3",
                    "--batch-size", str(b), "--dtype", "fp32", "-c", cfg) for b in (4, 1)]
    batched, single = (json.loads((r / "measure_hooks_maxabs.json").read_text())["Nodes"] for r in runs)
    assert batched.keys() == single.keys()
    for name in batched:
        for key in ("inputs", "outputs"):
            np.testing.assert_allclose(batched[name][key], single[name][key], rtol=1e-5, err_msg=f"{name} {key}")


def test_overwrite(text_run, tiny_llama, wiki_text, tmp_path):
    out = measure(tiny_llama, tmp_path / "o", "--text", wiki_text, "--limit", "1", "--max-length", "16")
    r = run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "1")
    assert r.exit_code == 3 and "already exists; pass --overwrite" in r.output
    measure(tiny_llama, out, "--text", wiki_text, "--limit", "2", "--max-length", "16", "--overwrite")
    assert read_manifest(out, "hqtflow.measurement").data["calibration"]["samples"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["o"]


def test_only_rank_0_draws_progress_bars():
    """Under torchrun (RANK set) the other ranks' tqdm bars are off before anything imports tqdm."""
    import subprocess
    import sys

    from conftest import ROOT

    code = ("import runpy, sys\nsys.argv = ['hqtflow', 'version']\ntry:\n    runpy.run_module('hqtflow', run_name='__main__')\n"
            "except SystemExit:\n    pass\nfrom tqdm import tqdm\nprint(tqdm(range(2)).disable)")
    for rank, disabled in (("0", "False"), ("1", "True"), ("2", "True")):
        env = {k: v for k, v in __import__("os").environ.items() if k != "TQDM_DISABLE"}
        env.update(RANK=rank, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert r.stdout.split()[-1:] == [disabled], (rank, r.stdout, r.stderr)


# ---- --max-length and the model's context (the tiny Llama's: 256 tokens) ------------------------------------
def test_max_length_defaults_to_the_model_context(tiny_llama, wiki_text, tmp_path):
    """Not given, --max-length is the model's context up to 512: 256 here, what the manifest records (and what
    `hqtflow run` compares a recipe without max_length against, so the measurement stays current)."""
    from hqtflow.measure.settings import MeasureSettings
    from hqtflow.pipeline import measurement_is_current

    out = measure(tiny_llama, tmp_path / "d", "--text", wiki_text, "--limit", "2")
    d = read_manifest(out, "hqtflow.measurement").data
    assert d["calibration"]["max_length"] == d["settings"]["max_length"] == 256
    assert d["calibration"]["tokens"] == 2 * 256
    assert measurement_is_current(MeasureSettings(output=str(out), model=str(tiny_llama), text=(str(wiki_text),), limit=2))


def test_max_length_up_to_the_context_is_kept(tiny_llama, wiki_text, tmp_path):
    out = measure(tiny_llama, tmp_path / "e", "--text", wiki_text, "--limit", "1", "--max-length", "256")
    assert read_manifest(out, "hqtflow.measurement").data["calibration"]["tokens"] == 256


@pytest.mark.parametrize("recipe", [False, True], ids=["flag", "recipe"])
def test_max_length_longer_than_the_context_is_refused(recipe, tiny_llama, wiki_text, tmp_path):
    """An explicit --max-length (or a recipe's max_length) past the model's context: one sentence naming both
    numbers, exit 2, nothing written."""
    out = tmp_path / "out"
    if recipe:
        path = tmp_path / "r.yaml"
        path.write_text(f"model: {tiny_llama}\nmax_length: 1000\ncalibration: {{text: {wiki_text}, limit: 1}}\n")
        r = run_cli("measure", "--recipe", path, "-o", out)
        label = "--max-length (a recipe's `max_length`) 1000"
    else:
        r = run_cli("measure", tiny_llama, "-o", out, "--text", wiki_text, "--limit", "1", "--max-length", "1000")
        label = "--max-length 1000"
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == (f"Error: {label} is longer than the model's context of 256 tokens "
                                f"(max_position_embeddings in {tiny_llama / 'config.json'}); give at most 256, "
                                "or leave it out to use 256."), r.stderr
    assert "Traceback" not in r.output and r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == (["r.yaml"] if recipe else [])


@pytest.mark.parametrize("config,given,expected", [
    ({"max_position_embeddings": 4096}, None, 512),
    ({"max_position_embeddings": 128}, None, 128),
    ({"n_positions": 1024}, None, 512),
    ({"text_config": {"max_position_embeddings": 200}}, None, 200),
    ({}, None, 512),  # a config naming no context: the default, and a given value, are kept
    ({}, 4096, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192, 8192),
    ({"max_position_embeddings": 4096}, 4096, 4096),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "yarn", "factor": 4.0,  # Qwen2.5's long-context recipe
                                                        "original_max_position_embeddings": 4096}}, 16384, 16384),
])
def test_resolve_max_length(config, given, expected, tmp_path):
    from hqtflow.measure.run import resolve_max_length
    from hqtflow.measure.settings import MeasureSettings

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_max_length(MeasureSettings(output="o", max_length=given), tmp_path).max_length == expected


def test_token_chunks_tokenize_only_what_the_limit_needs(tiny_llama, wiki_text, tmp_path):
    """The chunks are those of the whole text tokenized at once, but a long text is not tokenized past the limit's
    need (a one-line file of many MB with --limit 1 took minutes and gigabytes)."""
    from hqtflow.models import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    texts = read_texts(wiki_text, "text")
    whole = tok.encode(texts[0], add_special_tokens=False)
    for max_length, limit in ((16, 1), (64, 6), (100, 37), (64, None)):
        n = len(whole) if limit is None else limit * max_length
        expected = [whole[i:i + max_length] for i in range(0, min(n, len(whole)), max_length)]
        assert token_chunks(texts, tok, max_length, limit) == expected, (max_length, limit)

    seen = []
    encode = tok.encode
    tok.encode = lambda text, **kw: seen.append(len(text)) or encode(text, **kw)
    big = "word " * 600_000  # 3 MB on one line
    assert token_chunks([big], tok, 16, 1) == [encode(big[:1000], add_special_tokens=False)[:16]]
    assert max(seen) < 100_000, seen


GEN_TASK = """task: gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{text}}}}"
doc_to_target: " tall"
generation_kwargs:
  until: {until}
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""
PROMPT = "The tower is"


def gen_task(folder, until) -> str:
    """A generate-until task over one document (PROMPT) stopping at `until`, in `folder`; returns the folder."""
    folder.mkdir()
    (folder / "doc.jsonl").write_text(json.dumps({"text": PROMPT}) + "\n")
    (folder / "gen.yaml").write_text(GEN_TASK.format(data=folder / "doc.jsonl", until=json.dumps(until)))
    return folder


def greedy_tokens(model_dir) -> tuple[int, list[int]]:
    """PROMPT's token count and the tiny model's greedy continuation of it (6 tokens, or up to EOS), by transformers."""
    from hqtflow import models

    model, tok = models.load_model(model_dir, "fp32"), models.load_tokenizer(model_dir)
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    return ids.shape[1], out[0, ids.shape[1]:].tolist()


def test_a_generate_until_task_calibrates_and_counts_what_ran(tiny_llama, tmp_path):
    """Generation is observed and counted: the document is a sample, and its tokens are the prompt's and each
    generated token fed back (all but the last); a task that only generates calibrates."""
    prompt, generated = greedy_tokens(tiny_llama)
    folder = gen_task(tmp_path / "tasks", ["never said"])
    out = measure(tiny_llama, tmp_path / "m", "--tasks", "gen", "--include-path", folder, "--limit", "1", "--dtype", "fp32")
    data = read_manifest(out, "hqtflow.measurement").data
    assert data["calibration"]["samples"] == 1 and data["calibration"]["tokens"] == prompt + len(generated) - 1
    assert json.loads((out / "measure_hooks_maxabs.json").read_text())["NumSamples"] == 1
    assert set(data["calibration"]["sources"][0]["results"]["gen"]) == {"exact_match", "sample_len"}


def test_generation_stops_at_the_tasks_until(tiny_llama, tmp_path):
    """measure's generation ends at the token completing one of the task's `until` strings, as lm-eval's hf model
    does: no token after it runs through the model (nor is observed)."""
    from hqtflow import models

    prompt, generated = greedy_tokens(tiny_llama)
    stop = models.load_tokenizer(tiny_llama).decode(generated[:1])
    assert len(generated) > 1 and stop.strip(), generated  # (the first generated token ends the generation)
    folder = gen_task(tmp_path / "tasks", ["never said", stop])
    out = measure(tiny_llama, tmp_path / "m", "--tasks", "gen", "--include-path", folder, "--limit", "1", "--dtype", "fp32")
    assert read_manifest(out, "hqtflow.measurement").data["calibration"]["tokens"] == prompt  # the prompt alone


def test_a_task_yamls_path_names_the_task(tiny_llama, tmp_path):
    """`--tasks DIR/task.yaml` (as lm-eval's CLI takes it): the file read by itself, the task named by it;
    a path that is no file, or a YAML defining no task, is refused naming the file."""
    folder = gen_task(tmp_path / "tasks", ["\n"])
    out = measure(tiny_llama, tmp_path / "m", "--tasks", folder / "gen.yaml", "--limit", "1")
    assert set(read_manifest(out, "hqtflow.measurement").data["calibration"]["sources"][0]["results"]) == {"gen"}
    (folder / "notes.yaml").write_text("description: no task here\n")
    for path, why in ((folder / "nope.yaml", "does not exist"), (folder / "notes.yaml", "defines no task")):
        r = run_cli("measure", tiny_llama, "-o", tmp_path / "n", "--tasks", path, "--limit", "1")
        assert r.exit_code == 5 and f"lm-eval task file {path} {why}" in r.stderr, r.output


def test_context_length_of_rope_scalings():
    """YaRN stretches original_max_position_embeddings (Qwen2.5 adds it beside an unchanged max_position_embeddings;
    DeepSeek-V3's already counts it), as vLLM derives a model's length; llama3 scaling already counts in it."""
    from hqtflow.models import context_length

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_length({"max_position_embeddings": 32768, "rope_scaling": yarn})[0] == 131072
    deepseek = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}
    assert context_length({"max_position_embeddings": 163840, "rope_scaling": deepseek}) == (163840, "max_position_embeddings")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    assert context_length({"max_position_embeddings": 131072, "rope_scaling": llama3})[0] == 131072


def perplexity_task(tmp_path, field: str) -> None:
    """A user's lm-eval task tl in tmp_path/t.yaml: perplexity of " tall" after each record's `field`, over the
    records of tmp_path/d.jsonl."""
    (tmp_path / "t.yaml").write_text(f"""task: tl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'd.jsonl'}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{{field}}}}}"
doc_to_target: " tall"
metric_list:
  - metric: perplexity
""")


@pytest.mark.parametrize("data", [b"", b'{"text": "The tower is tall"}\n{"text": "The riv', bytes(range(256))])
def test_a_user_tasks_unreadable_data_is_one_sentence(data, tiny_llama, tmp_path):
    """A task's data file that is empty, cut short or not JSON: exit 5 naming the task, nothing written (datasets
    raised DatasetGenerationError or StopIteration through lm-eval)."""
    (tmp_path / "d.jsonl").write_bytes(data)
    perplexity_task(tmp_path, "text")
    r = run_cli("measure", tiny_llama, "-o", tmp_path / "m", "--tasks", tmp_path / "t.yaml", "--limit", "2")
    assert r.exit_code == 5 and "The data of lm-eval task tl cannot be read" in r.stderr, r.output
    assert not (tmp_path / "m").exists() and r.stderr.strip().splitlines()[-1].startswith("Error: The data of lm-eval task tl")


def refused(args, code: int, words: str) -> None:
    """`hqtflow ARGS` is refused in one sentence holding `words`, with exit `code`, no traceback."""
    r = run_cli(*args)
    err = r.stderr.strip()
    assert r.exit_code == code and "Traceback" not in r.output, r.output
    assert err.startswith("Error: ") and len(err.splitlines()) == 1 and words in err, err


def test_a_lone_surrogate_in_a_jsonl_record_is_one_sentence(tiny_llama, tmp_path):
    """JSON's `\\ud800` unpaired decodes to a code point no tokenizer takes (a TypeError traceback from the fast
    tokenizer): refused naming the file and line, exit 5."""
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 surrogate"}\n')
    refused(["measure", tiny_llama, "-o", tmp_path / "m", "--text", tmp_path / "s.jsonl"], 5,
            f"{tmp_path / 's.jsonl'} line 2: field 'text' holds a lone UTF-16 surrogate")
    assert not (tmp_path / "m").exists()


def test_a_task_yamls_missing_function_module_is_refused_before_the_model_loads(tiny_llama, tmp_path):
    """`doc_to_text: !function nomod.fn` without a nomod module: one sentence, exit 5, from measure's and eval's
    preflight (task_yaml.load_task_yaml's ImportError was a traceback after the model loaded)."""
    gen_task(tmp_path / "tasks", ["\n"])
    yaml_file = tmp_path / "tasks" / "gen.yaml"
    yaml_file.write_text(yaml_file.read_text().replace('"{{text}}"', "!function nomod.fn"))
    words = f"lm-eval task file {yaml_file} names a `!function` that cannot be loaded: Cannot import module 'nomod'"
    for task in (["--tasks", yaml_file], ["--tasks", "gen", "--include-path", tmp_path / "tasks"]):
        refused(["measure", tiny_llama, "-o", tmp_path / "m", *task, "--limit", "1"], 5, words)
        refused(["eval", tiny_llama, *task, "--limit", "1"], 5, words)


def test_a_template_field_the_data_lacks_is_one_sentence(tiny_llama, tmp_path):
    """A custom task whose doc_to_text uses {{query}} over records without it: one sentence naming the task and the
    variable, exit 5, from measure and eval (jinja2's UndefinedError was a traceback out of lmeval.run_tasks)."""
    (tmp_path / "d.jsonl").write_text('{"text": "The tower is tall"}\n')
    perplexity_task(tmp_path, "query")
    words = "The template of lm-eval task tl uses a field its data's records lack ('query' is undefined)."
    for cmd in (["measure", tiny_llama, "-o", tmp_path / "m"], ["eval", tiny_llama]):
        r = run_cli(*cmd, "--tasks", tmp_path / "t.yaml", "--limit", "1")
        assert r.exit_code == 5 and "Traceback" not in r.output, r.output
        assert r.stderr.strip().splitlines()[-1] == f"Error: {words}", r.stderr
    assert not (tmp_path / "m").exists()


def test_generation_stays_within_max_length(tiny_llama, tmp_path):
    """A task's max_gen_toks (6) past --max-length (4): the prompt cut to its last token and 3 tokens generated, so
    no sequence runs longer than --max-length (max_gen_toks were generated after it, past the model's context)."""
    prompt, generated = greedy_tokens(tiny_llama)
    assert prompt > 1 and len(generated) == 6, generated
    folder = gen_task(tmp_path / "tasks", ["never said"])
    out = measure(tiny_llama, tmp_path / "m", "--tasks", "gen", "--include-path", folder, "--limit", "1", "--dtype", "fp32",
                  "--max-length", "4")
    assert read_manifest(out, "hqtflow.measurement").data["calibration"]["tokens"] == 1 + 3 - 1


def test_odd_text_files(tmp_path):
    """A UTF-8 byte order mark is no text (it was a token, and made a .jsonl's first line invalid JSON); the .jsonl
    suffix is matched in any case (.JSONL was read as one plain text)."""
    (tmp_path / "b.txt").write_bytes(b"\xef\xbb\xbfThe tower is tall.")
    (tmp_path / "b.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "one"}\n{"text": "two"}\n')
    (tmp_path / "u.JSONL").write_text('{"text": "one"}\n')
    assert read_texts(tmp_path / "b.txt", "text") == ["The tower is tall."]
    assert read_texts(tmp_path / "b.jsonl", "text") == ["one", "two"]
    assert read_texts(tmp_path / "u.JSONL", "text") == ["one"]
    # U+2028/2029/0085 are valid unescaped in a JSON string (json.dumps(ensure_ascii=False) writes them): records are
    # split at "\n" only (they were cut in two and called invalid JSON); a CRLF file reads the same
    records = ["First.\u2028Second.", "Caf\u00e9\u0085next\u2029", "Plain."]
    lines = [json.dumps({"text": r}, ensure_ascii=False) for r in records]
    (tmp_path / "ls.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "crlf.jsonl").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    assert read_texts(tmp_path / "ls.jsonl", "text") == records == read_texts(tmp_path / "crlf.jsonl", "text")


def test_a_group_task_yaml_given_by_path(tiny_llama, tmp_path):
    """A group YAML (`group:` with a `task:` list) given by its path is the group (it was refused as defining no task);
    its members come from --include-path."""
    folder = gen_task(tmp_path / "tasks", ["never said"])
    (folder / "g.yaml").write_text("group: my_group\ntask: [gen]\n")
    out = measure(tiny_llama, tmp_path / "m", "--tasks", folder / "g.yaml", "--include-path", folder, "--limit", "1",
                  "--dtype", "fp32", "--max-length", "16")
    assert read_manifest(out, "hqtflow.measurement").data["calibration"]["tokens"] > 0


def test_odd_calibration_paths_are_data_errors(tiny_llama, tmp_path):
    """A .json file (not JSON lines) and a symlink loop as --text, and a file as --include-path: one sentence, exit 5
    (a .json was one plain text, the loop exit 3 from the output check, the file an unknown task)."""
    (tmp_path / "a.json").write_text('[{"text": "one"}]')
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop1")
    gen_task(tmp_path / "tasks", ["\n"])
    out = ["-o", tmp_path / "m"]
    refused(["measure", tiny_llama, *out, "--text", tmp_path / "a.json"], 5,
            f"Calibration file {tmp_path / 'a.json'} is a .json file; give JSON records one a line as .jsonl")
    refused(["measure", tiny_llama, *out, "--text", tmp_path / "loop1"], 5,
            f"Calibration file {tmp_path / 'loop1'} is a symlink loop (or lies behind one)")
    refused(["measure", tiny_llama, *out, "--tasks", "gen", "--include-path", tmp_path / "tasks" / "gen.yaml"], 5,
            f"lm-eval include path {tmp_path / 'tasks' / 'gen.yaml'} is not a directory")


def test_ranks_run_on_the_cpu_with_gloo_where_a_gpu_is_visible(monkeypatch):
    """Rank 1 of `measure --tp 2` on a box with one CUDA GPU (torch.cuda patched: a GPU is seen unless
    CUDA_VISIBLE_DEVICES is empty when CUDA starts): it took NCCL and set_device(1), a device that is not there; it now
    hides the GPU and joins with gloo (the ranks measure on the CPU). The ranks `--tp` starts see no GPU at all."""
    import torch
    import torch.distributed as dist

    from hqtflow import environment
    from hqtflow.errors import HqtflowError
    from hqtflow.measure import distributed

    for k, v in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                 "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(k, v)
    calls = []
    visible = {"started": False}  # CUDA reads CUDA_VISIBLE_DEVICES once, when it starts

    def gpus() -> int:
        visible["started"] = visible["started"] or os.environ["CUDA_VISIBLE_DEVICES"] != ""
        return 1 if visible["started"] else 0

    def set_device(i):
        calls.append(("set_device", i))
        if i >= gpus():
            raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus() > 0)
    monkeypatch.setattr(torch.cuda, "device_count", gpus)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **k: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    assert distributed.init(2) == (1, 2)
    assert calls == [("init", "gloo")] and os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    # a rank that had started CUDA before (its GPU is seen for good) is refused in one sentence
    visible["started"], calls[:] = True, []
    with pytest.raises(HqtflowError, match="--tp ranks measure on the CPU, but this rank already sees a CUDA GPU"):
        distributed.init(2)
    assert calls == []
    assert environment.rank_env()["CUDA_VISIBLE_DEVICES"] == ""
