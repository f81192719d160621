"""``tidal ppo`` (GRPO) on the tiny Gemma 4 text model: the engine samples (per-layer embeddings, KV-shared
layers, sliding windows), transformers' model scores the same tokens from packed rows (``--packing_samples``:
its sliding-window masks keep packed samples apart), their log-probs agree in float32 before and after the
weight sync, and the saved policy loads in transformers."""

from __future__ import annotations

import torch

from tests.rollout.grpo import train_two_steps
from tests.rollout.test_qwen3_5_grpo import _flags

FAMILY = "gemma4_text"


def test_grpo_trains_gemma4_packed_with_engine_logprobs_matching_the_trainer(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = tiny_model(FAMILY)
    before, after = train_two_steps(policy, tmp_path, _flags(policy, tmp_path, "--packing_samples"), FAMILY)
    final = tmp_path / "rl" / "final"
    for name in ("model.embed_tokens_per_layer.weight", "model.layers.3.self_attn.q_proj.weight"):
        assert not torch.equal(before[name], after[name])  # the update reached the PLE and a shared layer
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert type(model).__name__ == "Gemma4ForCausalLM"
    torch.testing.assert_close(model.state_dict()[name], after[name])
