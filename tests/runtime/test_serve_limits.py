"""`hqtflow serve`'s limits as TGI's launcher sets them (runtime/limits.py): defaults from the model's context, a
limit beyond it refused, the limits checked against each other; at start, in one sentence naming the flag or variable."""

import httpx
import pytest

from conftest import run_cli, running
from hqtflow.errors import ConfigError
from hqtflow.runtime import limits
from hqtflow.runtime.server import ServeSettings, create_app

CONTEXT = "max_position_embeddings"


def sizes(s: ServeSettings) -> tuple:
    return s.max_total_tokens, s.max_input_tokens, s.max_batch_prefill_tokens


def test_defaults_come_from_the_models_context_as_tgis():
    """max_total_tokens: the context up to 4096 (4096 when the config names none); max_input_tokens: max_total_tokens
    - 1; max_batch_prefill_tokens: max_input_tokens + 50, within max_batch_total_tokens when that is given."""
    assert sizes(limits.fit(ServeSettings(), (64, CONTEXT))) == (64, 63, 113)
    assert sizes(limits.fit(ServeSettings(), (8192, CONTEXT))) == (4096, 4095, 4145)
    assert sizes(limits.fit(ServeSettings(), None)) == (4096, 4095, 4145)
    assert sizes(limits.fit(ServeSettings(max_total_tokens=100), (256, CONTEXT))) == (100, 99, 149)
    long = ServeSettings(max_input_tokens=8191, max_total_tokens=8192)  # the whole context of an 8192-token model
    assert sizes(limits.fit(long, (8192, CONTEXT))) == (8192, 8191, 8241)
    assert limits.fit(ServeSettings(max_batch_total_tokens=4096), None).max_batch_prefill_tokens == 4096
    fitted = limits.fit(ServeSettings(max_total_tokens=64), (64, CONTEXT))
    assert limits.fit(fitted, (64, CONTEXT)) == fitted  # create_app fits what serve() fitted: nothing changes


def test_a_prefill_budget_below_the_input_limit_chunks_long_prompts(tiny_llama):
    """--max-batch-prefill-tokens below --max-input-tokens is accepted (TGI 2's launcher refuses it, which left
    chunked prefill with nothing to chunk): the engine gets it as its chunk and step budget."""
    from hqtflow import models

    assert sizes(limits.fit(ServeSettings(max_batch_prefill_tokens=16), (64, CONTEXT))) == (64, 63, 16)
    r = run_cli("serve", "bf16", tiny_llama, "--max-batch-prefill-tokens", "16", "--max-input-tokens", "100",
                "--port", "0")
    assert r.exit_code == 2 and r.stderr.strip() == "Error: --port must be between 1 and 65535, not 0.", r.output
    app = create_app(models.load_model(tiny_llama, "fp32"), models.load_tokenizer(tiny_llama),
                     ServeSettings(max_batch_prefill_tokens=16, max_total_tokens=64))
    assert app.state.engine.max_prefill_tokens == 16 and app.state.settings.max_input_tokens == 63


def test_a_limit_beyond_the_context_or_the_kv_budget_is_refused():
    with pytest.raises(ConfigError) as e:
        limits.fit(ServeSettings(max_total_tokens=100), (64, CONTEXT))
    assert str(e.value) == ("--max-total-tokens 100 is beyond the model's context of 64 tokens (max_position_embeddings "
                            "in its config.json); give at most 64, or leave it out to use 64.")
    from_env = ServeSettings(max_total_tokens=100, sources={"max_total_tokens": "MAX_TOTAL_TOKENS"})
    with pytest.raises(ConfigError, match=r"^MAX_TOTAL_TOKENS=100 is beyond the model's context of 64 tokens"):
        limits.fit(from_env, (64, CONTEXT))
    with pytest.raises(ConfigError) as e:
        limits.fit(ServeSettings(max_batch_prefill_tokens=8192, max_batch_total_tokens=4096), None)
    assert str(e.value).startswith("`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: 8192 and 4096")


