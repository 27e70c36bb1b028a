"""The serving settings (no heavy imports: the CLI reads its option defaults from here)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServeSettings:
    """What `hqtflow serve` serves with; its CLI options take their defaults from here (so tests and users agree)."""

    model_id: str = "model"
    served_model_name: str | None = None  # the name clients see instead of model_id, a path (TGI's flag)
    quantize: str | None = None  # "fp8" when the model is FP8 (/info's `quantize`, as TGI's --quantize names it)
    # None: TGI's launcher defaults, from the model's context (runtime/limits.py): total min(context, 4096), input
    # total - 1, prefill input + 50
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    max_batch_size: int = 0  # 0: as many running sequences as the KV blocks hold
    max_batch_total_tokens: int | None = None  # KV tokens of the paged cache (None: from free memory)
    kv_cache: str = "bf16"  # or "fp8": the checkpoint's k_scale/v_scale
    max_concurrent_requests: int = 128
    # stop sequences a request may give (TGI's flag; TGI and OpenAI allow 4): more, because lm-eval's
    # local-completions sends a task's whole `until` list plus the EOS token (humaneval: 6)
    max_stop_sequences: int = 16
    max_best_of: int = 4  # sequences one request may run: TGI's best_of, OpenAI's n and best_of (TGI's flag)
    max_top_n_tokens: int = 5  # TGI's top_n_tokens at most (TGI's flag and default)
    # prompts one /v1/completions request may batch, and sequences (prompts x n or best_of) (TGI's flag; TGI's default
    # is 4: 64 lets lm-eval's local-completions send its batches)
    max_client_batch_size: int = 64
    payload_limit: int = 2_000_000  # a request body's bytes at most (TGI's flag and default; a 413 above)
    api_key: str | None = None
    batch_bucket_size: int = 1
    prefill_batch_bucket_size: int = 1
    max_batch_prefill_tokens: int | None = None
    pad_sequence_to_multiple_of: int = 16
    warmup: bool = False
    cuda_graphs: str = ""  # batch sizes of CUDA-graph decode steps, "1,2,4" (TGI's); "0": none; "": 1..32 on a GPU
    compile: bool = False  # those decode steps through torch.compile before capture (a CUDA GPU only)
    shutdown_timeout: float = 20.0  # seconds running requests may take to finish after SIGTERM (then they are cut)
    client_timeout: float = 60.0  # seconds a client may take to send its request, or stall reading (0: no limit)
    cors_allow_origin: list[str] = field(default_factory=list)  # origins a browser may call from (TGI's flag)
    # where a value came from when not its flag (an environment variable: {"max_total_tokens": "MAX_TOTAL_TOKENS"}),
    # so that a refusal names what the user set
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def served_name(self) -> str:
        """The model's name to clients (/info's model_id, /v1/models, the `model` of /v1 answers): TGI's
        --served-model-name, else the model as given to serve."""
        return self.served_model_name or self.model_id

    def named(self, name: str) -> str:
        """The flag or environment variable that set option `name` (its flag when not given)."""
        return self.sources.get(name) or f"--{name.replace('_', '-')}"

    def given(self, name: str) -> str:
        """Option `name` as the user set it: `--max-total-tokens 8192` or `MAX_TOTAL_TOKENS=8192`."""
        return f"{self.sources[name]}={getattr(self, name)}" if name in self.sources else f"{self.named(name)} {getattr(self, name)}"
