"""The dtype matrix: models stored in fp32, fp16 and bf16 against every --dtype, and the one dtype enum
(choices.Dtype) whose sentence every command, recipe and API argument refuses a wrong name with."""

from __future__ import annotations

import pytest

from conftest import run_cli

COMPUTE = "--dtype must be auto, bf16, fp16 or fp32, not 'fp64'."  # generate, eval, serve, bench
STORED = "--dtype must be bf16, fp16 or fp32, not 'fp64'."  # measure, import-hqt (no auto: a model's own dtype)


@pytest.fixture(scope="module")
def measured(tiny_llama, wiki_text, tmp_path_factory):
    d = tmp_path_factory.mktemp("dtypes")
    r = run_cli("measure", tiny_llama, "-o", d / "m", "--text", wiki_text, "--limit", "1", "--max-length", "16")
    assert r.exit_code == 0, r.output
    return d / "m"


@pytest.mark.parametrize("args, sentence", [
    (lambda m, ck, t, o: ["measure", m, "-o", o, "--text", t, "--dtype", "fp64"], STORED),
    (lambda m, ck, t, o: ["import-hqt", ck, "-o", o, "--dtype", "fp64"], STORED),
    (lambda m, ck, t, o: ["generate", m, "--dtype", "fp64"], COMPUTE),
    (lambda m, ck, t, o: ["eval", m, "--no-baseline", "--ppl-file", t, "--dtype", "fp64"], COMPUTE),
    (lambda m, ck, t, o: ["bench", m, "--dtype", "fp64"], COMPUTE),
], ids=["measure", "import-hqt", "generate", "eval", "bench"])
def test_every_command_refuses_a_dtype_with_the_same_sentence(args, sentence, tiny_llama, measured, wiki_text, tmp_path):
    r = run_cli(*args(tiny_llama, measured, wiki_text, tmp_path / "out"))
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == f"Error: {sentence}", r.output


def test_the_api_recipes_and_models_word_a_dtype_as_the_cli(tiny_llama, tmp_path):
    import hqtflow
    from hqtflow import models
    from hqtflow.errors import ConfigError, ModelError

    with pytest.raises(ConfigError, match=r"^dtype must be auto, bf16, fp16 or fp32, not 'float8'\.$"):
        hqtflow.load(tmp_path, dtype="float8")
    with pytest.raises(ModelError, match=r"^dtype must be bf16, fp16 or fp32, not 'auto'\.$"):
        models.torch_dtype("auto")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_llama}\ndtype: bfloat16\n")
    r = run_cli("run", recipe)
    assert r.exit_code != 0 and "'dtype' must be bf16, fp16 or fp32, not 'bfloat16'." in r.output, r.output


def test_one_enum_lists_the_dtypes_everywhere():
    import torch

    from hqtflow import scales
    from hqtflow.choices import HP_DTYPES, Dtype
    from hqtflow.formats import quant_config

    assert [d.value for d in Dtype] == ["auto", "bf16", "fp16", "fp32"]
    assert quant_config.HP_DTYPES == ("bf16", "fp16", "fp32")
    assert scales.HP_DTYPES == {d.value: d.torch for d in HP_DTYPES}
    assert Dtype.FP16.torch is torch.float16


def test_torchs_dtype_names_are_one_table():
    """choices.TORCH_NAMES, torch's names of each high-precision dtype, is what Dtype.torch, hardware.dtype_name and
    the formats' maps are derived from; every name it gives is the torch dtype itself."""
    import torch

    from hqtflow import hardware
    from hqtflow.choices import HP_DTYPES, TORCH_NAMES
    from hqtflow.formats import checkpoint

    assert list(TORCH_NAMES) == list(HP_DTYPES)
    assert all(getattr(torch, n) is d.torch for d, names in TORCH_NAMES.items() for n in names)
    assert hardware.DTYPE_NAMES == {n: d.value for d, names in TORCH_NAMES.items() for n in names}
    assert checkpoint.HP_DTYPE_NAMES == {d.torch: d.value for d in TORCH_NAMES}
    assert [hardware.dtype_name(x) for x in (torch.half, "float", "torch.bfloat16", "bf16", "fp64")] == \
        ["fp16", "fp32", "bf16", "bf16", "fp64"]


