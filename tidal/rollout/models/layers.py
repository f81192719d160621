"""Shared building blocks of the rollout engine's models, and the base class every family file extends.

A family (``llama.py``, ``qwen2.py``, ...) is a ``CausalLM`` subclass that says only what differs from
the Llama shape: how its ``DecoderArgs`` are read from the HF config (``args_from_hf_config``), which
attention (``attention_cls``, e.g. q/k norms) and which layer skeleton (``layer_cls``, e.g. post-norm) it
uses, and how HF weight names map onto its parameters (``packed_params``, ``weight_renames``,
``ignored_weights``; see ``CausalLM``). The families supported are listed once, in ``registry.py``.

Parameter names mirror the HF names, except that projections that read the same input are packed into one
matrix (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``: fewer, larger matmuls); ``load_weights``
maps HF names (checkpoint files or ``named_parameters()`` of a trainer's model) onto those packed slices
(``weights.py``).
Layers are built from ``args.tp`` (``parallel.py``): with a tensor-parallel size above 1 each rank holds
its shard of the projections, embedding and LM head, and ``load_weights`` slices every full tensor to that
shard as it copies it; size 1 is the plain single-device model. Model code has no sampling logic. Every forward is flat-token: ``input_ids`` and
``positions`` are [num_tokens], and attention reads/writes the paged KV cache through ``AttentionMetadata``.

On CUDA with Triton, the element-wise work around the GEMMs runs as fused kernels, each bit-equal to the
torch ops it replaces: residual add + RMSNorm (``triton_norm.py``), SwiGLU and RoPE (+ Qwen3's q/k norms)
+ KV store (``triton_fused.py``; ``FUSED_KERNELS`` turns the latter two off); at decode, RoPE + KV store
run inside the decode attention kernel (``decode_fusable``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tidal.accel import triton_usable
from tidal.rollout.models.architecture import ACTIVATIONS as ACTIVATIONS
from tidal.rollout.models.architecture import sliding_windows as sliding_windows
from tidal.rollout.models.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    even_rows,
    head_rows,
    kv_heads_per_rank,
)
from tidal.rollout.models.rope import apply_rope, inv_freq_and_scale, rope_table
from tidal.rollout.models.weights import WeightLoading
from tidal.rollout.runner.attention import (
    AttentionMetadata,
    decode_attention,
    exact_attention,
    prefill_attention,
    store_kv,
)

# False: the decoder never runs ``triton_fused``'s kernels (SwiGLU; RoPE + KV store) and takes the torch
# ops instead (benchmarks compare the two; both give bit-equal results). Read at each forward, so set it
# before an engine captures its CUDA graphs. TIDAL_FUSED_KERNELS=0 in the environment starts it off.
FUSED_KERNELS = os.environ.get("TIDAL_FUSED_KERNELS", "1") != "0"
# Within those, decode steps also fold RoPE + KV store into the decode attention kernel (``decode_fusable``);
# False (TIDAL_FUSED_DECODE_ATTENTION=0) keeps them as two kernels, for benchmarks to compare.
FUSED_DECODE_ATTENTION = os.environ.get("TIDAL_FUSED_DECODE_ATTENTION", "1") != "0"


def fused_kernels_usable(x: torch.Tensor) -> bool:
    """``triton_fused``'s kernels run on ``x``: switched on, CUDA, Triton importable."""
    return FUSED_KERNELS and triton_usable(x)


def decode_fusable(qk: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a decode step's RoPE + KV store joins the Triton decode attention kernel (one launch, bit-equal
    to the two): switched on, a decode step on the Triton backend with a cache, and q/k heads that are the
    packed projection itself (no family transform such as Olmo2's or unfused Qwen3 norms produced them)."""
    return (
        FUSED_DECODE_ATTENTION
        and not meta.is_prefill
        and meta.backend == "triton"
        and meta.kv_cache is not None
        and qk.data_ptr() == qkv.data_ptr()
        and qk.stride() == (qkv.stride(0), qk.shape[-1], 1)
    )


def fusable_head_norm(head_dim: int) -> bool:
    """Whether ``triton_fused.rope_store_kv`` applies per-head RMSNorms bit-equal to ``triton_norm``.

    ``triton_norm`` sums a row's squares across 4 warps. When the row spans several warps (head_dim > 32)
    every lane reads one total from shared memory; within a single warp the butterfly's first step is a
    fused multiply-add that leaves lanes with totals differing in the last bit, and the fused kernel would
    normalise each rotate-half partner with its own lane's total instead of the partner lane's (measured
    on an H200: float32, head_dim 32 differs; 64 and 128 are bit-equal)."""
    return head_dim > 32


@dataclass
class DecoderArgs:
    """The shapes and switches a decoder is built from (read from a HF config by the family class)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_windows: list[int | None]
    # The engine process's tensor-parallel place (set by the loader, not read from the HF config).
    tp: TPGroup = field(default=SINGLE, repr=False, compare=False)

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and caches."""
        return kv_heads_per_rank(self.num_heads, self.num_kv_heads, self.tp.size)

    @property
    def kv_layers(self) -> int:
        """Layers with entries in the paged KV cache (a hybrid family's linear layers have none)."""
        return self.num_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config, **overrides) -> DecoderArgs:
        """The Llama reading of a HF config; a family passes ``overrides`` for what its config implies."""
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        num_heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        fields = dict(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            # A family may pass it (Qwen3.5-MoE configs have only ``moe_intermediate_size``).
            intermediate_size=overrides.get("intermediate_size") or config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=hidden_act,
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=sliding_windows(config),
        )
        return cls(**{**fields, **overrides})


