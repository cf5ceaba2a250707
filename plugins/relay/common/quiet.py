"""Lines a person reading a chunk's log does not need, kept out of it: verl's platform detection on a host without
an accelerator (two warnings in every process that imports verl, saying it falls back to its default) and
torchdata's deprecation warning of a torch call that torchdata itself makes. Real problems still show."""

from __future__ import annotations

import logging
import warnings

VERL_PLATFORM_LOGGER = "verl.plugin.platform.platform_manager"
NOISE = ("No supported accelerator detected", "is registered but not available")


class _KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(n in text for n in NOISE)


def quiet_known_noise() -> None:
    """Install the filters in this process; call before verl and torchdata are imported."""
    logger = logging.getLogger(VERL_PLATFORM_LOGGER)
    if not any(isinstance(f, _KnownNoise) for f in logger.filters):
        logger.addFilter(_KnownNoise())
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
