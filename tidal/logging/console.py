"""Human-readable messages: ``get_logger(name)`` returns a stdlib logger with a concise format.

Messages go through ``tqdm.write`` so they never break a progress bar. The handler sits on the
``tidal`` logger; records still propagate to the root logger, so pytest's ``caplog`` sees them.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

ROOT_NAME = "tidal"
FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"


class TqdmHandler(logging.Handler):
    """Writes records to stderr above any active tqdm bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            # sys.stderr is looked up per record so redirection (pytest capture, notebooks) works.
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never crash training
            self.handleError(record)


# Library loggers whose warnings are noise for tidal's users at the default level, with the level they
# get (unless the user already set one): bitsandbytes warns on import, on CPUs with AVX512-BF16, that
# the optional `kernels` package is missing (it only speeds up 4-bit matmuls on CPU).
QUIET_LIBRARY_LOGGERS = {"bitsandbytes.backends.cpu.ops": logging.ERROR}


def quiet_library_loggers() -> None:
    """Raise the noisy library loggers' levels (``QUIET_LIBRARY_LOGGERS``) where the user has not."""
    for name, level in QUIET_LIBRARY_LOGGERS.items():
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(level)


def _configure_root() -> logging.Logger:
    root = logging.getLogger(ROOT_NAME)
    if not any(isinstance(h, TqdmHandler) for h in root.handlers):
        handler = TqdmHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        quiet_library_loggers()
    return root


def get_logger(name: str = ROOT_NAME) -> logging.Logger:
    """A logger under ``tidal`` (``get_logger(__name__)`` in tidal modules), INFO by default."""
    _configure_root()
    if name != ROOT_NAME and not name.startswith(ROOT_NAME + "."):
        name = f"{ROOT_NAME}.{name}"
    return logging.getLogger(name)
