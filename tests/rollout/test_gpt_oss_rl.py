"""``tidal ppo`` (GRPO) on the tiny gpt-oss: the engine samples with sinks, sliding windows and the biased
MoE, the trainer (transformers' eager gpt-oss, packed rows with per-layer-kind masks) scores the same
tokens, and in float32 the two agree to well below 1e-3 per token (``rollout/logprob_mismatch``)."""

from __future__ import annotations

import pytest

from tests.trainers.test_ppo import rl_flags, write_echo_data
from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo import run_ppo


@pytest.mark.parametrize(
    "extra", [["--packing_samples", "--moe_router_replay"], []], ids=["packed_replay", "padded"]
)
def test_grpo_on_tiny_gpt_oss_matches_engine_logprobs(extra, tiny_model, tmp_path):
    data = write_echo_data(tmp_path / "data")
    flags = rl_flags(
        tiny_model("gpt_oss"), data, tmp_path / "rl", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
        "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--generate_max_len", "12",
        "--max_samples", "8", *extra,
    )  # fmt: skip
    history = run_ppo(parse_run(flags))
    assert len(history) == 2
    for step in history:
        assert step["rollout/logprob_mismatch"] < 1e-3, step
    assert (tmp_path / "rl" / "final" / "model.safetensors").exists()
