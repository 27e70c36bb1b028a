"""User-facing errors: the CLI prints their message as one sentence and exits with code 2."""


class HqtflowError(Exception):
    """A problem with the user's input or environment (not a bug): printed without a traceback."""

    exit_code = 2


class ConfigError(HqtflowError):
    """A QUANT_CONFIG or recipe value is missing, unknown or out of range."""


class ArtifactError(HqtflowError):
    """An artifact directory is missing, partial, mismatched or of a newer schema."""


class ModelError(HqtflowError):
    """A model cannot be found, loaded or split as asked."""


class CalibrationError(HqtflowError):
    """Calibration data is missing, empty or unusable."""


class ProvenanceWarning(UserWarning):
    """Something is read whose origin hqtflow cannot check (a foreign dump): the CLI prints it as one line."""
