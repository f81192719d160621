"""Qwen3.5's vision-language models (``qwen3_5``, ``qwen3_5_moe``): transformers' Qwen3.5 vision tower in
front of the engine's hybrid Qwen3.5 decoder (``qwen3_5.py``: Gated DeltaNet linear attention and gated full
attention; ``qwen3_5_moe.py``: the same with a sparse MoE block in every layer).

Everything vision-related is Qwen3-VL's (``qwen3_vl.QwenVisionMixin``): the tower runs in prefill over the
step's images and its features replace the image placeholder tokens' embeddings; prefill tokens carry
interleaved M-RoPE (temporal, height, width) positions, decode tokens plain positions plus the sequence's
delta. Two differences: the tower (``Qwen3_5VisionModel``) has no DeepStack mergers, and RoPE rotates the
first ``partial_rotary_factor * head_dim`` channels of each full-attention head only, so the M-RoPE axis
map covers those channels' frequencies (``mrope_section`` sums to them). The linear-attention layers keep
their recurrent state per sequence as in the text model; positions do not reach them.
"""

from __future__ import annotations

from tidal.rollout.models.qwen3_5 import Qwen35Args, Qwen35ForCausalLM, qwen35_args
from tidal.rollout.models.qwen3_5_moe import Qwen35MoeArgs, Qwen35MoeForCausalLM, qwen35_moe_args
from tidal.rollout.models.qwen3_vl import QwenVisionMixin


class Qwen35VLForConditionalGeneration(QwenVisionMixin, Qwen35ForCausalLM):
    family_name = "qwen3_5"
    ignored_weights = Qwen35ForCausalLM.ignored_weights

    @classmethod
    def vision_tower_class(cls) -> type:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

        return Qwen3_5VisionModel

    @classmethod
    def args_from_hf_config(cls, config) -> Qwen35Args:
        args = qwen35_args(config.get_text_config(), model_type=config.model_type)
        return cls.vision_args(args, config)


class Qwen35MoeVLForConditionalGeneration(QwenVisionMixin, Qwen35MoeForCausalLM):
    family_name = "qwen3_5_moe"
    ignored_weights = Qwen35MoeForCausalLM.ignored_weights

    @classmethod
    def vision_tower_class(cls) -> type:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

        return Qwen3_5MoeVisionModel

    @classmethod
    def args_from_hf_config(cls, config) -> Qwen35MoeArgs:
        args = qwen35_moe_args(config.get_text_config())
        args.model_type = config.model_type
        return cls.vision_args(args, config)
