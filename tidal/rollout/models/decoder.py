"""The rollout engine's one decoder: Llama / Mistral / Qwen2 / Qwen3 from their HF checkpoints.

The four families differ only in a few switches read from the HF config: q/k/v bias (Qwen2, or
``attention_bias``), per-head RMSNorm on q and k (Qwen3), tied input/output embeddings, ``head_dim``,
sliding-window layers and the RoPE variant. Parameter names mirror the HF names, except that q/k/v
projections are fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (fewer, larger matmuls);
``load_weights`` maps HF names (checkpoint files or ``named_parameters()`` of a trainer's model) onto
those fused slices. Model code is single-device and has no sampling logic.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tidal.accel import triton_usable
from tidal.rollout.attention import AttentionMetadata, decode_attention, prefill_attention, store_kv
from tidal.rollout.models.rope import apply_rope, inv_freq_and_scale, rope_table

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# HF projection name -> (our fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_NAME_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


@dataclass
class DecoderArgs:
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
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: list[int | None]

    @classmethod
    def from_hf_config(cls, config) -> DecoderArgs:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} for the rollout engine; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {', '.join(_ACTIVATIONS)}")
        num_heads = config.num_attention_heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=hidden_act,
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(config),
        )


def _sliding_windows(config) -> list[int | None]:
    """Per-layer window: Qwen-style configs list ``layer_types``; Mistral applies one window everywhere."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    return [window] * config.num_hidden_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Norm of ``x``, or with ``residual``: (norm of ``x + residual``, ``x + residual``)."""
        if triton_usable(x):  # one fused kernel instead of ~8 (decode is launch-bound)
            from tidal.rollout.models.triton_norm import add_rms_norm

            normed, total = add_rms_norm(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, total)
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the HF reference, then scale in the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.window = args.sliding_windows[layer_idx]
        self.scale = args.head_dim**-0.5
        self.split = [
            args.num_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
            args.num_kv_heads * args.head_dim,
        ]
        self.qkv_proj = nn.Linear(args.hidden_size, sum(self.split), bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        self.qk_norm = args.qk_norm
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        num_q = self.split[0]
        qk = qkv[:, : num_q + self.split[1]].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # Rotating q and k heads together halves the (launch-bound) RoPE ops.
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, num_q + self.split[1] :].view(-1, self.num_kv_heads, self.head_dim)
        layer_cache = None if meta.kv_cache is None else meta.kv_cache[self.layer_idx]
        if layer_cache is not None:
            store_kv(layer_cache, k, v, meta.slot_mapping)
        if meta.is_prefill:
            out = prefill_attention(q, k, v, meta, self.window, self.scale)
        else:
            out = decode_attention(q, layer_cache, meta, self.window, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.act = _ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: DecoderArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, residual, cos, sin, meta: AttentionMetadata):
        """(x, residual) -> (mlp output, residual stream): each residual add is fused into the next norm
        (the first layer has no pending add, and the final norm takes the last layer's)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """Flat-token forward: ``input_ids``/``positions`` are [num_tokens]; returns logits of selected rows."""

    def __init__(self, args: DecoderArgs):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        self.rope_cos = self.rope_sin = None

    def tie_weights(self) -> None:
        """Share the output projection with the input embedding; re-run after ``to_empty`` / ``to``."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """Build the float32 cos/sin table for positions [0, max_model_len) on the model's device."""
        inv_freq, scale = inv_freq_and_scale(hf_config, self.args.head_dim, max_model_len)
        cos, sin = rope_table(inv_freq, scale, max_model_len)
        device = self.model.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_index=None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos.index_select(0, positions).to(x.dtype)
        sin = self.rope_sin.index_select(0, positions).to(x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        if logits_index is not None:  # prefill needs logits of each sequence's last token only
            x, residual = x[logits_index], residual[logits_index]
        return self.lm_head(self.model.norm(x, residual)[0])

    def weight_keys(self) -> set[str]:
        """Every (fused-shard) weight a full checkpoint must provide, in ``load_weights``' key format."""
        keys = set()
        for name, _ in self.named_parameters():
            module = name.rsplit(".", 2)[-2]
            shards = {"qkv_proj": 3, "gate_up_proj": 2}.get(module)
            keys.update([name] if shards is None else [f"{name}#{i}" for i in range(shards)])
        return keys

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused) parameters in place; return the keys loaded."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for raw_name, tensor in named_tensors:
            name = _normalize_name(raw_name)
            if name.endswith("rotary_emb.inv_freq"):
                continue
            module_name, _, kind = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            shard = None
            if leaf in _STACKED:
                leaf, shard = _STACKED[leaf]
            target = f"{parent}.{leaf}.{kind}" if parent else f"{leaf}.{kind}"
            if self.args.tie_word_embeddings and target == "lm_head.weight":
                target = "model.embed_tokens.weight"
            if target not in params:
                raise ValueError(f"unexpected weight {raw_name!r} for a {self.args.model_type} decoder")
            dst = params[target] if shard is None else self._shard(params[target], leaf, shard)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {raw_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)  # one copy, converting device and dtype on the way (no host round trip)
            loaded.add(target if shard is None else f"{target}#{shard}")
        return loaded

    def _shard(self, param: torch.Tensor, fused: str, shard: int) -> torch.Tensor:
        a = self.args
        sizes = (
            [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
            if fused == "qkv_proj"
            else [a.intermediate_size, a.intermediate_size]
        )
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])


def _normalize_name(name: str) -> str:
    """Drop wrapper prefixes that torch.compile / DDP / FSDP1 add to parameter names."""
    for prefix in _NAME_PREFIXES:
        name = name.replace(prefix, "")
    return name
