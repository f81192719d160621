"""Qwen2-MoE (``model_type`` "qwen2_moe"): Qwen2's attention (q/k/v bias from ``qkv_bias``, none on o)
with sparse MoE layers that add a gated shared expert.

From transformers' ``modeling_qwen2_moe.py``: routed experts as Qwen3-MoE's (``moe_intermediate_size``,
top ``num_experts_per_tok``, renormalised iff ``norm_topk_prob``), plus ``shared_expert`` (a dense MLP of
``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``; dense layers follow
``mlp_only_layers`` / ``decoder_sparse_step``.
"""

from __future__ import annotations

from tidal.rollout.models.moe import MoECausalLM, MoEDecoderArgs, qwen_moe_args


class Qwen2MoeForCausalLM(MoECausalLM):
    @classmethod
    def args_from_hf_config(cls, config) -> MoEDecoderArgs:
        moe = qwen_moe_args(config, config.shared_expert_intermediate_size)
        qkv_bias = bool(getattr(config, "qkv_bias", True))
        return MoEDecoderArgs.from_hf_config(config, qkv_bias=qkv_bias, o_bias=False, moe=moe)
