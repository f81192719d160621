"""A 7B-shaped GRPO run on one GPU (issue #39): ``bench/grpo_7b.py``'s random-init Qwen2.5-7B-shaped
checkpoint and flags, a small batch (4 prompts x 4 samples, 32 new tokens), 2 RL steps through ``tidal ppo``;
it must finish, log finite losses and save the model. GPU only (``gpu`` marker): ~15 GB of checkpoint is
written to the test's temporary folder."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import grpo_7b  # noqa: E402


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grpo_7b")
    args = argparse.Namespace(prompts=4, n=4, prompt_len=32, new_tokens=32, steps=1)
    grpo_7b.build_checkpoint(folder / "model", "qwen2.5-7b", "cuda")
    grpo_7b.write_data(folder, args)
    return folder, args


def two_steps(folder: Path, args, mode: str) -> None:
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    history = run_ppo(parse_run(grpo_7b.tidal_flags(args, folder, mode)))
    assert len(history) == 2
    assert all(math.isfinite(h["policy/loss"]) for h in history), history
    saved = folder / f"out_{mode}"
    assert (saved / "config.json").exists() or (saved / "adapter_config.json").exists()
    weights = list(saved.glob("*.safetensors"))
    assert weights and sum(f.stat().st_size for f in weights) > 0
    if mode == "full":  # the whole policy, 7.6B parameters, in one loadable folder
        assert json.loads((saved / "config.json").read_text())["num_hidden_layers"] == 28


@pytest.mark.gpu
def test_7b_grpo_with_lora_runs_two_steps_and_saves(workload):
    two_steps(*workload, "lora")


@pytest.mark.gpu
def test_7b_grpo_full_parameters_runs_two_steps_and_saves(workload):
    # --master_dtype bf16 (grpo_7b.MODE_FLAGS): 8 bytes a parameter on the GPU (the memory plan: 76 GiB at the
    # peak of an H200's 137 usable), 6 in host memory while --deepspeed_enable_sleep parks it (43 GiB)
    assert "--master_dtype" in grpo_7b.mode_flags(workload[1], "full")
    two_steps(*workload, "full")
