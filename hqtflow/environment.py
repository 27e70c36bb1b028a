"""Every environment variable hqtflow reads or sets, in one place (no heavy imports here).

Read: HQTFLOW_CACHE, HQTFLOW_API_KEY and TGI's API_KEY, TGI's CORS_ALLOW_ORIGIN, CXX (the CPU kernel's compiler), QUANT_CONFIG (the default of `-c`, as
optimum-habana and TGI-on-Gaudi read it), TGI's serving knobs (TGI_KNOBS; MAX_INPUT_LENGTH, MAX_INPUT_TOKENS' older
name; MODEL_ID and PORT, the defaults of serve's model and --port; TGI_NOT_READ, only to name them) and torchrun's RANK, WORLD_SIZE,
LOCAL_RANK, TORCHELASTIC_RUN_ID. Set, for libraries that only read the environment: TQDM_DISABLE (ranks other than
0), ONEDNN_PRIMITIVE_CACHE_CAPACITY (serve), TORCHINDUCTOR_CACHE_DIR (the compiled decoder), OMP_NUM_THREADS (the ranks `--tp` starts).
"""

from __future__ import annotations

import os
from pathlib import Path

# TGI's serving knobs: serve's option -> its environment variable (read when the option is not given)
TGI_ENV = {"max_batch_size": "MAX_BATCH_SIZE", "max_batch_total_tokens": "MAX_BATCH_TOTAL_TOKENS",
           "batch_bucket_size": "BATCH_BUCKET_SIZE", "prefill_batch_bucket_size": "PREFILL_BATCH_BUCKET_SIZE",
           "pad_sequence_to_multiple_of": "PAD_SEQUENCE_TO_MULTIPLE_OF", "warmup": "WARMUP_ENABLED",
           "cuda_graphs": "CUDA_GRAPHS", "max_stop_sequences": "MAX_STOP_SEQUENCES", "max_input_tokens": "MAX_INPUT_TOKENS",
           "max_total_tokens": "MAX_TOTAL_TOKENS", "max_batch_prefill_tokens": "MAX_BATCH_PREFILL_TOKENS",
           "max_concurrent_requests": "MAX_CONCURRENT_REQUESTS", "max_best_of": "MAX_BEST_OF",
           "max_top_n_tokens": "MAX_TOP_N_TOKENS", "max_client_batch_size": "MAX_CLIENT_BATCH_SIZE",
           "payload_limit": "PAYLOAD_LIMIT"}
TGI_KNOBS = tuple(TGI_ENV.values())
BOOL_WORDS = {**dict.fromkeys(("1", "true", "t", "yes", "y", "on"), True),
              **dict.fromkeys(("0", "false", "f", "no", "n", "off"), False)}  # a boolean knob's values
TGI_OLDER_NAMES = {"MAX_INPUT_TOKENS": "MAX_INPUT_LENGTH"}  # read when the knob itself is not set
# TGI launcher variables with no counterpart here: `serve` names the ones set rather than ignore them silently
# (MODEL_ID and PORT are read: the model argument's and --port's defaults)
TGI_NOT_READ = ("QUANTIZE", "NUM_SHARD", "SHARDED", "SPECULATE", "DTYPE", "KV_CACHE_DTYPE", "REVISION", "ROPE_SCALING",
                "ROPE_FACTOR", "TRUST_REMOTE_CODE", "MAX_WAITING_TOKENS", "WAITING_SERVED_RATIO", "LORA_ADAPTERS",
                "DISABLE_GRAMMAR_SUPPORT", "WATERMARK_GAMMA", "WATERMARK_DELTA", "CUDA_MEMORY_FRACTION", "VALIDATION_WORKERS",
                "NGROK", "NGROK_AUTHTOKEN", "NGROK_EDGE", "OTLP_ENDPOINT", "OTLP_SERVICE_NAME", "TOKENIZER_CONFIG_PATH",
                "USAGE_STATS", "JSON_OUTPUT", "WEIGHTS_CACHE_OVERRIDE", "DISABLE_CUSTOM_KERNELS", "PREFIX_CACHING", "ATTENTION")
TGI_SECRETS = ("NGROK_AUTHTOKEN",)  # named without their value
# (not named: HOSTNAME, --hostname's variable, which every shell and container sets to the machine's name; MASTER_ADDR
# and MASTER_PORT, torch.distributed's own)


def cache_dir() -> Path:
    """Prepared models, the built CPU kernel, the compile cache and weight digests (default ~/.cache/hqtflow)."""
    return Path(os.environ.get("HQTFLOW_CACHE") or Path.home() / ".cache" / "hqtflow")


def cxx_compiler() -> str:
    """The C++ compiler that builds the CPU kernel: $CXX, else `c++`."""
    return os.environ.get("CXX") or "c++"


API_KEY_VARIABLES = ("HQTFLOW_API_KEY", "API_KEY")  # hqtflow's, then TGI's launcher's (--api-key's variable)


