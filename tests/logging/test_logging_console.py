"""get_logger: concise messages under the ``tidal`` logger; the package never shadows stdlib logging."""

import logging

import tidal.logging.console as console
from tidal.logging import get_logger


def test_stdlib_logging_is_not_shadowed():
    assert console.logging is logging
    assert logging.__file__.endswith("logging/__init__.py") and "tidal" not in logging.__file__


def test_get_logger_names_and_level(capsys):
    log = get_logger("trainers.sft")
    assert log.name == "tidal.trainers.sft" and get_logger("tidal.data").name == "tidal.data"
    assert log.getEffectiveLevel() == logging.INFO
    log.info("skipped 3 samples longer than max_len")
    log.debug("not shown")
    err = capsys.readouterr().err
    assert "I tidal.trainers.sft: skipped 3 samples longer than max_len" in err and "not shown" not in err


def test_handler_installed_once():
    get_logger("a")
    get_logger("b")
    handlers = [h for h in logging.getLogger("tidal").handlers if isinstance(h, console.TqdmHandler)]
    assert len(handlers) == 1
