"""The one list of model families tidal's rollout engine implements (HF ``model_type`` -> ``Family``).

Everything that names the supported families reads it: the engine's model construction (``loader.py``)
and its "unsupported model_type" error, ``tidal ppo``'s check before loading, the trainer's chunked LM
head (``tidal.models.logprob_head``), the tiny-model builders of ``tidal.testing``, ``tidal demo``'s
choices and the engine tests. Adding a family is one file under ``tidal/rollout/models/`` (a
``layers.CausalLM`` subclass) plus one ``Family`` line here.

This module is plain data (model classes are named, and imported only when a model is built), so reading
the list costs no model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    """One supported ``model_type``.

    ``model_class``: "module:Class" under ``tidal.rollout.models``. ``tiny``: HF config fields of the tiny
    offline model (``tidal.testing.build_tiny_model``), on top of its shared tiny shapes. ``tiny_adds_bos``:
    the tiny tokenizer prepends a bos token, as the family's real tokenizers do. ``chunkable_head``: the HF
    forward applies nothing after ``lm_head`` (no soft-capping or logit scaling), so the trainer may
    compute log-probs from the hidden states in chunks. ``refuses``: the engine features (``FEATURES``) this
    family does not support, each with the one-line reason the engine gives when asked for it. ``exact``:
    the devices (``"cpu"``, ``"cuda"``) exact mode runs the family on (``--exact_logprobs``: bit-identical
    log-probs in engine and trainer; on CUDA, the families measured exact on an H200), read by
    ``batch_invariant.support``; empty: exact mode refuses the family.
    """

    model_type: str
    model_class: str
    tiny: dict[str, Any] = field(default_factory=dict)
    tiny_adds_bos: bool = False
    chunkable_head: bool = True
    refuses: dict[str, str] = field(default_factory=dict)
    exact: tuple[str, ...] = ()


# Why a family refuses an FP8 KV cache (``EngineConfig.kv_cache_dtype``): the paths that dequantize it are
# ``layers.paged_attention`` and the fused kernels behind ``layers.Attention``; these attend otherwise.
_SOFTCAP_KV = (
    "its soft-capped attention reads the KV cache on a path of its own, which does not dequantize FP8"
)
_GEMMA4_KV = (
    "its KV-shared layers view the cache with per-layer head shapes that the FP8 scales do not follow"
)
_SINKS_KV = "its attention sinks read the KV cache on a path of its own, which does not dequantize FP8"
_MLA_KV = "multi-head latent attention caches one latent row per token, not per-head keys and values"

# One line per family (the table reads better unwrapped).
# fmt: off
_FAMILIES = (
    Family("llama", "llama:LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0), tiny_adds_bos=True, exact=("cpu", "cuda")),
    Family("qwen2", "qwen2:Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0), exact=("cpu", "cuda")),
    Family("qwen3", "qwen3:Qwen3ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1000000.0, head_dim=32), exact=("cpu", "cuda")),
    Family("mistral", "llama:LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None), tiny_adds_bos=True, exact=("cpu", "cuda")),
    Family("olmo2", "olmo2:Olmo2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=500000.0)),
    Family("gemma2", "gemma2:Gemma2ForCausalLM", dict(tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=24, sliding_window=8), tiny_adds_bos=True, chunkable_head=False, refuses=dict(fp8_kv_cache=_SOFTCAP_KV)),
    Family("gemma3_text", "gemma3:Gemma3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=2), tiny_adds_bos=True, chunkable_head=False, refuses=dict(fp8_kv_cache=_SOFTCAP_KV)),
    Family("phi3", "phi3:Phi3ForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    Family("qwen3_moe", "qwen3_moe:Qwen3MoeForCausalLM", dict(tie_word_embeddings=False, rope_theta=1000000.0, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[2]), exact=("cpu", "cuda")),
    Family("qwen2_moe", "qwen2_moe:Qwen2MoeForCausalLM", dict(tie_word_embeddings=False, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128, norm_topk_prob=False, decoder_sparse_step=2), exact=("cpu", "cuda")),
    Family("mixtral", "mixtral:MixtralForCausalLM", dict(tie_word_embeddings=False, rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128, sliding_window=None), tiny_adds_bos=True, exact=("cpu", "cuda")),
    Family("deepseek_v3", "deepseek_v3:DeepseekV3ForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0, num_key_value_heads=6, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True), refuses=dict(tensor_parallel="multi-head latent attention's cache and projections are not sharded across ranks", record_routing="router replay forces softmax top-k weights, not DeepSeek-V3's group-limited sigmoid router", fp8_kv_cache=_MLA_KV)),
    Family("qwen3_5_text", "qwen3_5:Qwen35ForCausalLM", dict(tie_word_embeddings=False, head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5), layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4), refuses=dict(packing_samples="transformers' Gated DeltaNet layers keep packed samples apart only with the flash-linear-attention and causal-conv1d kernels, which tidal neither requires nor tests")),
    Family("qwen3_5_moe_text", "qwen3_5_moe:Qwen35MoeForCausalLM", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96, head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5), layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4), refuses=dict(packing_samples="transformers' Gated DeltaNet layers keep packed samples apart only with the flash-linear-attention and causal-conv1d kernels, which tidal neither requires nor tests")),
    Family("gpt_oss", "gpt_oss:GptOssForCausalLM", dict(tie_word_embeddings=False, head_dim=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=8, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0, truncate=False)), refuses=dict(tensor_parallel="the sinks, attention biases and interleaved, biased expert weights are not sharded across ranks", fp8_kv_cache=_SINKS_KV)),
    Family("gemma4_text", "gemma4:Gemma4ForCausalLM", dict(tie_word_embeddings=True, head_dim=32, global_head_dim=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, hidden_size_per_layer_input=16, vocab_size_per_layer_input=512, use_double_wide_mlp=True, final_logit_softcapping=30.0), tiny_adds_bos=True, chunkable_head=False, refuses=dict(tensor_parallel="the per-layer embeddings, the layer kinds' different head shapes and the KV-shared layers are not sharded across ranks", record_routing="router replay forces plain softmax top-k weights, not Gemma 4's router with per-expert scales", fp8_kv_cache=_GEMMA4_KV)),
)
# Vision-language families: the same records, kept apart from the text families' table (whose tiny
# models, parametrised engine tests and ``tidal.testing.TINY_FAMILIES`` are text-only); their tiny models
# are ``tidal.testing.build_tiny_vlm``'s. ``family``/``model_class``/``feature_refusal`` read both.
_VISION_FAMILIES = (
    Family("qwen2_5_vl", "qwen2_5_vl:Qwen25VLForConditionalGeneration", refuses=dict(tensor_parallel="the vision tower is not sharded across ranks")),
    Family("qwen3_vl", "qwen3_vl:Qwen3VLForConditionalGeneration", refuses=dict(tensor_parallel="the vision tower is not sharded across ranks")),
    Family("qwen3_5", "qwen3_5_vl:Qwen35VLForConditionalGeneration", refuses=dict(tensor_parallel="the vision tower is not sharded across ranks", packing_samples="transformers' Gated DeltaNet layers keep packed samples apart only with the flash-linear-attention and causal-conv1d kernels, which tidal neither requires nor tests")),
    Family("qwen3_5_moe", "qwen3_5_vl:Qwen35MoeVLForConditionalGeneration", refuses=dict(tensor_parallel="the vision tower is not sharded across ranks", packing_samples="transformers' Gated DeltaNet layers keep packed samples apart only with the flash-linear-attention and causal-conv1d kernels, which tidal neither requires nor tests")),
    Family("gemma3", "gemma3_vl:Gemma3VLForConditionalGeneration", chunkable_head=False, refuses=dict(tensor_parallel="the vision tower is not sharded across ranks", fp8_kv_cache=_SOFTCAP_KV, packing_samples="packed rows take tidal's per-sample causal masks, which transformers' Gemma 3 uses as given, dropping its bidirectional image attention (token_type_ids)")),
    Family("gemma4", "gemma4_vl:Gemma4VLForConditionalGeneration", chunkable_head=False, refuses=dict(tensor_parallel="the vision tower, the per-layer embeddings, the layer kinds' different head shapes and the KV-shared layers are not sharded across ranks", record_routing="router replay forces plain softmax top-k weights, not Gemma 4's router with per-expert scales", packing_samples="packed rows take tidal's per-sample causal masks, which transformers' Gemma 4 uses as given, dropping its bidirectional image attention (mm_token_type_ids)", fp8_kv_cache=_GEMMA4_KV)),
)
# fmt: on
FAMILIES: dict[str, Family] = {family.model_type: family for family in _FAMILIES}
VISION_FAMILIES: dict[str, Family] = {family.model_type: family for family in _VISION_FAMILIES}


def _entry(model_type: str | None) -> Family | None:
    """The text or vision-language family of ``model_type`` (looked up live, so tests may patch either)."""
    return FAMILIES.get(model_type) or VISION_FAMILIES.get(model_type)


# The engine features a family may refuse (``Family.refuses``), by the name the refusal gives:
# tensor_parallel (tp_size > 1), prefix_caching, chunked_prefill, record_routing (MoE router replay),
# fp8_kv_cache (``EngineConfig.kv_cache_dtype``), cuda_graphs and async_scheduling (refused ones fall back
# to eager / synchronous steps with a notice);
# and one of the trainer's, packing_samples (``tidal ppo --packing_samples``, refused before loading).
FEATURES = (
    "tensor_parallel",
    "prefix_caching",
    "chunked_prefill",
    "record_routing",
    "fp8_kv_cache",
    "cuda_graphs",
    "async_scheduling",
    "packing_samples",
)


def feature_refusal(model_type: str | None, feature: str) -> str | None:
    """Why the engine cannot run ``feature`` for ``model_type`` (None: it can, or the family is not in the
    registry, whose own error comes first)."""
    if feature not in FEATURES:
        raise ValueError(f"unknown engine feature {feature!r}; expected one of {', '.join(FEATURES)}")
    entry = _entry(model_type)
    reason = entry.refuses.get(feature) if entry is not None else None
    return f"{feature} is not supported for the {model_type} family: {reason}" if reason else None


class UnsupportedModelError(ValueError):
    """A checkpoint whose ``model_type`` the engine does not implement."""


def supported_model_types() -> tuple[str, ...]:
    """Every supported ``model_type``, sorted (as error messages list them)."""
    return tuple(sorted(FAMILIES))


def family(model_type: str | None, what: str = "the rollout engine") -> Family:
    """The registry entry of ``model_type``; an unsupported one raises naming it and the supported ones."""
    if _entry(model_type) is None:
        supported = ", ".join(supported_model_types() + tuple(sorted(VISION_FAMILIES)))
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} for {what}; supported: {supported}"
        )
    return _entry(model_type)


def model_class(model_type: str | None) -> type:
    """The engine's model class of ``model_type`` (a ``layers.CausalLM`` subclass)."""
    module, _, name = family(model_type).model_class.partition(":")
    return getattr(importlib.import_module(f"tidal.rollout.models.{module}"), name)


def chunkable_model_types() -> frozenset[str]:
    return frozenset(t for t, f in FAMILIES.items() if f.chunkable_head)
