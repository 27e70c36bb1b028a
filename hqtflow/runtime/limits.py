"""The token limits of a server, as TGI's launcher sets and checks them: the defaults come from the model's context
(config.json, hqtflow.models.context_length), a given limit is checked against it and the limits against each other.

`check` runs on the limits given (the CLI, before anything is read); `fit` fills the defaults from the context and
runs every check (before the model is loaded, from its config.json, and again on the model loaded). Unlike TGI 2's
launcher, a max_batch_prefill_tokens below max_input_tokens is accepted: the engine prefills a longer prompt in chunks
over several steps, beside the decoding sequences (chunked prefill)."""

from __future__ import annotations

from dataclasses import replace

from hqtflow.errors import ConfigError
from hqtflow.runtime.settings import ServeSettings

DEFAULT_MAX_TOTAL = 4096  # TGI's max_total_tokens when the model's context is longer, or not known
PREFILL_EDGE = 50  # TGI's default max_batch_prefill_tokens: max_input_tokens + this
# The least value of each numeric limit (TGI types them unsigned); 0 only where it means "no limit" or "none"
MINIMUMS = {"max_input_tokens": 1, "max_total_tokens": 2, "max_batch_size": 0, "max_batch_prefill_tokens": 1,
            "max_batch_total_tokens": 1, "max_concurrent_requests": 1, "max_stop_sequences": 0, "batch_bucket_size": 1,
            "prefill_batch_bucket_size": 1, "pad_sequence_to_multiple_of": 1, "max_best_of": 1, "max_top_n_tokens": 0,
            "max_client_batch_size": 1, "payload_limit": 1}


def check(s: ServeSettings) -> None:
    """Each limit's range, then the rules between the limits that are set (None: not yet), each refusal naming the
    flags or variables."""
    from hqtflow.runtime.schemas import MAX_BEST_OF, MAX_TOP_N_TOKENS

    for name, least in MINIMUMS.items():
        if getattr(s, name) is not None and getattr(s, name) < least:
            raise ConfigError(f"{s.named(name)} must be at least {least}, not {getattr(s, name)}.")
    for name, most in {"max_best_of": MAX_BEST_OF, "max_top_n_tokens": MAX_TOP_N_TOKENS}.items():
        if getattr(s, name) > most:
            raise ConfigError(f"{s.named(name)} can be at most {most} here, not {getattr(s, name)}.")

    def given(*names):
        return all(getattr(s, n) is not None for n in names)

    inp, total, prefill, kv = s.max_input_tokens, s.max_total_tokens, s.max_batch_prefill_tokens, s.max_batch_total_tokens
    if given("max_input_tokens", "max_total_tokens") and inp >= total:
        raise ConfigError(f"{s.named('max_input_tokens')} ({inp}) must be less than {s.named('max_total_tokens')} ({total}).")
    if given("max_batch_total_tokens", "max_total_tokens") and kv < total:
        raise ConfigError(f"{s.named('max_batch_total_tokens')} ({kv}) must be at least {s.named('max_total_tokens')} ({total}).")
    if given("max_batch_prefill_tokens", "max_batch_total_tokens") and prefill > kv:
        raise ConfigError(f"`max_batch_prefill_tokens` must be <= `max_batch_total_tokens`. Given: {prefill} and {kv} "
                          f"({s.named('max_batch_prefill_tokens')}, {s.named('max_batch_total_tokens')}).")


def fit(s: ServeSettings, context: tuple[int, str] | None) -> ServeSettings:
    """`s` with TGI's defaults for the limits not given: max_total_tokens the model's context up to 4096 (4096 when
    `context`, (tokens, the config.json key that says so), is None), max_input_tokens max_total_tokens - 1,
    max_batch_prefill_tokens max_input_tokens + 50 (at most max_batch_total_tokens). A max_total_tokens beyond the
    context is refused (positions the model does not have: an index error or untrained positions), as vLLM refuses a
    max_model_len beyond the model's."""
    total = s.max_total_tokens
    if total is not None and context is not None and total > context[0]:
        n, key = context
        raise ConfigError(f"{s.given('max_total_tokens')} is beyond the model's context of {n} tokens ({key} in "
                          f"its config.json); give at most {n}, or leave it out to use {min(n, DEFAULT_MAX_TOTAL)}.")
    if total is None:
        total = min(context[0], DEFAULT_MAX_TOTAL) if context else DEFAULT_MAX_TOTAL
    inp = s.max_input_tokens if s.max_input_tokens is not None else total - 1
    prefill = s.max_batch_prefill_tokens
    if prefill is None:
        prefill = min(inp + PREFILL_EDGE, s.max_batch_total_tokens or inp + PREFILL_EDGE)
    fitted = replace(s, max_total_tokens=total, max_input_tokens=inp, max_batch_prefill_tokens=prefill)
    check(fitted)
    return fitted
