"""Shared by the GRPO tests of the engine's families (test_qwen3_5_grpo.py, test_gemma4_grpo.py,
test_deepseek_v3_grpo.py): the run's flags, and two ``tidal ppo`` steps whose engine and trainer log-probs
must agree in float32."""

from __future__ import annotations

import textwrap
from pathlib import Path

from safetensors.torch import load_file

from tests.trainers.test_ppo import rl_flags, write_echo_data
from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo import run_ppo

# Rewards that differ between a prompt's samples (the response's length), so every step updates the weights.
REWARD = textwrap.dedent(
    """
    import torch

    def reward_func(queries, prompts, labels, **kwargs):
        lengths = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
        return {"rewards": lengths / 10, "scores": lengths / 10}
    """
)


def grpo_flags(policy: Path, tmp_path: Path, *extra: str) -> list[str]:
    """Two GRPO steps (group_norm, 4 samples of 4 prompts a rollout, 8 prompts) on the echo data with the
    length reward; the run writes under ``tmp_path / "rl"``."""
    data = write_echo_data(tmp_path / "data")
    reward = tmp_path / "length_reward.py"
    reward.write_text(REWARD)
    flags = rl_flags(policy, data, tmp_path / "rl", "--advantage_estimator", "group_norm",
                     "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
                     "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--max_samples", "8",
                     *extra)  # fmt: skip
    flags[flags.index("--remote_rm_url") + 1] = str(reward)
    return flags


def train_two_steps(policy: Path, tmp_path: Path, flags: list[str], family: str) -> tuple[dict, dict]:
    """Run ``flags`` (from ``grpo_flags``): two steps whose engine-vs-trainer |Δ log-prob| stays below 1e-3,
    before and after the first update reached the engine. Returns the policy's weights before and after."""
    history = run_ppo(parse_run(flags))
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    print(f"{family} GRPO engine-vs-trainer |Δ log-prob| per step: {mismatch}")
    assert max(mismatch) < 1e-3
    return load_file(policy / "model.safetensors"), load_file(tmp_path / "rl" / "final" / "model.safetensors")
