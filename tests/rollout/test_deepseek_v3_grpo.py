"""``tidal ppo`` (GRPO) on a tiny DeepSeek-V3: transformers' model trains, the engine generates with
multi-head latent attention, and their log-probs agree after the weight sync; ``--packing_samples`` is
refused in one line (tidal's CUDA varlen attention takes no value head dim other than the query's)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from safetensors.torch import load_file

from tests.trainers.test_ppo import rl_flags, write_echo_data
from tidal.config import ConfigError

# Rewards that differ between a prompt's samples (the response's length), so every step updates the weights.
REWARD = textwrap.dedent(
    """
    import torch

    def reward_func(queries, prompts, labels, **kwargs):
        lengths = torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])
        return {"rewards": lengths / 10, "scores": lengths / 10}
    """
)


def test_grpo_trains_deepseek_v3_with_engine_logprobs_matching_the_trainer(tmp_path):
    from tidal.cli.train_ppo import parse_run
    from tidal.testing import build_tiny_model
    from tidal.trainers.ppo import run_ppo
    from tidal.trainers.ppo.entry import check_models_before_loading

    policy = build_tiny_model(tmp_path / "policy", "deepseek_v3")
    data = write_echo_data(tmp_path / "data")
    reward = tmp_path / "length_reward.py"
    reward.write_text(REWARD)
    flags = rl_flags(policy, data, tmp_path / "rl", "--advantage_estimator", "group_norm",
                     "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
                     "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--max_samples", "8")  # fmt: skip
    flags[flags.index("--remote_rm_url") + 1] = str(reward)
    refusal = "^--packing_samples: packing_samples is not supported for the deepseek_v3 family: .*v_head_dim"
    with pytest.raises(ConfigError, match=refusal):
        check_models_before_loading(parse_run([*flags, "--packing_samples"]))
    history = run_ppo(parse_run(flags))
    assert len(history) == 2
    # fp32 on the CPU: the engine's latent attention and routing against transformers' forward, before
    # and after the first update reached the engine (update_weights).
    mismatch = [step["rollout/logprob_mismatch"] for step in history]
    print(f"deepseek_v3 GRPO engine-vs-trainer |Δ log-prob| per step: {mismatch}")
    assert max(mismatch) < 1e-3
    before, after = (
        load_file(policy / "model.safetensors"),
        load_file(tmp_path / "rl" / "final" / "model.safetensors"),
    )
    assert not torch.equal(
        before["model.layers.1.self_attn.kv_b_proj.weight"],
        after["model.layers.1.self_attn.kv_b_proj.weight"],
    )


def test_trainer_side_chunked_head_equals_full_logits(tmp_path):
    """``chunkable_head``: the trainer computes DeepSeek-V3's log-probs from hidden states in chunks (what
    test_families checks with packing, which this family refuses)."""
    from tests.rollout.test_families import SAMPLES
    from tidal.config.model import ModelConfig
    from tidal.data import collate_padded
    from tidal.models import token_logprobs
    from tidal.models.loading import load_causal_lm
    from tidal.models.logprob_head import chunkable_head
    from tidal.testing import build_tiny_model

    path = build_tiny_model(tmp_path / "policy", "deepseek_v3")
    model = load_causal_lm(ModelConfig(pretrain=str(path)), torch.device("cpu"))
    assert chunkable_head(model) is not None
    padded = collate_padded(SAMPLES, 0)
    with torch.no_grad():
        full, _ = token_logprobs(model, padded, chunk_size=None)
        chunked, _ = token_logprobs(model, padded, chunk_size=4)
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
