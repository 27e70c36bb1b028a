"""Moved: the QUANT_CONFIG reader is `hqtflow.formats.quant_config` (every on-disk format lives in formats/); this name
stays for scripts that import `hqtflow.config.QuantConfig`."""

from hqtflow.formats.quant_config import *  # noqa: F401,F403
from hqtflow.formats.quant_config import QuantConfig  # noqa: F401
