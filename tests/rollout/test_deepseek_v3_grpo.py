"""``tidal ppo`` (GRPO) on a tiny DeepSeek-V3: transformers' model trains, the engine generates with
multi-head latent attention, and their log-probs agree after the weight sync; the trainer scores packed rows
(``--packing_samples``) with a value head dim (16) other than the query/key one (24), as the real model's."""

from __future__ import annotations

import torch

from tests.rollout.grpo import grpo_flags, train_two_steps


def test_grpo_trains_deepseek_v3_with_engine_logprobs_matching_the_trainer(tmp_path):
    from tidal.cli.train_ppo import parse_run
    from tidal.testing import build_tiny_model
    from tidal.trainers.ppo.entry import check_models_before_loading

    policy = build_tiny_model(tmp_path / "policy", "deepseek_v3", v_head_dim=16)
    flags = grpo_flags(policy, tmp_path, "--packing_samples")
    check_models_before_loading(parse_run(flags))  # packing is no longer refused for the family
    # fp32 on the CPU: the engine's latent attention and routing against transformers' forward, before
    # and after the first update reached the engine (update_weights).
    before, after = train_two_steps(policy, tmp_path, flags, "deepseek_v3")
    assert not torch.equal(
        before["model.layers.1.self_attn.kv_b_proj.weight"],
        after["model.layers.1.self_attn.kv_b_proj.weight"],
    )


def test_trainer_side_chunked_head_equals_full_logits(tmp_path):
    """``chunkable_head``: the trainer computes DeepSeek-V3's log-probs from hidden states in chunks (what
    test_families checks with packing), on a padded batch."""
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
