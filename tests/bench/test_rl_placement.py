"""``bench/rl_placement.py``: the per-rank peak memory it reads from the trainer's metrics, and the flags
of the colocated variants (the engine's sleep; ``--trainer_sleep``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import rl_placement  # noqa: E402


def test_peak_memory_is_each_ranks_largest_over_the_steps():
    steps = [
        {"train/time/step": 1.0, "train/memory/peak_gb_rank0": 50.0, "train/memory/peak_gb_rank1": 41.0},
        {"train/time/step": 1.0, "train/memory/peak_gb_rank0": 48.5, "train/memory/peak_gb_rank1": 43.25},
    ]
    assert rl_placement.peak_memory(steps) == [50.0, 43.25]
    assert rl_placement.peak_memory([{"train/time/step": 1.0}]) is None  # the CPU logs none


def test_colocated_tp2_sleeps_its_engine_and_trainer_sleep_adds_the_trainers():
    args = rl_placement.parse_args(["--variants", "colocated_tp2"])
    flags = rl_placement.variant_flags(args, "colocated_tp2")
    assert flags == ["--colocate_all_models", "--vllm_tensor_parallel_size", "2", "--vllm_enable_sleep"]
    args = rl_placement.parse_args(["--trainer_sleep"])
    assert rl_placement.variant_flags(args, "colocated")[-1] == "--deepspeed_enable_sleep"
    assert "--deepspeed_enable_sleep" not in rl_placement.variant_flags(args, "separate")  # refused there
