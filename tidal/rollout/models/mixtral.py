"""Mixtral (``model_type`` "mixtral"): Mistral's attention (one ``sliding_window`` for every layer, or
none) with a sparse MoE block in every layer.

From transformers' ``modeling_mixtral.py``: ``num_local_experts`` experts of ``intermediate_size``, top
``num_experts_per_tok``, always renormalised, routing weights kept in float32. Checkpoints name the block
``block_sparse_moe`` and the expert projections ``w1`` (gate), ``w3`` (up), ``w2`` (down); the renames
below map them onto the Qwen-style names ``moe.MoECausalLM`` loads. ``router_jitter_noise`` applies only
in training, so the engine ignores it.
"""

from __future__ import annotations

from tidal.rollout.models.moe import MoEArgs, MoECausalLM, MoEDecoderArgs


class MixtralForCausalLM(MoECausalLM):
    weight_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )

    @classmethod
    def args_from_hf_config(cls, config) -> MoEDecoderArgs:
        moe = MoEArgs(
            num_experts=config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            weights_in_model_dtype=False,
            sparse_layers=(True,) * config.num_hidden_layers,
            intermediate_field="intermediate_size",
        )
        return MoEDecoderArgs.from_hf_config(config, moe=moe)
