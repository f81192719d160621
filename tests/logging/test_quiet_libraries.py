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


def test_a_tiny_lora_sft_run_prints_no_library_noise(tiny_llama, tmp_path):
    """A whole run in a fresh process (imports included): no bitsandbytes `kernels` line, no
    deprecation or future warnings, no transformers load report."""
    from tidal.testing import AdditionTask

    data = AdditionTask(digits=2).write_jsonl(tmp_path / "train.jsonl", 8)
    argv = ["sft", "--pretrain", str(tiny_llama), "--dataset", str(data), "--input_key", "prompt",
            "--output_key", "answer", "--max_len", "64", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--lora_rank", "4", "--save_path", str(tmp_path / "out"), "--ckpt_path", str(tmp_path / "ckpt")]  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "tidal.cli.main", *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    for noise in ("kernels", "DeprecationWarning", "FutureWarning", "LOAD REPORT", "Traceback"):
        assert noise not in run.stderr, noise
