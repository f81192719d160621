"""``bench/profile_prefill.py`` on the CPU (tiny model): it counts the engine's prefill steps, profiles the
kernels (CPU ops) of each, and says whether the flash path ran (never on the CPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench import profile_prefill  # noqa: E402


def test_a_prefill_of_8_prompts_in_64_token_steps_is_4_profiled_steps(capsys):
    results = profile_prefill.main(
        [
            "--device",
            "cpu",
            "--batch",
            "8",
            "--prompt_len",
            "32",
            "--max_num_batched_tokens",
            "64",
            "--flash_prefill",
            "both",
        ]
    )
    assert [r["flash_prefill"] for r in results] == [True, False]
    for result in results:
        assert result["steps"] == 4  # 8 x 32 prompt tokens, at most 64 a step: two prompts a step
        assert not result["flash_taken"]  # float32 on the CPU: the padded path
        assert result["prefill_s"] > 0 and result["busy_ms"] > 0
        assert {"gemm", "attention"} <= result["kernel_ms"].keys()
    assert capsys.readouterr().out.count('"bench": "profile_prefill"') == 2  # one JSON line each


def test_the_decode_only_options_are_refused_not_ignored():
    for flag in (["--steps", "3"], ["--cuda_rope", "off"], ["--fused_kernels", "off"], ["--final_only"]):
        with pytest.raises(SystemExit):
            profile_prefill.parse_args(flag)
