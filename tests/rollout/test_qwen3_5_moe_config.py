"""A Qwen3.5-MoE config as released (only ``moe_intermediate_size``, no ``intermediate_size`` field, as in
Qwen3.5-35B-A3B's config.json) builds in the engine and decodes as transformers does."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.rollout.reference import PROMPTS, cpu_config, greedy, hf_greedy
from tidal.rollout import LLMEngine


def test_moe_config_without_intermediate_size_decodes_like_transformers():
    config = AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=256,
    )  # fmt: skip
    assert "intermediate_size" not in config.to_dict()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engine = LLMEngine(None, cpu_config(), model=hf)
    outputs = engine.generate(PROMPTS[:2], greedy(6))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, 6) for p in PROMPTS[:2]]
