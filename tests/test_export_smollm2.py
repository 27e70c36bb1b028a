"""The real SmolLM2 FP8 checkpoint exports to every layout and loads back with the same greedy text."""

import pytest
import torch

from conftest import run_cli

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "Water boils at a temperature of"]


def greedy(model, tok, prompt, n=12):
    ids = torch.tensor([tok.encode(prompt)])
    with torch.inference_mode():
        return tok.decode(model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)[0])


@pytest.fixture(scope="module")
def smol_fp8(smollm2, data_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("smolx")
    r = run_cli("measure", smollm2, "-o", base / "m", "--text", data_dir / "wikitext2_valid.txt", "--limit", "8",
                "--max-length", "128")
    assert r.exit_code == 0, r.output
    r = run_cli("quantize", "-m", base / "m", "-o", base / "fp8", "--scale-method", "maxabs_pow2")
    assert r.exit_code == 0, r.output
    return base / "fp8"


def test_every_layout_round_trips(smol_fp8, inc, tmp_path):
    import hqtflow
    from hqtflow.formats.checkpoint import load_checkpoint

    # the reference path in bf16, like load_checkpoint's default and INC's QDQ modules: greedy text is compared on
    # one backend (the CPU kernel computes the same function, but its fp32 sums run in another order than oneDNN's)
    ours, tok = hqtflow.load(smol_fp8, backend="qdq", dtype="bf16")
    expected = [greedy(ours, tok, p) for p in PROMPTS]
    assert "Paris" in expected[0]
    for fmt, extra in (("fp8", []), ("compressed-tensors", ["--per-tensor"]), ("inc", [])):
        out = tmp_path / fmt
        r = run_cli("export", smol_fp8, "--format", fmt, "-o", out, *extra)
        assert r.exit_code == 0, r.output
        if fmt == "inc":  # Neural Compressor's own loader reads its layout
            back = inc.load(str(out), format="huggingface", device="cpu")
            for name, buf in ours.named_buffers():  # INC casts buffers to bf16; give rotary its fp32 back
                if name.endswith("inv_freq"):
                    parent, _, attr = name.rpartition(".")
                    back.get_submodule(parent).register_buffer(attr, buf.clone(), persistent=False)
        else:
            back = load_checkpoint(out)
        assert [greedy(back, tok, p) for p in PROMPTS] == expected, fmt


def test_in_process_scores_do_not_depend_on_the_batch(smol_fp8):
    """`hqtflow eval` scores through the serving engine: a document gets the same log-likelihood alone and batched
    beside longer and shorter ones (a padded batch's attention sums depend on its width, by a bf16 step that FP8
    inputs amplify: a piqa document scored -65.06 alone and -67.89 padded), and the one the server gives it."""
    import httpx

    from conftest import running
    from hqtflow import lmeval
    from hqtflow.api import load_any
    from hqtflow.evaluate import serving_engine
    from hqtflow.runtime.server import ServeSettings, create_app

    model, tok, _ = load_any(str(smol_fp8), "bf16")
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    doc = ((None, None), enc("Question: dresser\nAnswer:"), enc(" finish, woodgrain with  bobby pin"))
    longer = ((None, None), enc("Question: How do I keep a wooden dresser from sticking in humid weather? " * 12 + "\nAnswer:"), enc(" wax"))
    shorter = ((None, None), enc("Hi"), enc(" there"))
    with serving_engine(model, tok, batch_size=8, max_length=512) as (score, _):
        lm = lmeval.build_lm(None, tok, batch_size=8, max_length=512, score=score)
        alone = lm._loglikelihood_tokens([doc])[0]
        assert lm._loglikelihood_tokens([longer, doc, shorter])[1] == alone
        assert lm._loglikelihood_tokens([doc, doc])[1] == alone
    with running(create_app(model, tok, ServeSettings(model_id="fp8"))) as base:
        ids = doc[1] + doc[2]
        lp = httpx.post(f"{base}/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0},
                        timeout=120).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert sum(lp[len(doc[1]):]) == pytest.approx(alone[0], abs=1e-6)