@pytest.fixture(scope="module")
def overflowing(tiny_factory, tmp_path_factory):
    """The tiny Llama stored in fp32 with a first MLP whose output passes fp16's 65504 (fine in bf16 and fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    src = tiny_factory("llama", dtype="float32")
    m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        mlp = m.model.layers[0].mlp
        mlp.up_proj.weight.mul_(100), mlp.gate_proj.weight.mul_(100), mlp.down_proj.weight.mul_(1000)
    out = tmp_path_factory.mktemp("overflowing")
    m.save_pretrained(out)
    for f in src.glob("tokenizer*"):
        (out / f.name).write_bytes(f.read_bytes())
    return out


FP16_SENTENCE = "computes NaN or infinite logits in fp16 (its activations pass fp16's largest value, 65504): run it with --dtype bf16 or fp32."


@pytest.mark.parametrize("engine", ["serve", "transformers"])
def test_fp16_overflow_in_generate_is_one_sentence_not_empty_text(overflowing, engine):
    r = run_cli("generate", overflowing, "-p", "The capital of", "--max-new-tokens", "2", "--engine", engine, "--dtype", "fp16")
    assert r.exit_code == 4 and FP16_SENTENCE in r.output and "Traceback" not in r.output, r.output
    r = run_cli("generate", overflowing, "-p", "The capital of", "--max-new-tokens", "2", "--engine", engine, "--dtype", "fp32")
    assert r.exit_code == 0, r.output


def test_fp16_overflow_in_eval_is_one_sentence_not_a_nan_perplexity(overflowing, wiki_text):
    r = run_cli("eval", overflowing, "--no-baseline", "--ppl-file", wiki_text, "--ppl-windows", "1", "--dtype", "fp16")
    assert r.exit_code == 4 and FP16_SENTENCE in r.output and "nan" not in r.output, r.output


def test_fp16_overflow_in_eval_tasks_is_the_same_sentence(overflowing, data_dir):
    """lm-eval tasks score through the serving engine, whose thread turns the hook's error into the request's: eval
    re-raises the guard's own sentence (exit 4), not 'The serving engine failed ...: ModelError: ...' (exit 6)."""
    r = run_cli("eval", overflowing, "--no-baseline", "--tasks", "lambada_openai_local", "--data-dir", data_dir,
                "--limit", "2", "--dtype", "fp16")
    assert r.exit_code == 4 and FP16_SENTENCE in r.output and "ModelError" not in r.output, r.output


def test_an_engine_threads_fp16_overflow_is_raised_again_by_one_helper():
    """generate and eval re-raise the guard's sentence through api.raise_fp16_overflow: the guard's error when it
    tripped, nothing when it did not or the model has no guard (bf16, fp32)."""
    import torch

    from hqtflow import api
    from hqtflow.errors import ModelError

    model = torch.nn.Module()
    api.raise_fp16_overflow(model)  # no guard: nothing
    model.fp16_guard = api.Fp16Overflow("tiny")
    api.raise_fp16_overflow(model)  # not tripped: nothing
    with pytest.raises(ModelError) as tripped:
        model.fp16_guard(None, (), torch.tensor([float("nan")], dtype=torch.float16))
    with pytest.raises(ModelError) as again:
        api.raise_fp16_overflow(model)
    assert again.value is tripped.value and str(again.value) == "tiny " + FP16_SENTENCE


def test_fp16_overflow_in_measure_names_fp16_not_broken_weights(overflowing, wiki_text, tmp_path):
    args = ["measure", overflowing, "--text", wiki_text, "--limit", "1", "--max-length", "16"]
    r = run_cli(*args, "-o", tmp_path / "m16", "--dtype", "fp16")
    assert r.exit_code == 4 and "Traceback" not in r.output, r.output
    assert "in fp16 its activations pass fp16's largest value, 65504: measure it with --dtype bf16 or fp32" in r.output
    assert "broken" not in r.output and not (tmp_path / "m16").exists()
    r = run_cli(*args, "-o", tmp_path / "m32", "--dtype", "fp32")
    assert r.exit_code == 0, r.output


