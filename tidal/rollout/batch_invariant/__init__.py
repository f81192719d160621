"""Batch-invariant ops: each row's result is a function of that row alone (``--exact_logprobs``).

The rollout engine (flat tokens, paged KV cache, prefill and decode) and the trainer (a transformers model
over packed or padded rows) call these same functions in exact mode, so a token's log-prob is bit-identical
whichever side computes it, whatever else shares its batch, and whether it was a prefill or a decode token.
Elementwise mul/add/div are exactly rounded on every path (no fused multiply-add on torch's CPU kernels);
GEMMs, transcendental ops and reductions are not, and each module's docstring says what makes its ops
invariant (measured on CPU float32, torch 2.13 / MKL; ``tests/rollout/test_exact_logprobs.py`` checks
every one):

- ``matmul``: ``linear`` (every row through a GEMM of ``ROW_BLOCK`` rows), ``linear_parts`` (a packed
  projection's parts each as its own ``linear``);
- ``elementwise``: ``pointwise`` (transcendental ops on the vectorised path), ``rms_norm``, ``rope_cos_sin``;
- ``causal_attention``: ``attention`` (keys reduced in fixed blocks of ``KEY_BLOCK``);
- ``logprobs``: ``token_logprobs``;
- ``moe``: mixture-of-experts routing, experts and shared expert (``moe_route``, ``moe_experts``, ...);
- ``dispatch``: which tensors run the CUDA kernels, and their torch backward;
- ``support``: where exact mode runs (``exact_problem``, ``exact_device_problem``);
- ``hf_model``: ``make_exact``, the switch of a transformers model to these ops (where no gradient is
  recorded: the trainer's differentiable forward runs the default ops, ``exact_forward``), and its dtypes.

On CUDA (bf16 or fp32) cuBLAS and torch's reduction kernels choose their tiling from the batch's shape, so
``linear``, ``rms_norm``, ``attention`` and ``token_logprobs`` run Triton kernels with one fixed
configuration each (``tidal.rollout.kernels.triton_exact``: no split-K, K reduced in fixed blocks, fixed key
blocks from position 0); ``pointwise`` calls the op directly (a CUDA elementwise kernel computes every
element with the same code, so the CPU padding is not needed). The ops are differentiable there (the
trainer's policy loss runs them): the backward recomputes a plain torch formulation, which needs no
invariance. Dtypes: both sides compute in the engine's dtype (``make_exact``'s ``compute_dtype``; bf16 on
CUDA), the weights rounded once to it, with the engine's RoPE frequencies (``use_engine_numerics``), and
autocast must not re-cast inside the ops (``exact_autocast_off``). The CPU ops are invariant in bf16 too
(tested). Where exact mode runs: ``exact_device_problem``.

Every name is importable from this package (``from tidal.rollout import batch_invariant as bi``).
"""

from tidal.rollout.batch_invariant.causal_attention import KEY_BLOCK, attention
from tidal.rollout.batch_invariant.elementwise import POINT_BLOCK, pointwise, rms_norm, rope_cos_sin
from tidal.rollout.batch_invariant.hf_model import (
    EXACT_ATTENTION,
    SEGMENTS_KWARG,
    SegmentLayout,
    bound_forward,
    default_attention,
    engine_dtype,
    exact_autocast_off,
    exact_forward,
    hf_exact_attention,
    hf_exact_shared_moe,
    is_exact,
    make_exact,
    segment_layout,
    use_engine_numerics,
)
from tidal.rollout.batch_invariant.logprobs import token_logprobs
from tidal.rollout.batch_invariant.matmul import ROW_BLOCK, linear, linear_parts
from tidal.rollout.batch_invariant.moe import gate_column, moe_experts, moe_route, shared_expert_mix, tree_sum
from tidal.rollout.batch_invariant.support import (
    EXACT_CUDA_MODEL_TYPES,
    EXACT_MODEL_TYPES,
    exact_device_problem,
    exact_problem,
)

__all__ = [
    "EXACT_ATTENTION",
    "EXACT_CUDA_MODEL_TYPES",
    "EXACT_MODEL_TYPES",
    "KEY_BLOCK",
    "POINT_BLOCK",
    "ROW_BLOCK",
    "SEGMENTS_KWARG",
    "SegmentLayout",
    "attention",
    "bound_forward",
    "default_attention",
    "engine_dtype",
    "exact_autocast_off",
    "exact_device_problem",
    "exact_forward",
    "exact_problem",
    "gate_column",
    "hf_exact_attention",
    "hf_exact_shared_moe",
    "is_exact",
    "linear",
    "linear_parts",
    "make_exact",
    "moe_experts",
    "moe_route",
    "pointwise",
    "rms_norm",
    "rope_cos_sin",
    "segment_layout",
    "shared_expert_mix",
    "token_logprobs",
    "tree_sum",
    "use_engine_numerics",
]
