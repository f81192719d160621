"""Qwen3.5 text (``model_type`` "qwen3_5_text"): a hybrid of Gated DeltaNet linear attention and gated
full attention (transformers' ``modeling_qwen3_5.py`` is the reference for every fact below).

``layer_types`` lists each layer's token mixer, typically three ``linear_attention`` layers per
``full_attention`` one; every layer then has the usual gated MLP. What differs from ``layers.py``:

- every RMSNorm (input, post-attention, final, q/k head norms) scales by ``1 + weight`` in float32
  (``GemmaRMSNorm``);
- full attention: ``q_proj`` yields, per head, the query then a gate of the same size; the attention
  output is multiplied by ``sigmoid(gate)`` before ``o_proj``. q/k are RMS-normalised per head and RoPE
  rotates only the first ``partial_rotary_factor * head_dim`` channels of each head;
- linear attention (``GatedDeltaNet``): ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
  (packed into one ``in_proj`` here), a depthwise causal conv1d + SiLU over the q/k/v channels,
  ``beta = sigmoid(b)``, per-head decay ``g = -exp(A_log) * softplus(a + dt_bias)``, the gated delta rule
  over l2-normalised q/k (``gated_delta.py``), an RMSNorm per value head gated by ``silu(z)``
  (``GatedRMSNorm``, plain weight), ``out_proj``.

The full-attention layers use the paged KV cache (only they have entries in it: ``kv_layers``); the
linear layers keep a per-sequence state (``state_cache.py``) read at the step's state slots
(``AttentionMetadata.state_slots``) and written there or, for a decode step with double-buffered states
(async scheduling), at ``state_write_slots``. A prefill chunk continues the state its sequence's earlier
chunks left. Decode is a fixed sequence of index ops: it runs under the engine's CUDA graphs; on CUDA its
delta rule is one fused Triton launch per layer that indexes the state slots itself
(``kernels/gated_delta_decode.py``, ``gated_delta.decode_path``).

Tensor parallelism (``parallel.py``): the full-attention layers split their q heads (each with its gate)
and KV heads as Qwen3's do. A linear layer's rank keeps ``1 / tp`` of the key heads and the value heads
grouped with them (``LinearRows``: its rows of ``in_proj_qkv``'s q, k and v channels, of ``in_proj_z``,
``in_proj_b``, ``in_proj_a`` and of the convolution, its heads' ``A_log`` / ``dt_bias``), runs the rule
and the per-head gated norm on them with no communication, and ``out_proj`` (row-parallel) all-reduces;
its state cache holds only its heads (``state_spec``). The slots travel with the step records from rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.rollout.models import layers
from tidal.rollout.models.gated_delta import causal_conv, decode_path, gated_delta_rule
from tidal.rollout.models.gemma2 import GemmaRMSNorm
from tidal.rollout.models.layers import CausalLM, DecoderArgs, GatedMLP, paged_attention
from tidal.rollout.models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    Rows,
    TPGroup,
    even_rows,
    head_rows,
    joined_rows,
    take_rows,
)
from tidal.rollout.models.rope import apply_rope, rope_parameters, rope_table
from tidal.rollout.runner.attention import AttentionMetadata
from tidal.rollout.scheduling.state_cache import StateSpec

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass
class Qwen35Args(DecoderArgs):
    """``DecoderArgs`` plus the layer kinds, the rotary width and the linear-attention shapes."""

    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_width: int = 0

    @property
    def q_gate_size(self) -> int:  # q_proj's rows: each head's query and gate
        return 2 * self.num_heads * self.head_dim

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_k_heads * self.linear_k_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_v_heads * self.linear_v_dim

    @property
    def conv_channels(self) -> int:  # q, k and v of in_proj_qkv
        return 2 * self.linear_key_size + self.linear_value_size

    @property
    def kv_layers(self) -> int:
        return sum(kind == FULL for kind in self.layer_types)

    @property
    def head_split_sizes(self) -> dict[str, int]:
        """The linear-attention head counts a tensor-parallel engine splits, by config field (each rank
        keeps ``1 / tp`` of the key heads and the value heads grouped with them)."""
        return {
            "linear_num_key_heads": self.linear_num_k_heads,
            "linear_num_value_heads": self.linear_num_v_heads,
        }

    def linear_rows(self) -> LinearRows:
        """This rank's rows of the linear-attention layers' projections (``LinearRows``)."""
        return LinearRows.of(self, self.tp)


@dataclass(frozen=True)
class LinearRows:
    """A rank's share of a Gated DeltaNet layer under tensor parallelism: ``key`` / ``value`` rows of the
    q or k channels and of the v channels (its key heads and the value heads grouped with them, so the
    grouping stays within the rank), ``qkv`` the three joined (``in_proj_qkv``, the conv channels) and
    ``heads`` its value heads (``in_proj_b`` / ``in_proj_a``, ``A_log``, ``dt_bias``)."""

    key: Rows
    value: Rows
    qkv: Rows
    heads: Rows

    @classmethod
    def of(cls, args: Qwen35Args, tp: TPGroup) -> LinearRows:
        k_heads = even_rows(args.linear_num_k_heads, tp, "linear_num_key_heads")
        v_heads = even_rows(args.linear_num_v_heads, tp, "linear_num_value_heads")
        key, value = _scaled(k_heads, args.linear_k_dim), _scaled(v_heads, args.linear_v_dim)
        return cls(key, value, joined_rows(key, key, value), v_heads)


def _scaled(heads: Rows, dim: int) -> Rows:
    """The channel rows of ``heads`` of ``dim`` channels each."""
    return Rows(heads.full * dim, heads.start * dim, heads.length * dim, heads.size * dim)


def qwen35_args(config, **overrides) -> Qwen35Args:
    """Read a Qwen3.5 text config (``overrides``: what a variant's config implies); refuse, in one line,
    what the engine does not implement."""
    params = rope_parameters(config)
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"qwen3_5_text with rope_type {params['rope_type']!r} is not supported (default only)"
        )
    layer_types = tuple(config.layer_types)
    unknown = sorted(set(layer_types) - {LINEAR, FULL})
    if unknown:
        raise ValueError(f"qwen3_5_text layer_types {unknown} are not supported; expected {LINEAR}/{FULL}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Qwen35Args.from_hf_config(
        config,
        sliding_windows=[None] * config.num_hidden_layers,
        layer_types=layer_types,
        rotary_dim=int(head_dim * params.get("partial_rotary_factor", 1.0)),
        linear_num_k_heads=config.linear_num_key_heads,
        linear_num_v_heads=config.linear_num_value_heads,
        linear_k_dim=config.linear_key_head_dim,
        linear_v_dim=config.linear_value_head_dim,
        conv_width=config.linear_conv_kernel_dim,
        **overrides,
    )


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` channels of each head; the rest pass unchanged."""
    dim = cos.shape[-1]
    return torch.cat((apply_rope(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate, q/k head norms and partial RoPE."""

    def __init__(self, args: Qwen35Args, layer_idx: int):
        super().__init__()
        self.kv_index = args.layer_types[:layer_idx].count(FULL)  # its layer in the KV cache
        # Tensor parallelism: the rank's q heads (each with its gate: q_proj's rows are per head query then
        # gate, so a head's rows are 2 * head_dim consecutive ones) and the KV heads they read, as Qwen3's.
        q_rows, kv_rows = head_rows(args.num_heads, args.num_kv_heads, args.head_dim, args.tp)
        q_gate_rows = Rows(2 * q_rows.full, 2 * q_rows.start, 2 * q_rows.length, 2 * q_rows.size)
        self.head_dim = args.head_dim
        self.num_heads, self.num_kv_heads = q_rows.size // args.head_dim, kv_rows.size // args.head_dim
        self.scale = args.head_dim**-0.5
        parts = (q_gate_rows, kv_rows, kv_rows)
        self.split = [part.size for part in parts]
        self.qkv_proj = ColumnParallelLinear(args.hidden_size, parts, bias=args.qkv_bias)
        self.o_proj = RowParallelLinear(q_rows, args.hidden_size, bias=args.o_bias, tp=args.tp)
        self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q_gate = q_gate.view(tokens, self.num_heads, 2, self.head_dim)
        q, gate = q_gate[:, :, 0], q_gate[:, :, 1].reshape(tokens, -1)
        q = partial_rope(self.q_norm(q), cos, sin)
        k = partial_rope(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)), cos, sin)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, meta, self.kv_index, None, self.scale)
        return self.o_proj(out * self.output_gate(gate))

    def output_gate(self, gate: torch.Tensor) -> torch.Tensor:
        """The factor on each attention output channel: ``sigmoid`` of its gate."""
        return torch.sigmoid(gate)


def fusable(x: torch.Tensor) -> bool:
    """Whether ``triton_gated_norm``'s kernels run on ``x``: ``layers.fused_kernels_usable`` (the switch,
    CUDA, Triton), 16/32-bit floats. Qwen3.5 has no exact mode (``batch_invariant.exact_problem``)."""
    return layers.fused_kernels_usable(x) and x.dtype in layers.FUSED_NORM_DTYPES


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head (plain weight), times ``silu(z)`` in float32, as transformers rounds it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if fusable(x):  # one kernel instead of ~10 (triton_gated_norm)
            from tidal.rollout.models.triton_gated_norm import gated_rms_norm

            return gated_rms_norm(x, z, self.weight, self.eps)
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class ShardedConv1d(nn.Conv1d):
    """The depthwise causal convolution over the rank's channels (``rows``; all of them without TP)."""

    def __init__(self, rows: Rows, width: int):
        super().__init__(rows.size, rows.size, width, groups=rows.size, bias=False)
        self.rows = rows

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        return take_rows(self.rows, param, tensor, name)


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule, with its per-sequence conv and recurrent state.

    Under tensor parallelism (``LinearRows``) each rank runs its key heads and their value heads: its rows
    of ``in_proj`` (q, k, v channels, z, b, a) and of the convolution, its heads' ``A_log`` / ``dt_bias``
    and states, the per-head norm unchanged (no reduction); ``out_proj`` sums the ranks' partial outputs."""

    def __init__(self, args: Qwen35Args, layer_idx: int):
        super().__init__()
        self.state_index = args.layer_types[:layer_idx].count(LINEAR)  # its layer in the state cache
        rows = args.linear_rows()
        self.heads = rows.heads
        self.k_heads = rows.key.size // args.linear_k_dim  # this rank's
        self.v_heads = rows.heads.size
        self.k_dim, self.v_dim = args.linear_k_dim, args.linear_v_dim
        parts = (rows.qkv, rows.value, rows.heads, rows.heads)  # qkv, z, b, a
        self.split = [part.size for part in parts]
        self.in_proj = ColumnParallelLinear(args.hidden_size, parts, bias=False)
        self.conv1d = ShardedConv1d(rows.qkv, args.conv_width)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, args.rms_norm_eps)
        self.out_proj = RowParallelLinear(rows.value, args.hidden_size, bias=False, tp=args.tp)

    def take(self, param: torch.Tensor, kind: str, part: int | None, tensor: torch.Tensor, name: str):
        """The rank's value heads of ``A_log`` / ``dt_bias`` (the loader's hook for sharded weights)."""
        return take_rows(self.heads, param, tensor, name)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        g, beta = self.decay_and_beta(a, b)
        run = self._prefill if meta.is_prefill else self._decode
        out = run(qkv, g, beta, meta)  # [tokens, v_heads, v_dim]
        out = self.norm(out, z.view(out.shape))
        return self.out_proj(out.reshape(x.shape[0], -1))

    def decay_and_beta(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta = sigmoid(b)``."""
        if fusable(b):  # one kernel instead of ~6
            from tidal.rollout.models.triton_gated_norm import decay_and_beta

            return decay_and_beta(a, b, self.A_log, self.dt_bias)
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid()

    def _heads(self, conv_out: torch.Tensor):
        """q, k [batch, T, k_heads, k_dim] and v [batch, T, v_heads, v_dim] of conv outputs [batch, T, C]
        (the rank's heads)."""
        key = self.k_heads * self.k_dim
        q, k, v = conv_out.split([key, key, self.v_heads * self.v_dim], dim=-1)
        batch, length = conv_out.shape[:2]
        return (
            q.reshape(batch, length, self.k_heads, self.k_dim),
            k.reshape(batch, length, self.k_heads, self.k_dim),
            v.reshape(batch, length, self.v_heads, self.v_dim),
        )

    def _prefill(self, qkv, g, beta, meta: AttentionMetadata) -> torch.Tensor:
        """Each sequence's tokens (right-padded to one batch), from its state after earlier chunks (a
        chunked prefill's later chunks) or from zeros; its state after its last token is stored."""
        idx, valid = meta.pad_index, meta.pad_valid
        states, slots = meta.states, meta.state_slots
        history = self.conv1d.weight.shape[-1] - 1
        batch = idx.shape[0]
        zeros_conv = qkv.new_zeros(batch, qkv.shape[-1], history)
        conv_state, rec_state = zeros_conv, None
        if states is not None and meta.query_starts is not None:  # a later chunk reads what came before
            going_on = meta.query_starts > 0
            stored = states.conv[self.state_index].index_select(0, slots)
            conv_state = torch.where(going_on[:, None, None], stored, zeros_conv)
            stored = states.recurrent[self.state_index].index_select(0, slots)
            rec_state = torch.where(going_on[:, None, None, None], stored, torch.zeros_like(stored))
        full = torch.cat((conv_state, qkv[idx].transpose(1, 2)), dim=-1)  # [batch, C, history + T]
        conv_out = causal_conv(full[..., history:], full[..., :history], self.conv1d.weight)
        q, k, v = self._heads(conv_out.transpose(1, 2))
        # Padding positions neither decay nor write the state, so it ends at each sequence's last token.
        keep = valid[..., None]
        g, beta = torch.where(keep, g[idx], 0.0), torch.where(keep, beta[idx], 0.0)
        out, final = gated_delta_rule(q, k, v, g, beta, rec_state)
        if states is not None:
            ends = valid.sum(1)[:, None] + torch.arange(history, device=idx.device)[None, :]
            last = full.gather(2, ends[:, None, :].expand(-1, full.shape[1], -1))  # last `history` inputs
            states.conv[self.state_index].index_copy_(0, slots, last.to(states.conv.dtype))
            states.recurrent[self.state_index].index_copy_(0, slots, final)
        return out[valid]

    def _decode(self, qkv, g, beta, meta: AttentionMetadata) -> torch.Tensor:
        """One token per row, continuing the state each row reads at ``state_slots`` and storing the new
        one at ``state_write_slots`` (double buffering; in place when None). Fixed shapes and index ops
        only, so a CUDA graph captures it; padding rows read and write the scratch slot."""
        states, slots = meta.states, meta.state_slots
        writes = slots if meta.state_write_slots is None else meta.state_write_slots
        conv, recurrent = states.conv[self.state_index], states.recurrent[self.state_index]
        if decode_path(qkv) == "triton":  # two fused launches: each state read and written once
            from tidal.rollout.kernels.gated_delta_decode import causal_conv_decode, gated_delta_decode

            mixed = causal_conv_decode(qkv, conv, self.conv1d.weight, slots, writes)
            return gated_delta_decode(mixed, g, beta, recurrent, slots, writes, self.k_heads)
        window = torch.cat((conv.index_select(0, slots), qkv[:, :, None]), dim=-1)
        conv_out = causal_conv(window[..., -1:], window[..., :-1], self.conv1d.weight)
        conv.index_copy_(0, writes, window[..., 1:])
        q, k, v = self._heads(conv_out.transpose(1, 2))
        init = recurrent.index_select(0, slots)
        out, final = gated_delta_rule(q, k, v, g[:, None], beta[:, None], init, recurrent=True)
        recurrent.index_copy_(0, writes, final)
        return out[:, 0]


class Qwen35DecoderLayer(nn.Module):
    """Pre-norm layer: x + mixer(norm(x)), then + mlp(norm(.)); the mixer is linear or full attention."""

    fp8_feeds = (  # ``layers.DecoderLayer.fp8_feeds``: each layer has one of the two mixers
        ("input_layernorm", ("self_attn.qkv_proj", "linear_attn.in_proj")),
        ("post_attention_layernorm", ("mlp.gate_up_proj",)),
    )

    def __init__(self, args: Qwen35Args, layer_idx: int, attention_cls=None):
        # ``attention_cls``: what ``DecoderModel`` passes every layer class; the mixers here are fixed.
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.layer_types[layer_idx] == LINEAR:
            self.linear_attn = GatedDeltaNet(args, layer_idx)
        else:
            self.self_attn = GatedAttention(args, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = mixer(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen35ForCausalLM(CausalLM):
    layer_cls = Qwen35DecoderLayer
    packed_params = {
        "qkv_proj": (("q_proj", "q_gate_size"), ("k_proj", "kv_size"), ("v_proj", "kv_size")),
        "gate_up_proj": (("gate_proj", "intermediate_size"), ("up_proj", "intermediate_size")),
        "in_proj": (
            ("in_proj_qkv", "conv_channels"),
            ("in_proj_z", "linear_value_size"),
            ("in_proj_b", "linear_num_v_heads"),
            ("in_proj_a", "linear_num_v_heads"),
        ),
    }
    ignored_weights = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")

    def __init__(self, args: Qwen35Args):
        super().__init__(args)
        self.model.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps)

    @classmethod
    def args_from_hf_config(cls, config) -> Qwen35Args:
        return qwen35_args(config)

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """RoPE tables over the rotated channels only (``rotary_dim``), default RoPE (``qwen35_args``)."""
        dim, base = self.args.rotary_dim, rope_parameters(hf_config)["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        cos, sin = rope_table(inv_freq, 1.0, max_model_len)
        device = self.model.embed_tokens.weight.device
        self.rotary.inv_freq, self.rotary.scale = inv_freq, 1.0
        self.rotary.cos, self.rotary.sin = cos.to(device), sin.to(device)

    def state_spec(self) -> StateSpec:
        """The state of this rank's heads (all of them without tensor parallelism)."""
        a, rows = self.args, self.args.linear_rows()
        return StateSpec(
            num_layers=a.layer_types.count(LINEAR),
            conv_channels=rows.qkv.size,
            conv_history=a.conv_width - 1,
            num_heads=rows.heads.size,
            k_dim=a.linear_k_dim,
            v_dim=a.linear_v_dim,
        )
