"""``tidal ppo`` (GRPO) on a tiny Qwen3.5 text model: the engine samples with its Gated DeltaNet states,
transformers' model (padded rows: its linear-attention layers cannot keep packed samples apart without
the CUDA kernels, so ``--packing_samples`` is refused before loading) scores the same tokens, their
log-probs agree in float32 before and after the weight sync, and the saved policy loads in transformers."""

from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from tests.trainers.test_ppo import rl_flags, write_echo_data
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.entry import check_models_before_loading

# Rewards that differ between a prompt's samples (the response's length), so every step updates the weights.
REWARD = textwrap.dedent(
    """
    import torch

    def reward_func(queries, prompts, labels, **kwargs):
        lengths = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
        return {"rewards": lengths / 10, "scores": lengths / 10}
    """
)


def _flags(policy, tmp_path, *extra) -> list[str]:
    data = write_echo_data(tmp_path / "data")
    reward = tmp_path / "length_reward.py"
    reward.write_text(REWARD)
    flags = rl_flags(policy, data, tmp_path / "rl", "--advantage_estimator", "group_norm",
                     "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
                     "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--max_samples", "8",
                     "--generate_max_len", "8", *extra)  # fmt: skip
    flags[flags.index("--remote_rm_url") + 1] = str(reward)
    return flags


@pytest.mark.parametrize(
    ("family", "extra"), [("qwen3_5_text", []), ("qwen3_5_moe_text", ["--moe_router_replay"])]
)
def test_grpo_trains_qwen3_5_with_engine_logprobs_matching_the_trainer(family, extra, tiny_model, tmp_path):
    """The MoE variant also replays the engine's expert choices in the trainer's forward."""
    from transformers import AutoModelForCausalLM

    policy = tiny_model(family)
    refusal = f"^--packing_samples: packing_samples is not supported for the {family} family"
    with pytest.raises(ConfigError, match=refusal):
        check_models_before_loading(parse_run(_flags(policy, tmp_path, "--packing_samples")))
    history = run_ppo(parse_run(_flags(policy, tmp_path, *extra)))
    assert len(history) == 2
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    print(f"{family} GRPO engine-vs-trainer |Δ log-prob| per step: {mismatch}")
    assert max(mismatch) < 1e-3
    final = tmp_path / "rl" / "final"
    before, after = load_file(policy / "model.safetensors"), load_file(final / "model.safetensors")
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not torch.equal(before[name], after[name])  # the update reached the linear-attention layers
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(model).__name__ in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
    torch.testing.assert_close(model.state_dict()[name], after[name])