def test_eval_report_records_the_dtype_each_model_ran_in(measured, tiny_llama, wiki_text, tmp_path):
    """--dtype fp16 (or auto, whatever it resolves to here) is what the FP8 model ran in; the baseline is bf16."""
    import json

    from hqtflow.hardware import fastest_dtype

    ck = tmp_path / "ck"
    assert run_cli("quantize", tiny_llama, "-m", measured, "-o", ck).exit_code == 0
    for asked, ran in (("fp16", "fp16"), ("auto", fastest_dtype())):
        rep = tmp_path / f"{asked}.json"
        r = run_cli("eval", ck, "--ppl-file", wiki_text, "--ppl-windows", "1", "--dtype", asked, "--report", rep)
        assert r.exit_code == 0, r.output
        assert json.loads(rep.read_text())["dtypes"] == {"bf16": "bf16", "fp8": ran}


def test_serve_fp8_with_a_measurement_resolves_auto_for_the_serving_device(tiny_llama, measured, monkeypatch):
    """`serve fp8 MODEL -m DIR --dtype auto` quantizes at start: auto is the fastest dtype where it is served (bf16 on
    a GPU; "meta" stands for one here), not the CPU's (fp32 without native bf16); fp16 gets the overflow guard."""
    from hqtflow import hardware
    from hqtflow.eval_run import compute_dtype
    from hqtflow.runtime import server
    from hqtflow.runtime.settings import ServeSettings

    monkeypatch.setattr(hardware, "cpu_flags", lambda: [])  # a CPU without native bf16: fp32 there
    seen = {}
    monkeypatch.setattr(server, "_app", lambda model, tok, settings: model)
    monkeypatch.setattr(server, "_run", lambda app, sock: seen.setdefault("model", app))
    for dtype, device, ran in (("auto", "meta", "bf16"), ("auto", "cpu", "fp32"), ("fp16", "cpu", "fp16")):
        seen.clear()
        server._serve(None, str(tiny_llama), ServeSettings(), kind="fp8", measurement=str(measured), backend="auto",
                      dtype=dtype, device=device)
        assert compute_dtype(seen["model"]) == ran, (dtype, device)
        assert (getattr(seen["model"], "fp16_guard", None) is not None) == (ran == "fp16")


def test_an_fp16_guarded_model_can_be_copied_and_pickled():
    """The guard keeps no thread-local state on the model (its deferral is a context variable): a guarded model
    deep-copies and pickles as before (a threading.local made both a TypeError)."""
    import copy
    import pickle

    import torch

    from hqtflow import api

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.fp16_guard = api.Fp16Overflow("tiny")
    model[0].register_forward_hook(model.fp16_guard)
    twin = copy.deepcopy(model)
    assert isinstance(pickle.loads(pickle.dumps(model)).fp16_guard, api.Fp16Overflow)
    with model.fp16_guard.deferred():
        twin[0].weight.data.fill_(float("nan"))
        twin(torch.ones(1, 4))  # deferred on this thread: no check
    with pytest.raises(Exception, match="NaN or infinite logits in fp16"):
        twin(torch.ones(1, 4))


def test_the_engine_and_eval_read_one_compute_dtype(tiny_kv, wiki_text, tmp_path, monkeypatch):
    """The dtype a model computes in was derived twice, each by its own walk over the parameters: eval's report
    (eval_run.compute_dtype: the first in bf16/fp16/fp32) and the serving engine (its KV pool's dtype, /info's
    model_dtype: the first floating point wider than a byte). models.compute_dtype is the one both read now: for an
    FP8 checkpoint (FP8 weights first in its Linears, float32 scales beside them) the dtype it was loaded in."""
    import json

    import torch

    from hqtflow import models
    from hqtflow.api import load_any
    from hqtflow.runtime.engine import Engine

    model, tok, kind = load_any(str(tiny_kv[1]), "fp16")
    assert kind == "fp8" and models.compute_dtype(model) == torch.float16
    assert models.compute_dtype(torch.nn.Linear(2, 2).to(torch.float8_e4m3fn)) is None  # nothing in high precision
    seen, real = [], models.compute_dtype
    monkeypatch.setattr(models, "compute_dtype", lambda m: seen.append(m) or real(m))
    eng = Engine(model, tok, max_batch_total_tokens=64)
    assert eng.compute_dtype == torch.float16 and eng.pool.keys[0].dtype == torch.float16 and seen == [model]
    rep = tmp_path / "eval.json"
    r = run_cli("eval", tiny_kv[1], "--no-baseline", "--ppl-file", wiki_text, "--ppl-windows", "1", "--dtype", "fp16",
                "--report", rep)
    assert r.exit_code == 0, r.output
    assert json.loads(rep.read_text())["dtypes"] == {"fp8": "fp16"} and len(seen) == 2