def test_serve_refuses_at_start_what_the_model_cannot_hold(tiny_llama, tiny_factory, busy_port):
    """Through the CLI, before the port is taken (a busy port is exit 6 once every limit has passed)."""
    r = run_cli("serve", "bf16", tiny_llama, "--max-total-tokens", "300", "--port", busy_port)
    assert r.exit_code == 2 and r.stderr.strip() == (
        "Error: --max-total-tokens 300 is beyond the model's context of 256 tokens (max_position_embeddings in its "
        "config.json); give at most 256, or leave it out to use 256."), r.output
    r = run_cli("serve", "bf16", tiny_llama, "--max-batch-prefill-tokens", "8192", "--max-batch-total-tokens", "4096",
                "--max-total-tokens", "256", "--port", busy_port)
    assert r.exit_code == 2 and "`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: 8192 and 4096" \
        in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    long = tiny_factory("llama", max_position_embeddings=8192)  # the prefill default follows --max-input-tokens
    r = run_cli("serve", "bf16", long, "--max-input-tokens", "8191", "--max-total-tokens", "8192", "--port", busy_port)
    assert r.exit_code == 6 and "Cannot listen" in r.stderr, r.output


def test_a_request_past_a_learned_position_table_is_a_422(tiny_factory):
    """GPT-2's positions are a learned table of n_positions rows: by default the server's limits are its context,
    so a request past it is refused by name, never run (it was an IndexError: a 424)."""
    from hqtflow import models

    path = tiny_factory("gpt2", n_positions=64)
    with running(create_app(models.load_model(path, "fp32"), models.load_tokenizer(path), ServeSettings())) as base:
        info = httpx.get(f"{base}/info").json()
        assert (info["max_total_tokens"], info["max_input_tokens"]) == (64, 63)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5] * 60, "max_tokens": 10}, timeout=60)
        assert r.status_code == 422 and "`prompt` tokens + `max_tokens` must be <= 64" in r.text, r.text
        r = httpx.post(f"{base}/v1/completions", json={"prompt": [5] * 60, "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_a_kv_cache_larger_than_the_memory_is_refused_before_allocating(tiny_llama):
    """--max-batch-total-tokens beyond the available RAM (free GPU memory on CUDA): one sentence naming the flag, the
    bytes it needs and those there are, exit 6 (it was a 60-line traceback from the allocator)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = run_cli("serve", "bf16", tiny_llama, "--max-batch-total-tokens", "1000000000000", "--port", port, "--device", "cpu")
    assert r.exit_code == 6 and "Traceback" not in r.output, r.output
    error = r.stderr.strip().splitlines()[-1]  # (after the weights' loading bar)
    assert error.startswith("Error: --max-batch-total-tokens 1000000000000: a KV cache of 1000000000000 tokens needs ") \
        and "GiB of available RAM" in error, r.stderr


def test_a_cpu_kv_cache_is_sized_within_a_cgroups_memory_limit(monkeypatch):
    """A container's memory limit bounds the KV cache as it bounds --disk-offload (MemAvailable ignores it)."""
    from hqtflow import hardware
    from hqtflow.runtime import paged

    monkeypatch.setattr(hardware, "available_memory_bytes", lambda: 3 * 2**30)
    assert paged.free_memory("cpu") == (3 * 2**30, "of available RAM")


def test_a_cuda_kv_cache_leaves_a_tenth_of_the_gpu_for_the_steps(monkeypatch):
    """On a CUDA GPU the KV cache leaves 10% of the GPU's memory free (a prefill chunk's activations and logits,
    cuBLAS's workspace, CUDA-graph pools: vLLM's gpu_memory_utilization 0.9 leaves as much): --max-batch-total-tokens
    that needs more than the free memory less that reserve is refused before anything is allocated (it was accepted up
    to all the free memory, then the first steps ran out of memory), and the default (half the free memory) is capped
    by it. Fake numbers: a 16 GiB GPU, 2 KiB a token; in RAM nothing is reserved."""
    import types

    import torch

    from hqtflow.errors import ResourceError
    from hqtflow.runtime import paged

    gib, free = 2**30, [10 * 2**30]
    monkeypatch.setattr(paged, "geometry", lambda model: (1, 1, 512))  # bf16: 2 * 512 * 2 = 2048 bytes a token
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 16 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(total_memory=16 * gib))

    def blocks(tokens, device="cuda"):
        return paged.num_blocks(None, block_size=16, dtype=torch.bfloat16, fp8=False, device=device,
                                max_batch_total_tokens=tokens)

    usable = int(10 * gib - 1.6 * gib)  # 8.4 GiB: 10 GiB free less 10% of 16 GiB
    assert blocks(usable // 2048 // 16 * 16) == usable // 2048 // 16  # up to the reserve
    with pytest.raises(ResourceError) as e:
        blocks(9 * gib // 2048)  # fits the free 10 GiB, not beside the reserve
    assert str(e.value) == ("A KV cache of 4718592 tokens needs 9.0 GiB (2048 bytes a token), more than the 8.4 GiB free "
                            "on the GPU beside the 1.6 GiB (10% of the GPU) kept for the steps' activations and workspaces.")
    assert blocks(None) * 16 * 2048 == 5 * gib  # half the free memory
    free[0] = 2 * gib
    assert blocks(None) * 16 * 2048 <= 0.4 * gib  # half the free 2 GiB would not leave the reserve: 0.4 GiB
    free[0] = gib  # less than the reserve: the default has no block, said as such (not "a KV cache of 0 tokens")
    with pytest.raises(ResourceError) as e:
        blocks(None)
    assert str(e.value) == ("Too little memory is free for a KV cache: 0.0 MiB free on the GPU once 1.6 GiB (10% of the "
                            "GPU) is kept for the steps, less than one block of 16 tokens (32768 bytes).")
    monkeypatch.setattr(paged, "free_memory", lambda device: (10 * gib, "of available RAM"))
    assert blocks(10 * gib // 2048, device="cpu") * 16 * 2048 == 10 * gib  # no reserve in RAM


def test_a_kv_cache_the_allocator_refuses_is_one_sentence(monkeypatch):
    import torch

    from hqtflow.errors import ResourceError
    from hqtflow.runtime import paged

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory\nmore lines")

    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(ResourceError) as e:
        paged.KVPool(layers=2, kv_heads=2, head_dim=16, num_blocks=4, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert str(e.value) == ("Cannot allocate a KV cache of 64 tokens (0.0 MiB) on cpu: [enforce fail at alloc_cpu.cpp:127] "
                            "DefaultCPUAllocator: can't allocate memory")


def test_start_refusals_name_what_the_user_set(tiny_llama, busy_port, monkeypatch):
    """TGI's launcher refuses MAX_INPUT_LENGTH beside --max-input-tokens, as beside MAX_INPUT_TOKENS; an empty
    --api-key would turn the key check off; a value from an environment variable is named by it."""
    def refused(*args) -> str:
        r = run_cli("serve", "bf16", tiny_llama, *args)
        assert r.exit_code == 2, r.output
        return r.stderr.strip().splitlines()[-1]

    monkeypatch.setenv("MAX_INPUT_LENGTH", "32")
    assert refused("--max-input-tokens", "16", "--port", busy_port) == ("Error: --max-input-tokens and the environment "
                                                                       "variable MAX_INPUT_LENGTH (the older name of MAX_INPUT_TOKENS) are both set; keep one.")
    monkeypatch.delenv("MAX_INPUT_LENGTH")
    assert refused("--api-key", "", "--port", busy_port) == ("Error: --api-key is empty: give a key, or leave the flag "
                                                            "out to serve without one.")
    monkeypatch.setenv("PORT", "0")
    assert refused() == "Error: PORT must be between 1 and 65535, not 0."
    monkeypatch.setenv("CUDA_GRAPHS", "1,x")
    assert refused("--port", busy_port) == "Error: CUDA_GRAPHS takes batch sizes like 1,2,4,8 (0: none), not '1,x'."
    monkeypatch.setenv("CUDA_GRAPHS", "1,2")
    assert refused("--port", busy_port, "--device", "cpu") == (
        "Error: CUDA graphs (CUDA_GRAPHS=1,2) need a CUDA GPU; this model runs on cpu (give CUDA_GRAPHS=0).")


def test_tgis_api_key_and_cors_variables_are_read_and_bad_keys_refused(monkeypatch):
    """TGI's API_KEY and CORS_ALLOW_ORIGIN (its launcher's --api-key and --cors-allow-origin variables) were ignored:
    a TGI deployment moved over served with no key. An empty key variable served with no key; a non-ASCII key no
    client can send. Both are refused at start, naming the variable."""
    from hqtflow.runtime import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda model, settings, **kw: seen.update(settings=settings))
    monkeypatch.setenv("API_KEY", "tgi-key")
    monkeypatch.setenv("CORS_ALLOW_ORIGIN", "https://ui.example")
    assert run_cli("serve", "fp8", "some-model").exit_code == 0
    assert (seen["settings"].api_key, seen["settings"].cors_allow_origin) == ("tgi-key", ["https://ui.example"])
    assert run_cli("serve", "fp8", "some-model", "--api-key", "flag", "--cors-allow-origin", "https://b.example").exit_code == 0
    assert (seen["settings"].api_key, seen["settings"].cors_allow_origin) == ("flag", ["https://b.example"])

    def refused(*args) -> str:
        r = run_cli("serve", "fp8", "some-model", *args)
        assert r.exit_code == 2, r.output
        return r.stderr.strip().splitlines()[-1]

    monkeypatch.setenv("HQTFLOW_API_KEY", "other")
    assert refused() == "Error: The environment variables HQTFLOW_API_KEY and API_KEY set different keys; keep one."
    monkeypatch.delenv("API_KEY")
    monkeypatch.setenv("HQTFLOW_API_KEY", "")
    assert refused() == ("Error: The environment variable HQTFLOW_API_KEY is empty: give a key, or unset it to serve "
                         "without one.")
    monkeypatch.setenv("HQTFLOW_API_KEY", "clé")
    assert refused().startswith("Error: The environment variable HQTFLOW_API_KEY holds 'é': an API key is sent in an "
                                "HTTP header, which carries visible ASCII characters only")
    assert refused("--api-key", "a key").startswith("Error: --api-key holds ' ': an API key is sent")


def test_tgi_variables_not_read_are_named_and_secrets_without_their_value(monkeypatch):
    from hqtflow.runtime import server

    monkeypatch.setattr(server, "serve", lambda model, settings, **kw: None)
    monkeypatch.setenv("NGROK", "true")
    monkeypatch.setenv("NGROK_AUTHTOKEN", "s3cret")
    r = run_cli("serve", "fp8", "some-model")
    assert r.exit_code == 0 and "Note: NGROK=true, NGROK_AUTHTOKEN: TGI's launcher reads these" in r.stderr, r.stderr
    assert "s3cret" not in r.output


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_port_is_listened_on_before_the_model_loads(tiny_llama, monkeypatch):
    """Two `hqtflow serve` started together on one port: the port is taken (bound and listened on) before the model
    loads, so the second is refused in one sentence at once. It used to bind only (SO_REUSEADDR lets two bound,
    not yet listening sockets share a port): both loaded the model and the loser died in a uvicorn traceback."""
    from hqtflow.errors import ResourceError
    from hqtflow.runtime import server

    port = free_port()
    first = server.listen_socket("127.0.0.1", port)
    try:
        with pytest.raises(ResourceError) as e:
            server.listen_socket("127.0.0.1", port).close()
        assert str(e.value).startswith(f"Cannot listen on 127.0.0.1:{port} (Address already in use)")
        loaded = []
        monkeypatch.setattr(server, "_serve", lambda *a, **k: loaded.append(a))
        r = run_cli("serve", "bf16", tiny_llama, "--port", port)
        assert r.exit_code == 6 and "Cannot listen" in r.stderr and not loaded, r.output
    finally:
        first.close()


def test_a_signal_while_loading_says_the_server_never_started(tiny_llama, monkeypatch):
    """Ctrl-C or SIGTERM before uvicorn runs (the model loading) exits 128 + the signal and says the server had not
    started (it said "Server stopped.", as after a clean shutdown)."""
    from hqtflow.cli import Terminated
    from hqtflow.runtime import server

    def interrupted(*a, **k):
        raise Terminated(15)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(server, "_serve", interrupted)
    monkeypatch.setattr(server, "exit_now", exit_now)
    r = run_cli("serve", "bf16", tiny_llama, "--port", free_port())
    assert r.exit_code == 143 and r.stderr.strip() == "Stopped while loading; the server had not started.", r.output
