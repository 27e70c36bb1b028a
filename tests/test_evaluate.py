"""In-process evaluation through the serving engine: the model's attention comes back after it (for the perplexity
pass and any later use), also when the engine fails to start; a model the engine cannot run is scored in padded
batches instead."""

import pytest


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
