"""Qwen3-MoE (``model_type`` "qwen3_moe"): Qwen3's attention (q/k norm per head) with sparse MoE layers.

From transformers' ``modeling_qwen3_moe.py``: every layer is sparse (``moe.SparseMoE``: ``num_experts``
experts of ``moe_intermediate_size``, top ``num_experts_per_tok``, renormalised iff ``norm_topk_prob``,
routing weights rounded to the model dtype) except those listed in ``mlp_only_layers`` or off the
``decoder_sparse_step`` grid, which keep a dense MLP of ``intermediate_size``. No shared expert.
"""

from __future__ import annotations

from tidal.rollout.models.moe import MoECausalLM, MoEDecoderArgs, qwen_moe_args
from tidal.rollout.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoECausalLM):
    attention_cls = Qwen3Attention

    @classmethod
    def args_from_hf_config(cls, config) -> MoEDecoderArgs:
        return MoEDecoderArgs.from_hf_config(config, moe=qwen_moe_args(config))