def api_key() -> tuple[str, str] | None:
    """The API key set in the environment and the variable that set it: HQTFLOW_API_KEY, else TGI's API_KEY (None:
    neither). Both set to different keys is refused; so is a key that is empty or check_api_key refuses."""
    from hqtflow.errors import ConfigError

    given = [(os.environ[v], v) for v in API_KEY_VARIABLES if v in os.environ]
    if len(given) == 2 and given[0][0] != given[1][0]:
        raise ConfigError("The environment variables HQTFLOW_API_KEY and API_KEY set different keys; keep one.")
    for key, name in given:
        check_api_key(key, f"The environment variable {name}", "unset it")
    return given[0] if given else None


def check_api_key(key: str, name: str, instead: str) -> None:
    """Refuse an API key no client could send, naming `name` (what set it) and what to do `instead` of an empty one:
    empty (it would turn the check off) or other than visible ASCII (an HTTP header's value carries no other
    characters: the openai client raises UnicodeEncodeError, curl's UTF-8 bytes never match)."""
    from hqtflow.errors import ConfigError

    if not key.strip():
        raise ConfigError(f"{name} is empty: give a key, or {instead} to serve without one.")
    if not all("!" <= c <= "~" for c in key):
        bad = next(c for c in key if not "!" <= c <= "~")
        raise ConfigError(f"{name} holds {bad!r}: an API key is sent in an HTTP header, which carries visible ASCII "
                          "characters only (letters, digits, punctuation; no spaces).")


def cors_allow_origin() -> list[str]:
    """TGI's CORS_ALLOW_ORIGIN (--cors-allow-origin's variable, read when the flag is not given): one origin, as
    TGI's launcher reads it."""
    return [os.environ["CORS_ALLOW_ORIGIN"]] if os.environ.get("CORS_ALLOW_ORIGIN") else []


def quant_config() -> str | None:
    """QUANT_CONFIG: the QUANT_CONFIG file optimum-habana and TGI-on-Gaudi read, `-c`'s default here."""
    return os.environ.get("QUANT_CONFIG") or None


def tgi_variable(name: str, flag: str | None = None) -> str | None:
    """The environment variable that sets TGI knob `name`: `name` when it is set (not empty), else its older name
    (TGI_OLDER_NAMES) when that is set, else None; both set is refused, as TGI's launcher refuses it. `flag`: the
    knob's flag, given (it wins, so None), which TGI's launcher refuses beside the older name too."""
    from hqtflow.errors import ConfigError

    if name not in TGI_KNOBS:
        raise KeyError(name)
    old = TGI_OLDER_NAMES.get(name)
    if old and os.environ.get(old) and flag:
        raise ConfigError(f"{flag} and the environment variable {old} (the older name of {name}) are both set; keep one.")
    if old and os.environ.get(old) and os.environ.get(name):
        raise ConfigError(f"The environment variables {name} and {old} (its older name) are both set; keep one.")
    return None if flag else next((v for v in (name, old) if v and os.environ.get(v)), None)


def tgi_knob(name: str, default):
    """A TGI-on-Gaudi serving knob from the environment, typed like `default` (an int when `default` is None);
    `default` when unset; a value of the wrong type is refused in one sentence."""
    from hqtflow.errors import ConfigError

    var = tgi_variable(name)
    if var is None:
        return default
    raw, name = os.environ[var], var
    if isinstance(default, bool):  # a boolean word, as typer reads the flags' values
        if raw.strip().lower() not in BOOL_WORDS:
            raise ConfigError(f"The environment variable {name}={raw!r} is not a boolean (true or false).")
        return BOOL_WORDS[raw.strip().lower()]
    kind = int if default is None else type(default)
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"The environment variable {name}={raw!r} is not a valid {kind.__name__}.") from None


def tgi_not_read() -> list[str]:
    """The TGI launcher variables set here that hqtflow serve has no counterpart for, as NAME=value."""
    return [name if name in TGI_SECRETS else f"{name}={os.environ[name]}" for name in TGI_NOT_READ if os.environ.get(name)]


def use_inductor_cache() -> None:
    """torch.compile's on-disk cache (torch's documented TORCHINDUCTOR_CACHE_DIR) inside hqtflow's cache."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def bound_onednn_cache(capacity: int = 16) -> None:
    """oneDNN keeps a compiled primitive per matmul shape (1024 by default); a server sees a new prefill shape at
    almost every step, so bound it (oneDNN's documented knob; read when the first primitive is made)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))


# ---- torchrun --------------------------------------------------------------------------------------------
def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def quiet_other_ranks() -> None:
    """Under torchrun, only rank 0 draws progress bars: the others' (theirs, transformers', lm-eval's, datasets')
    would interleave with it. tqdm reads TQDM_DISABLE when it is imported, so this runs before anything imports it."""
    if os.environ.get("RANK", "0") != "0":
        os.environ["TQDM_DISABLE"] = "1"


def hide_gpus() -> None:
    """Make CUDA see no GPU in this process (read when CUDA starts: torch and transformers then see none)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def rank_env() -> dict[str, str]:
    """The environment of the ranks `--tp` starts: one OpenMP thread each (they share the machine's cores), and no GPU
    (they measure on the CPU, with gloo)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


