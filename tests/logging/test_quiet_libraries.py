"""Library warnings that are noise at tidal's default log level (bitsandbytes' "No module named
'kernels'" on import) are silenced where they arise: their logger's level, unless the user set one."""

from __future__ import annotations

import logging
import subprocess
import sys

from tidal.logging import console


def test_bitsandbytes_kernels_warning_is_not_printed():
    code = (
        "import logging, tidal.logging; tidal.logging.get_logger('x'); logging.basicConfig();"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning("
        "'Failed to load CPU gemm_4bit_forward from kernels-community: No module named kernels')"
    )
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert "kernels" not in err


def test_a_level_the_user_set_is_kept(monkeypatch):
    name = "tidal_test_noisy_library"
    monkeypatch.setitem(console.QUIET_LIBRARY_LOGGERS, name, logging.ERROR)
    logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        console.quiet_library_loggers()
        assert logging.getLogger(name).level == logging.DEBUG
    finally:
        logging.getLogger(name).setLevel(logging.NOTSET)
