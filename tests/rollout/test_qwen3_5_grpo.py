"""``tidal ppo`` (GRPO) on a tiny Qwen3.5 text model: the engine samples with its Gated DeltaNet states,
transformers' model (padded rows: its linear-attention layers cannot keep packed samples apart without
the CUDA kernels, so ``--packing_samples`` is refused before loading) scores the same tokens, their
log-probs agree in float32 before and after the weight sync, and the saved policy loads in transformers."""

from __future__ import annotations

import pytest
import torch

from tests.rollout.grpo import grpo_flags, train_two_steps
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.trainers.ppo.entry import check_models_before_loading


def _flags(policy, tmp_path, *extra) -> list[str]:
    """``grpo_flags`` with 8-token responses."""
    return grpo_flags(policy, tmp_path, "--generate_max_len", "8", *extra)


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
    before, after = train_two_steps(policy, tmp_path, _flags(policy, tmp_path, *extra), family)
    final = tmp_path / "rl" / "final"
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert not torch.equal(before[name], after[name])  # the update reached the linear-attention layers
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(model).__name__ in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
    torch.testing.assert_close(model.state_dict()[name], after[name])
