"""Gemma 4 text models (``model_type`` "gemma4_text"); transformers' ``modeling_gemma4.py``
(``Gemma4ForCausalLM``) is the reference for every fact below.

The layer skeleton is Gemma's (``gemma2.py``): norms before and after attention and the gated
``gelu_pytorch_tanh`` MLP, embeddings times ``sqrt(hidden_size)``, final logits soft-capped
(``final_logit_softcapping``: the head is not chunkable). What Gemma 4 adds or changes:

- RMSNorm scales by ``weight`` itself (not ``1 + weight``), in float32, as ``x * (mean(x^2) + eps)^-0.5``;
- attention: q and k are RMS-normalised per head (weighted), v too (no weight); scores are not scaled
  (scaling 1.0) and not soft-capped;
- ``layer_types``: sliding-window layers (``sliding_window``) and full-attention layers, each kind with
  its own RoPE (``rope_parameters[kind]``; the full layers' "proportional" RoPE rotates only the first
  ``partial_rotary_factor`` of each head's frequencies) and its own head width: full layers have
  ``global_head_dim`` wide heads (``config.per_layer_config``), and with ``attention_k_eq_v`` their own
  KV head count and no ``v_proj`` (the values are the keys' projection, normalised without weight and
  not rotated);
- per-layer input embeddings (PLE): a second table ``embed_tokens_per_layer`` gives each token one
  ``hidden_size_per_layer_input`` vector per layer (times ``sqrt`` of that width); it is mixed with a
  projection of the token embedding (``per_layer_model_projection`` times ``hidden_size^-0.5``, then
  ``per_layer_projection_norm``) as ``(projection + embedding) / sqrt(2)``. After its MLP, layer ``i``
  adds ``post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) * ple_i))``;
- each layer's output is multiplied by its ``layer_scalar`` (a checkpoint buffer);
- KV sharing: the last ``num_kv_shared_layers`` layers have no k/v projections; each attends over the
  keys/values of the last earlier layer of its kind, and has no entry in the paged cache
  (``Gemma4Args.kv_layers``, ``gemma4_attention.py``). With ``use_double_wide_mlp`` their MLP is twice
  as wide.

With ``enable_moe_block`` (the 26B-A4B checkpoints) each layer also has routed experts beside its MLP
(``gemma4_moe.py``). Bidirectional attention is refused in one line. Parameters keep
transformers' names (nothing is packed: the layer kinds' q/k/v sizes differ); tensor parallelism and
exact mode are refused (``registry.py``, ``batch_invariant/support.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tidal.rollout.models.gemma2 import ScaledEmbedding, SoftcappedHead
from tidal.rollout.models.gemma4_attention import gemma4_attention
from tidal.rollout.models.gemma4_moe import add_moe_block, feed_forward, gemma4_moe_args
from tidal.rollout.models.layers import ACTIVATIONS, CausalLM, DecoderArgs, Rotary, sliding_windows
from tidal.rollout.models.moe import MoEArgs
from tidal.rollout.models.parallel import VocabParallelEmbedding
from tidal.rollout.models.rope import apply_rope, rope_table
from tidal.rollout.runner.attention import AttentionMetadata

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass
class Gemma4Args(DecoderArgs):
    """``DecoderArgs`` plus Gemma 4's per-layer shapes, KV sharing and per-layer embeddings."""

    layer_types: tuple[str, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_intermediate: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()  # the layer whose keys/values each layer attends over (itself: own)
    k_eq_v_full: bool = False  # full-attention layers take their values from k_proj
    ple_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer embeddings)
    ple_vocab_size: int = 0
    final_logit_softcapping: float | None = None
    moe: MoEArgs | None = None  # the routed experts beside each layer's MLP (``gemma4_moe.py``)

    @property
    def kv_layers(self) -> int:
        """Only the layers that compute their own keys/values have a slot in the cache."""
        return sum(source == i for i, source in enumerate(self.kv_sources))

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """One row per slot, as wide as the widest layer's k (or v) heads (``gemma4_attention.py``)."""
        return (2, 1, max(h * d for h, d in zip(self.layer_kv_heads, self.layer_head_dims, strict=True)))

    def kv_index(self, layer: int) -> int:
        """The cache slot of the layer whose keys/values ``layer`` reads."""
        source = self.kv_sources[layer]
        return sum(s == i for i, s in enumerate(self.kv_sources[:source]))


