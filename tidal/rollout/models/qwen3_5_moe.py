"""Qwen3.5-MoE text (``model_type`` "qwen3_5_moe_text"): Qwen3.5's hybrid of Gated DeltaNet and gated full
attention (``qwen3_5.py``) with a sparse MoE block in every layer.

From transformers' ``modeling_qwen3_5_moe.py``: the block is Qwen2-MoE's (``moe.SparseMoE``): a softmax
top-``num_experts_per_tok`` router over ``num_experts`` experts of ``moe_intermediate_size``, always
renormalised over the k chosen, weights rounded to the model dtype, plus a shared expert of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``. No layer is dense.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tidal.rollout.models.moe import MoEArgs, MoECausalLM, SparseMoE
from tidal.rollout.models.qwen3_5 import Qwen35Args, Qwen35DecoderLayer, Qwen35ForCausalLM, qwen35_args


@dataclass
class Qwen35MoeArgs(Qwen35Args):
    """``Qwen35Args`` plus the MoE block's arguments."""

    moe: MoEArgs | None = None


def qwen35_moe_args(config) -> Qwen35MoeArgs:
    moe = MoEArgs(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=True,
        weights_in_model_dtype=True,
        sparse_layers=(True,) * config.num_hidden_layers,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size,
    )
    # No dense MLP anywhere: ``intermediate_size`` (read by the shared layers) is the experts'.
    args = qwen35_args(config, intermediate_size=config.moe_intermediate_size)
    return Qwen35MoeArgs(**vars(args), moe=moe)


class Qwen35MoeDecoderLayer(Qwen35DecoderLayer):
    """Qwen3.5's layer with ``SparseMoE`` as its MLP."""

    def __init__(self, args: Qwen35MoeArgs, layer_idx: int, attention_cls=None):
        super().__init__(args, layer_idx, attention_cls)
        self.mlp = SparseMoE(args)


class Qwen35MoeForCausalLM(MoECausalLM, Qwen35ForCausalLM):
    """``Qwen35ForCausalLM`` with MoE layers; ``MoECausalLM`` loads per-expert and stacked expert weights."""

    layer_cls = Qwen35MoeDecoderLayer
    packed_params: ClassVar = Qwen35ForCausalLM.packed_params

    @classmethod
    def args_from_hf_config(cls, config) -> Qwen35MoeArgs:
        return qwen35_moe_args(config)