FUSED_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the norm kernels take


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it.

    HF families round at different points: Llama-style norms round the normalised value to the model
    dtype and then scale by the weight (the default); ``scale_in_float32`` scales in float32 and rounds the
    product (OLMo-2, GPT-OSS; Gemma's subclass by ``1 + weight``: ``weight_offset``). On CUDA both run as
    one Triton kernel (``triton_norm``); the ``scale_in_float32`` one only while ``FUSED_KERNELS`` is on.
    """

    # Added to the weight by the float32 scaling (``GemmaRMSNorm``: checkpoints store ``weight - 1``).
    weight_offset: ClassVar[float] = 0.0
    # FP8 rollouts (``quant.linear``): the norm's output is read by an FP8 linear layer, so the Triton norm
    # also quantizes it per row, in its own launch, and leaves the e4m3 rows on the output (``fp8_rows``),
    # where that layer takes them instead of quantizing again.
    feeds_fp8: bool = False

    def __init__(self, dim: int, eps: float, scale_in_float32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scale_in_float32 = scale_in_float32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Norm of ``x``, or with ``residual``: (norm of ``x + residual``, ``x + residual``)."""
        if self._fusable(x, residual):  # one kernel instead of ~8 (decode is launch-bound)
            from tidal.rollout.models.triton_norm import add_rms_norm, add_rms_norm_fp8

            offset = self.weight_offset if self.scale_in_float32 else None
            if self.feeds_fp8 and x.dim() == 2 and fused_kernels_usable(x):
                normed, total, rows = add_rms_norm_fp8(x, self.weight, self.eps, residual, offset)
                normed.fp8_rows = rows  # (e4m3 rows, scales): what the FP8 layer would compute from normed
            else:
                normed, total = add_rms_norm(x, self.weight, self.eps, residual, offset)
            return normed if residual is None else (normed, total)
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """``triton_norm`` computes it: CUDA with Triton; the float32-scaled kind also needs ``FUSED_KERNELS``
        (benchmarks compare it with torch), 16/32-bit floats, a residual of ``x``'s dtype (the kernel rounds
        the sum to it). Exact mode replaces ``forward`` altogether (``runner/exact_model.py``)."""
        if not self.scale_in_float32:
            return triton_usable(x)
        one_dtype = residual is None or residual.dtype == x.dtype
        return fused_kernels_usable(x) and one_dtype and x.dtype in FUSED_NORM_DTYPES

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the HF reference, then scale where the family's reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.scale_in_float32:
            return (self.weight * x32).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """RoPE cos/sin tables [max_model_len, head_dim] in float32, as non-persistent buffers: they follow
    the model's ``.to(device)`` (sleep / wake-up) but are neither weights nor part of a state dict."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos", None, persistent=False)
        self.register_buffer("sin", None, persistent=False)

    def build(self, hf_config, head_dim: int, max_model_len: int, device: torch.device) -> None:
        inv_freq, scale = inv_freq_and_scale(hf_config, head_dim, max_model_len)
        self.inv_freq, self.scale = inv_freq, scale  # kept for exact mode (batch_invariant.rope_cos_sin)
        cos, sin = rope_table(inv_freq, scale, max_model_len)
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at ``positions``, in the activations' dtype."""
        return self.cos.index_select(0, positions).to(dtype), self.sin.index_select(0, positions).to(dtype)


def paged_attention(
    q, k, v, meta: AttentionMetadata, layer_idx: int, window: int | None, scale: float, stored: bool = False
):
    """Store this step's k/v into the layer's paged cache (unless ``stored``: a fused kernel did), then
    attend (prefill: over the batch's own tokens; decode: over the cache). q [tokens, heads, d], k/v
    [tokens, kv_heads, d] -> [tokens, heads*d]."""
    layer_cache = None if meta.kv_cache is None else meta.kv_cache[layer_idx]
    scales = meta.layer_scales(layer_idx)  # an FP8 cache's (runner/kv_cache.py)
    if layer_cache is not None and not stored:
        store_kv(layer_cache, k, v, meta.slot_mapping, scales)
    if meta.exact:
        return exact_attention(q, k, v, meta, layer_cache, window, scale)
    if meta.is_prefill:
        return prefill_attention(q, k, v, meta, window, scale, layer_cache, scales)
    return decode_attention(q, layer_cache, meta, window, scale, scales)


class Attention(nn.Module):
    """Llama attention: packed q/k/v projection, RoPE, paged attention, output projection.

    Families with q/k normalisation override ``qk_heads``. ``num_heads`` / ``num_kv_heads`` are this
    rank's (all of them without tensor parallelism)."""

    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        q_rows, kv_rows = head_rows(args.num_heads, args.num_kv_heads, args.head_dim, args.tp)
        self.head_dim = args.head_dim
        self.num_heads, self.num_kv_heads = q_rows.size // args.head_dim, kv_rows.size // args.head_dim
        self.window = args.sliding_windows[layer_idx]
        self.scale = args.head_dim**-0.5
        self.split = [q_rows.size, kv_rows.size, kv_rows.size]
        self.qkv_proj = ColumnParallelLinear(args.hidden_size, (q_rows, kv_rows, kv_rows), bias=args.qkv_bias)
        self.o_proj = RowParallelLinear(q_rows, args.hidden_size, bias=args.o_bias, tp=args.tp)

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The q and k heads of the packed projection, [tokens, heads + kv_heads, head_dim], before RoPE."""
        return qkv[:, : self.split[0] + self.split[1]].view(
            -1, self.num_heads + self.num_kv_heads, self.head_dim
        )

    def fused_qk_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, tuple[RMSNorm, RMSNorm] | None]:
        """What ``triton_fused.rope_store_kv`` reads: the q/k heads before RoPE and the per-head
        (q, k) RMSNorms it applies first (None: the heads are taken as ``qk_heads`` gives them)."""
        return self.qk_heads(qkv), None

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        v = qkv[:, self.split[0] + self.split[1] :].view(-1, self.num_kv_heads, self.head_dim)
        # The kernel rounds RoPE's products to the activations' dtype, as torch does when cos/sin share it.
        if fused_kernels_usable(qkv) and cos.dtype == qkv.dtype:
            qk, norms = self.fused_qk_heads(qkv)
            if norms is None and not meta.exact and decode_fusable(qk, qkv, meta):
                return self.o_proj(self._fused_decode(qkv, cos, sin, meta))
            # Exact mode: fused RoPE + KV store (torch's bits), not fused q/k norms (``triton_norm``'s sums)
            if norms is None or not meta.exact:
                q, k = self._fused_rope_store(qk, norms, v, cos, sin, meta)
                out = paged_attention(q, k, v, meta, self.layer_idx, self.window, self.scale, stored=True)
                return self.o_proj(out)
        # Rotating q and k heads together halves the (launch-bound) RoPE ops.
        qk = apply_rope(self.qk_heads(qkv), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj(paged_attention(q, k, v, meta, self.layer_idx, self.window, self.scale))

    def _fused_rope_store(self, qk, norms, v, cos, sin, meta: AttentionMetadata):
        """(q, k) after norms and RoPE, k/v already in the layer's cache: one kernel (``triton_fused``)."""
        from tidal.rollout.models.triton_fused import rope_store_kv

        layer_cache = None if meta.kv_cache is None else meta.kv_cache[self.layer_idx]
        weights, eps = (None, 0.0) if norms is None else ((norms[0].weight, norms[1].weight), norms[0].eps)
        return rope_store_kv(
            qk, v, cos, sin, self.num_heads, layer_cache, meta.slot_mapping, weights, eps,
            meta.layer_scales(self.layer_idx),
        )  # fmt: skip

    def _fused_decode(self, qkv, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """RoPE, the KV store and paged decode attention in one kernel (``triton_attention``)."""
        from tidal.rollout.kernels.triton_attention import RopeInputs, paged_decode_attention

        heads = qkv.view(qkv.shape[0], -1, self.head_dim)  # q, then k, then v heads
        layer_cache = meta.kv_cache[self.layer_idx]
        rope = RopeInputs(cos, sin, meta.slot_mapping)
        return paged_decode_attention(
            heads, layer_cache, meta.block_tables, meta.context_lens, self.window, self.scale, rope=rope,
            kv_scales=meta.layer_scales(self.layer_idx),
        )  # fmt: skip


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up packed into one ``gate_up_proj``."""

    def __init__(self, args: DecoderArgs):
        super().__init__()
        rows = even_rows(args.intermediate_size, args.tp, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(args.hidden_size, (rows, rows), bias=args.mlp_bias)
        self.down_proj = RowParallelLinear(rows, args.hidden_size, bias=args.mlp_bias, tp=args.tp)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu and fused_kernels_usable(gate_up):
            from tidal.rollout.models.triton_fused import silu_and_mul, silu_and_mul_fp8

            if getattr(self.down_proj, "fp8_row_input", False):  # FP8 rollouts: quantized in the same launch
                out, rows = silu_and_mul_fp8(gate_up)
                out.fp8_rows = rows  # as RMSNorm leaves them for its FP8 reader
                return self.down_proj(out)
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm layer (Llama): x + attn(norm(x)), then + mlp(norm(.)).

    Layers pass ``(x, residual)`` whose sum is the hidden state, so each residual add is fused into the
    next norm (the first layer has no pending add, and the final norm takes the last layer's)."""

    # FP8 rollouts: (norm, the linear layers that read its output first), for ``RMSNorm.feeds_fp8``;
    # ``quant.linear`` marks the norms whose reader is an FP8 linear layer (paths a layer lacks are skipped).
    fp8_feeds: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = (
        ("input_layernorm", ("self_attn.qkv_proj",)),
        ("post_attention_layernorm", ("mlp.gate_up_proj",)),
    )

    def __init__(self, args: DecoderArgs, layer_idx: int, attention_cls: type[Attention] = Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = attention_cls(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs, layer_cls: type[DecoderLayer], attention_cls: type[Attention]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, args.tp)
        self.layers = nn.ModuleList(layer_cls(args, i, attention_cls) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(WeightLoading, nn.Module):
    """Base of every family: embeddings, decoder layers, final norm, LM head, and the weight loader
    (``weights.WeightLoading``).

    Returns logits of the selected rows (``logits_index``: each sequence's last prefill token) or of every
    row. What a family declares, as class attributes:

    - ``attention_cls`` / ``layer_cls``: its attention and layer skeleton;
    - ``packed_params``: packed parameter -> the HF projections stacked into it, in order, each with the
      ``DecoderArgs`` attribute giving its rows (the loader copies each HF tensor into its slice);
    - ``weight_renames``: (HF substring, ours) pairs applied to every HF name first;
    - ``ignored_weights``: HF name suffixes that are not weights of ours (e.g. RoPE frequencies);
    - ``supports_tp``: whether its layers shard for a tensor-parallel engine (``parallel.py``).
    """

    attention_cls: ClassVar[type[Attention]] = Attention
    layer_cls: ClassVar[type[DecoderLayer]] = DecoderLayer
    packed_params: ClassVar[dict[str, tuple[tuple[str, str], ...]]] = {
        "qkv_proj": (("q_proj", "q_size"), ("k_proj", "kv_size"), ("v_proj", "kv_size")),
        "gate_up_proj": (("gate_proj", "intermediate_size"), ("up_proj", "intermediate_size")),
    }
    weight_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    supports_tp: ClassVar[bool] = True

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args, self.layer_cls, self.attention_cls)
        self.lm_head = ParallelLMHead(args.hidden_size, args.vocab_size, args.tp)
        self.rotary = Rotary()
        self.tie_weights()

    @classmethod
    def args_from_hf_config(cls, config) -> DecoderArgs:
        return DecoderArgs.from_hf_config(config)

    def state_spec(self):
        """The per-sequence recurrent state of the family's linear-attention layers
        (``state_cache.StateSpec``), None for attention-only families."""
        return None

    def tie_weights(self) -> None:
        """Share the output projection with the input embedding; re-run after ``to_empty`` / ``to``."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """Build the RoPE tables for positions [0, max_model_len) on the model's device."""
        self.rotary.build(hf_config, self.args.head_dim, max_model_len, self.model.embed_tokens.weight.device)

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        """The (cos, sin) that the layers receive. A family whose rotation depends on more than the position
        (LongRoPE: on the sequence's length) or differs per layer (Gemma 3) overrides this."""
        return self.rotary(positions, dtype)

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_index=None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, meta, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        if logits_index is not None:  # prefill needs logits of each sequence's last token only
            x, residual = x[logits_index], residual[logits_index]
        return self.lm_head(self.model.norm(x, residual)[0])
