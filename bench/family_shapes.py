"""Random-init shapes of the 2025-2026 families the engine runs natively (issue #31), for the benchmarks.

Each entry is a HF ``model_type`` plus config fields, the released checkpoint's text shapes, so a benchmark
builds a model of that size without downloading one (``family_config``). Sources: the checkpoints' public
``config.json`` files and model cards, cross-checked against transformers' config classes (whose defaults
are Qwen3.5-9B's, Qwen3.5-35B-A3B's and gpt-oss-120b's) and THUDM/slime's ``scripts/models/qwen3.5-*.sh``.

- ``qwen3.5-0.8b``: Qwen3.5's smallest released text shape (24 layers, hidden 1024, 6 x (3 Gated DeltaNet
  + 1 gated attention); DeltaNet 16 QK / 16 V heads of 128; attention 8 query / 2 KV heads of 256, a
  quarter of each rotated; FFN 3584; vocab 248320, tied embeddings). ~0.75B text parameters.
- ``qwen3.5-9b``: 32 layers, hidden 4096, DeltaNet 16 QK / 32 V heads, attention 16 / 4 heads of 256,
  FFN 12288, untied. ~9B text parameters.
- ``qwen3.5-35b-a3b``: the MoE (``qwen3_5_moe_text``): 40 layers, hidden 2048, 256 experts of 512 top-8
  plus a gated shared expert of 512, DeltaNet 16 / 32 heads, attention 16 / 2 heads of 256. ~35B
  parameters, ~70 GB in bf16: fits one H200, but not twice (``bench/rollout.py`` moves the HF copy to
  host memory before the engine is built).
- ``gpt-oss-20b``: 24 layers, hidden 2880, 64 query / 8 KV heads of 64 with attention sinks, layers
  alternating 128-token sliding-window and full attention, 32 experts (intermediate 2880) top-4, vocab
  201088, YaRN RoPE. Random bf16 weights, not MXFP4: the released checkpoint's experts are MXFP4 (4.25
  bits a weight, which the engine dequantizes to bf16 on load), so a bf16 decode step reads ~3.8x the
  expert bytes of a kernel that kept them quantized; the roofline fraction is of the bf16 model.

The MTP head and the vision tower of the Qwen3.5 checkpoints are left out (text-only decoding).
"""

from __future__ import annotations

# Qwen3.5's gated full-attention layers rotate a quarter of each 256-wide head, theta 1e7.
_QWEN35_ROPE = dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25)
_QWEN35_COMMON = dict(
    vocab_size=248320, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, rms_norm_eps=1e-6, max_position_embeddings=262144,
    rope_parameters=_QWEN35_ROPE, bos_token_id=248044, eos_token_id=248044,
)  # fmt: skip

FAMILY_SHAPES: dict[str, dict] = {
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text", **_QWEN35_COMMON, hidden_size=1024, num_hidden_layers=24,
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=3584, linear_num_value_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3.5-9b": dict(
        model_type="qwen3_5_text", **_QWEN35_COMMON, hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, intermediate_size=12288, linear_num_value_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text", **_QWEN35_COMMON, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                             original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                             truncate=False),
        max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=199998, eos_token_id=200002,
        pad_token_id=199999,
    ),
}  # fmt: skip


def family_config(name: str, **overrides):
    """The transformers config object of ``FAMILY_SHAPES[name]`` (``overrides`` on top)."""
    from transformers import AutoConfig

    fields = dict(FAMILY_SHAPES[name], **overrides)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