def kv_sources(config) -> tuple[int, ...]:
    """Each layer's KV producer: itself, or for the last ``num_kv_shared_layers`` layers the last earlier
    non-shared layer of the same kind (transformers' ``kv_sharing_modes``)."""
    layers, shared = config.num_hidden_layers, config.num_kv_shared_layers or 0
    first_shared = layers - shared
    sources = list(range(layers))
    for i in range(first_shared, layers):
        kind = config.layer_types[i]
        earlier = [j for j in range(first_shared) if config.layer_types[j] == kind]
        if not earlier:
            raise ValueError(
                f"gemma4_text layer {i} ({kind}) shares the KV of an earlier {kind} layer, but "
                f"num_kv_shared_layers={shared} leaves none"
            )
        sources[i] = earlier[-1]
    return tuple(sources)


def gemma4_args(config) -> Gemma4Args:
    """Read a Gemma 4 text config; refuse, in one line, what the engine does not implement."""
    if getattr(config, "use_bidirectional_attention", None) == "all":
        raise ValueError("gemma4_text with use_bidirectional_attention='all' (an encoder) is not supported")
    unknown = sorted(set(config.layer_types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"unsupported gemma4_text layer_types {unknown}; supported: {SLIDING}, {FULL}")
    sources = kv_sources(config)
    per_layer = [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    double = bool(getattr(config, "use_double_wide_mlp", False))
    widths = tuple(
        config.intermediate_size * (2 if double and sources[i] != i else 1) for i in range(len(sources))
    )
    head_dims = tuple(c.head_dim for c in per_layer)
    # Built field by field: a Gemma 4 config refuses to give one global head_dim or KV head count.
    return Gemma4Args(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=max(c.num_key_value_heads for c in per_layer),
        head_dim=max(head_dims),  # the attention backend's choice reads it (a power of two: Triton)
        rms_norm_eps=config.rms_norm_eps,
        hidden_act=config.hidden_activation,
        qkv_bias=bool(config.attention_bias),
        o_bias=bool(config.attention_bias),
        mlp_bias=False,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        sliding_windows=sliding_windows(config),
        layer_types=tuple(config.layer_types),
        layer_head_dims=head_dims,
        layer_kv_heads=tuple(c.num_key_value_heads for c in per_layer),
        layer_intermediate=widths,
        kv_sources=sources,
        k_eq_v_full=bool(getattr(config, "attention_k_eq_v", False)),
        ple_dim=config.hidden_size_per_layer_input or 0,
        ple_vocab_size=config.vocab_size_per_layer_input,
        final_logit_softcapping=config.final_logit_softcapping,
        moe=gemma4_moe_args(config) if getattr(config, "enable_moe_block", False) else None,
    )


class Gemma4RMSNorm(nn.Module):
    """RMSNorm in float32, ``x * (mean(x^2) + eps) ** -0.5``, times ``weight`` (None: no weight)."""

    def __init__(self, dim: int, eps: float, with_weight: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            x32 = x32 * self.weight.float()
        return x32.to(x.dtype)


class Gemma4Attention(nn.Module):
    """q/k/v projections with per-head norms, the layer kind's RoPE, unscaled paged attention. A KV-shared
    layer has q and o only and attends over its producer's keys/values (``shared``)."""

    def __init__(self, args: Gemma4Args, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.kind = args.layer_types[layer_idx]
        self.head_dim, self.num_heads = args.layer_head_dims[layer_idx], args.num_heads
        self.num_kv_heads = args.layer_kv_heads[layer_idx]
        self.window = args.sliding_windows[layer_idx]
        self.source, self.kv_index = args.kv_sources[layer_idx], args.kv_index(layer_idx)
        kv_size = self.num_kv_heads * self.head_dim
        bias = args.qkv_bias
        self.q_proj = nn.Linear(args.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, args.rms_norm_eps)
        if self.source == layer_idx:
            self.k_proj = nn.Linear(args.hidden_size, kv_size, bias=bias)
            self.k_eq_v = args.k_eq_v_full and self.kind == FULL
            if not self.k_eq_v:
                self.v_proj = nn.Linear(args.hidden_size, kv_size, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, args.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, args.rms_norm_eps, with_weight=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, args.hidden_size, bias=args.o_bias)

    def forward(self, x, rope, meta: AttentionMetadata, shared: dict) -> torch.Tensor:
        cos, sin = rope[self.kind]
        q = apply_rope(self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim)), cos, sin)
        own = self.source == self.layer_idx
        if own:
            k_raw = self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if self.k_eq_v else self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
            k, v = apply_rope(self.k_norm(k_raw), cos, sin), self.v_norm(v_raw)
            shared[self.layer_idx] = (k, v)  # for the KV-shared layers that read this one
        else:
            k, v = shared[self.source]
        out = gemma4_attention(q, k, v, meta, self.kv_index, self.window, 1.0, store=own)
        return self.o_proj(out)


class Gemma4MLP(nn.Module):
    """down(act(gate(x)) * up(x)) with transformers' parameter names (widths differ between layers)."""

    def __init__(self, args: Gemma4Args, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, args.hidden_size, bias=False)
        self.act = ACTIVATIONS[args.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and MLP (+ experts), then the per-layer input, then the layer scalar."""

    def __init__(self, args: Gemma4Args, layer_idx: int):
        super().__init__()
        eps, hidden = args.rms_norm_eps, args.hidden_size
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(args, layer_idx)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.mlp = Gemma4MLP(args, args.layer_intermediate[layer_idx])
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        if args.moe is not None:
            add_moe_block(self, hidden, args.hidden_act, args.moe, Gemma4RMSNorm, eps)
        self.act = ACTIVATIONS[args.hidden_act]
        if args.ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, args.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(args.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)
        # A checkpoint buffer, not a trained weight: loaded by ``Gemma4ForCausalLM.load_weights``.
        self.register_buffer("layer_scalar", torch.ones(1), persistent=False)

    def forward(self, h, ple, rope, meta: AttentionMetadata, shared: dict) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, meta, shared))
        h = h + self.post_feedforward_layernorm(feed_forward(self, h))
        if ple is not None:
            gated = self.act(self.per_layer_input_gate(h)) * ple
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class ScaledRowsEmbedding(VocabParallelEmbedding):
    """An embedding times ``sqrt(scale_dim)`` rounded to the weights' dtype (the per-layer table's rows
    hold every layer's vector, but the scale is of one layer's width)."""

    def __init__(self, vocab_size: int, dim: int, scale_dim: int, tp):
        super().__init__(vocab_size, dim, tp)
        self.scale_dim = scale_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = float(torch.tensor(self.scale_dim**0.5, dtype=self.weight.dtype))
        return super().forward(input_ids) * scale


class Gemma4Model(nn.Module):
    def __init__(self, args: Gemma4Args):
        super().__init__()
        self.embed_tokens = ScaledEmbedding(args.vocab_size, args.hidden_size, args.tp)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = Gemma4RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.ple_dim:
            width = args.num_layers * args.ple_dim
            self.embed_tokens_per_layer = ScaledRowsEmbedding(
                args.ple_vocab_size, width, args.ple_dim, args.tp
            )
            self.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(args.ple_dim, args.rms_norm_eps)


class Gemma4ForCausalLM(CausalLM):
    supports_tp = False
    packed_params = {}  # the layer kinds' q/k/v and MLP widths differ: every projection is its own
    # Checkpoint buffers that are weights to us: ``LLMEngine(model=...)`` passes them with the parameters.
    buffer_weights = (".layer_scalar",)
    # FP8 rollouts (``quant/linear.py``): ``load_weights`` filters the shared loader's names, and these
    # decoder-layer ``nn.Linear``s (not the routers or per-layer-embedding projections) are quantized.
    fp8_traced_loader = True
    fp8_linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    def __init__(self, args: Gemma4Args):
        nn.Module.__init__(self)
        self.args = args
        self.model = Gemma4Model(args)
        self.lm_head = SoftcappedHead(
            args.hidden_size, args.vocab_size, args.tp, args.final_logit_softcapping
        )
        self.rotary = Rotary()  # full-attention layers
        self.rotary_local = Rotary()  # sliding-window layers
        self.tie_weights()

    @classmethod
    def args_from_hf_config(cls, config) -> Gemma4Args:
        return gemma4_args(config)

    def init_rope(self, hf_config, max_model_len: int) -> None:
        """Each layer kind's RoPE table. Called once on the freshly allocated model (``to_empty``), before its
        weights load, so it also sets the layer scalars to their default 1 (checkpoints overwrite them)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        device = self.model.embed_tokens.weight.device
        for rotary, kind in ((self.rotary_local, SLIDING), (self.rotary, FULL)):
            params = hf_config.rope_parameters[kind]
            rope_type = params.get("rope_type", "default")
            head_dim = hf_config.per_layer_config[kind].head_dim
            if rope_type == "default":
                base = params["rope_theta"]
                inv_freq = 1.0 / (
                    base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
                )
                scale = 1.0
            elif rope_type in ("proportional", "linear"):
                inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](
                    hf_config, torch.device("cpu"), layer_type=kind
                )
            else:
                raise ValueError(f"unsupported gemma4_text rope_type {rope_type!r} for {kind} layers")
            cos, sin = rope_table(inv_freq.float(), float(scale), max_model_len)
            rotary.cos, rotary.sin = cos.to(device), sin.to(device)
        for layer in self.model.layers:
            layer.layer_scalar.fill_(1.0)

    def rope(self, positions, meta: AttentionMetadata, dtype: torch.dtype):
        return {SLIDING: self.rotary_local(positions, dtype), FULL: self.rotary(positions, dtype)}

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[tokens, layers, ple_dim]: the token's per-layer embedding mixed with its projected embedding."""
        a, m = self.args, self.model
        if not a.ple_dim:
            return None
        tokens = m.embed_tokens_per_layer(input_ids).view(-1, a.num_layers, a.ple_dim)
        projected = m.per_layer_model_projection(x) * a.hidden_size**-0.5
        projected = m.per_layer_projection_norm(projected.view(-1, a.num_layers, a.ple_dim))
        return (projected + tokens) * 2.0**-0.5

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_index=None) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        ple = self.per_layer_inputs(input_ids, h)
        rope = self.rope(positions, meta, h.dtype)
        shared: dict = {}  # producer layer -> its keys/values of this step
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None if ple is None else ple[:, i], rope, meta, shared)
        if logits_index is not None:  # prefill needs logits of each sequence's last token only
            h = h[logits_index]
        return self.lm_head(self.model.norm(h))

    @torch.no_grad()
    def load_weights(self, named_tensors) -> set[str]:
        """The generic loader, plus the layer scalars (buffers) and without the k/v projections and norms
        that checkpoints may still hold for KV-shared layers (transformers ignores them too)."""
        layers = self.model.layers

        def ours():
            for raw_name, tensor in named_tensors:
                name = self._our_name(raw_name)
                parts = name.split(".")
                if name.endswith(".layer_scalar"):
                    layers[int(parts[-2])].layer_scalar.copy_(tensor)
                    continue
                if parts[:2] == ["model", "layers"] and parts[4:5] and parts[3] == "self_attn":
                    index = int(parts[2])
                    if self.args.kv_sources[index] != index and parts[4] in (
                        "k_proj",
                        "v_proj",
                        "k_norm",
                        "v_norm",
                    ):
                        continue
                yield raw_name, tensor

        return super().load_weights(ours())
