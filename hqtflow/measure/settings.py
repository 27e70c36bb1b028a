"""The measurement settings (no heavy imports: the CLI reads its option defaults from here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hqtflow.errors import CalibrationError, ConfigError

DEFAULT_MAX_LENGTH = 512  # tokens per calibration sequence when none is given (or the model's context, if shorter)


@dataclass(frozen=True)
class MeasureSettings:
    """Everything one measurement run needs; recipes and CLI flags both resolve to this."""

    output: str
    model: str | None = None
    config: str | None = None  # QUANT_CONFIG path; None = maxabs MEASURE defaults
    tasks: tuple[str, ...] = ()
    include_path: tuple[str, ...] = ()
    data_dir: str | None = None
    text: tuple[str, ...] = ()
    text_field: str = "text"
    limit: int | None = None
    batch_size: int = 8
    max_length: int | None = None  # None: the model's context, up to DEFAULT_MAX_LENGTH (measure.run.resolve_max_length)
    tp: int = 1
    dtype: str = "bf16"
    overwrite: bool = False
    seed: int = 0
    hessians: bool = False  # also record each Linear input's E[x xᵀ] (what `quantize --gptq` needs)
    recipe: str | None = None
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if not self.tasks and not self.text:
            raise CalibrationError("No calibration data: give lm-eval tasks (--tasks) and/or text files (--text).")
        for name, value, low in (("--limit", self.limit, 1), ("--batch-size", self.batch_size, 1),
                                 ("--max-length", self.max_length, 2), ("--tp", self.tp, 1)):
            if value is not None and value < low:
                raise ConfigError(f"{name} must be at least {low}, not {value}.")
        if self.hessians and self.tp > 1:
            raise ConfigError("--hessians (a recipe's `gptq: true`) records GPTQ's statistics on one rank; measure "
                              "with --tp 1 (cards: 1; a checkpoint is written from one rank's measurement anyway).")
        from hqtflow.choices import parse_dtype

        parse_dtype(self.dtype, auto=False)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> MeasureSettings:
        d = dict(d)
        for k in ("tasks", "include_path", "text"):
            d[k] = tuple(d.get(k) or ())
        return cls(**d)
