"""A transformers model in exact mode: ``make_exact`` switches its layers to the batch-invariant ops
(attention through ``hf_exact_attention``, per sample of a packed row) and makes it compute in the engine's
dtype with the engine's RoPE frequencies (``use_engine_numerics``); autocast must not re-cast inside the
ops (``exact_autocast_off``).

The switched layers run the batch-invariant ops only where no gradient is recorded (``exact_forward``):
with grad enabled they run their own (class) forward, the default fast path, and attention runs the
model's default implementation (``default_attention``). The trainer takes the log-prob values from a
no-grad exact forward and the gradient from a default one (``tidal.models.forward.exact_token_logprobs``):
only the values must equal the engine's, and a gradient checkpoint's recompute (grad enabled) then
recomputes the fast forward it checkpointed.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from tidal.rollout.batch_invariant.causal_attention import attention
from tidal.rollout.batch_invariant.elementwise import pointwise, rms_norm, rope_cos_sin
from tidal.rollout.batch_invariant.matmul import linear
from tidal.rollout.batch_invariant.moe import gate_column, moe_experts, moe_route, shared_expert_mix
from tidal.rollout.batch_invariant.support import exact_problem


def exact_autocast_off(device: torch.device):
    """A context in which autocast leaves an exact-mode forward's dtypes alone (they are the engine's)."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


def engine_dtype(device: torch.device) -> torch.dtype:
    """The RL rollout engine's dtype on ``device`` (its ``auto``: bfloat16 on CUDA, float32 on CPU)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def use_engine_numerics(model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
    """Make an exact-mode transformers model compute what the engine computes:

    - in ``dtype`` (default: ``engine_dtype`` of its device): the embedding output is cast to it, so the
      residual stream is in it, and the ops take the (e.g. float32 master) weights rounded to it; with
      autocast off around the forward (``exact_autocast_off``) nothing re-casts in between;
    - with the engine's RoPE frequencies (``rope.inv_freq_and_scale`` on the CPU, as the engine builds
      them): transformers computes its ``inv_freq`` with ``pow`` on the device the model is built on, and
      CUDA's ``pow`` can round differently from the CPU's."""
    from tidal.rollout.models.rope import inv_freq_and_scale

    if dtype is None:
        dtype = engine_dtype(next(model.parameters()).device)
    embed = model.get_input_embeddings()
    if getattr(embed, "tidal_compute_hook", None) is not None:
        embed.tidal_compute_hook.remove()
    # the exact (no-grad) forward's residual stream is in ``dtype``; the fast one keeps the default's
    embed.tidal_compute_hook = embed.register_forward_hook(
        lambda module, args, out: out if torch.is_grad_enabled() else out.to(dtype)
    )
    model.tidal_compute_dtype = dtype
    config = model.config
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            with torch.device("cpu"):
                inv_freq, _ = inv_freq_and_scale(
                    config, 2 * module.inv_freq.numel(), config.max_position_embeddings
                )
            with torch.no_grad():
                module.inv_freq.copy_(inv_freq)


@dataclass(frozen=True)
class SegmentLayout:
    """The samples of rows ``[B, T]`` (positions restart at 0 per sample, as in packed rows) laid out as a
    ``[S, L]`` grid (``S`` samples, ``L`` the longest), the shape ``attention`` takes."""

    index: torch.Tensor  # [S, L]: the flat token index of each sample's l-th token (0 past its end)
    local: torch.Tensor  # [S, L]: its position within the sample
    sample: torch.Tensor  # [B * T]: each token's sample (row of the grid) ...
    col: torch.Tensor  # [B * T]: ... and column: the way back from the grid to the tokens


def segment_layout(position_ids: torch.Tensor) -> SegmentLayout:
    """The ``SegmentLayout`` of rows ``position_ids [B, T]``. A sample starts wherever the position does not
    continue the previous token's (a row start, a 0, or a padding token), so every token is in exactly one
    sample. Two host syncs (the sample count and the longest sample): the exact forward computes it once
    and hands it to every layer (``hf_exact_attention``'s ``tidal_segments``)."""
    bsz, t = position_ids.shape
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::t] = True
    first = torch.nonzero(starts).view(-1)
    lengths = torch.diff(torch.cat([first, first.new_tensor([flat.numel()])]))
    width = int(lengths.max())
    cols = torch.arange(width, device=flat.device)
    index = torch.where(cols[None, :] < lengths[:, None], first[:, None] + cols[None, :], 0)
    sample = starts.cumsum(0) - 1
    col = torch.arange(flat.numel(), device=flat.device) - first[sample]
    return SegmentLayout(index, cols[None, :].expand_as(index), sample, col)


EXACT_ATTENTION = "tidal_exact"
SEGMENTS_KWARG = "tidal_segments"  # a forward keyword carrying the rows' ``SegmentLayout`` to every layer


def hf_exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention (``query [B, H, T, D]``, ``key/value [B, KV, T, D]``) through ``attention``:
    each sample of a row (found from ``position_ids``, or the forward's ``tidal_segments`` layout; the mask
    is not read) attends its own tokens. With grad enabled (a checkpoint's recompute of the fast forward):
    the model's default attention instead."""
    if torch.is_grad_enabled():
        fn = _default_attention_fn(module)
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    b, h, t, d = query.shape
    layout = kwargs.get(SEGMENTS_KWARG)
    if layout is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(t, device=query.device).expand(b, t)
        layout = segment_layout(position_ids)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d)[layout.index] for x in (query, key, value))
    window = getattr(module, "tidal_window", None)
    out = attention(q, k, v, layout.local, scaling if scaling is not None else d**-0.5, window)
    # every token is in exactly one sample: gather each token's row back (no zero-filled scatter target)
    return out[layout.sample, layout.col].view(b, t, h, d), None


def _default_attention_fn(module):
    """The attention function of the implementation ``module``'s model had before ``make_exact``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(module.config, "tidal_default_attention", "sdpa")
    if impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    return sys.modules[type(module).__module__].eager_attention_forward  # "eager": the family's own


def _configs(model: torch.nn.Module) -> list:
    """The model's config and its inner model's (one object or two), whose attention switch we set."""
    config = model.config
    inner = getattr(getattr(model, "model", None), "config", config)
    return list({id(c): c for c in (config, inner)}.values())


@contextlib.contextmanager
def default_attention(model: torch.nn.Module):
    """Within: the exact model's attention is its default implementation again (the fast forward's; the
    packed-row masks or varlen arguments are built for it). An implementation chosen inside (e.g. the
    varlen kernels on CUDA) is kept as the default for later recomputes."""
    configs = _configs(model)
    for cfg in configs:
        cfg._attn_implementation = getattr(cfg, "tidal_default_attention", "sdpa")
    try:
        yield
    finally:
        for cfg in configs:
            cfg.tidal_default_attention = cfg._attn_implementation
            cfg._attn_implementation = EXACT_ATTENTION


def make_exact(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Switch a transformers model of a supported family to the batch-invariant ops, in place: every
    ``nn.Linear`` (LM head included), RMSNorm, the MLP's activation, RoPE and attention, computing in
    ``compute_dtype`` (``use_engine_numerics``); where grad is enabled, the default ops (module doc).
    Returns it."""
    from transformers import AttentionInterface

    from tidal.rollout.models.architecture import ACTIVATIONS, sliding_windows

    config = model.config
    problem = exact_problem(config)
    if problem:
        raise ValueError(problem)
    AttentionInterface.register(EXACT_ATTENTION, hf_exact_attention)
    windows = sliding_windows(config)
    act = ACTIVATIONS[config.hidden_act]
    weights_dtype = torch.float32 if config.model_type == "mixtral" else None  # see moe_route
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            module.forward = exact_forward(lambda m, x: linear(x, m.weight, m.bias), module)
        elif name.endswith("RMSNorm"):
            module.forward = exact_forward(lambda m, x: rms_norm(x, m.weight, m.variance_epsilon), module)
        elif name.endswith("RotaryEmbedding"):
            module.forward = exact_forward(
                lambda m, x, position_ids: rope_cos_sin(
                    position_ids, m.inv_freq, m.attention_scaling, x.dtype
                ),
                module,
            )
        elif name.endswith("TopKRouter"):  # MoE: routing, experts and the shared expert (moe_route, ...)
            module.forward = exact_forward(
                lambda m, x: moe_route(
                    x, m.weight, m.top_k, getattr(m, "norm_topk_prob", True), weights_dtype
                ),
                module,
            )
        elif name.endswith("Experts") and hasattr(module, "gate_up_proj"):
            module.forward = exact_forward(
                lambda m, x, ids, weights: moe_experts(x, m.gate_up_proj, m.down_proj, ids, weights, act),
                module,
            )
        elif hasattr(module, "shared_expert_gate"):
            module.forward = exact_forward(hf_exact_shared_moe, module)
        elif all(hasattr(module, a) for a in ("gate_proj", "up_proj", "down_proj")):
            module.forward = exact_forward(
                lambda m, x: m.down_proj(pointwise(act, m.gate_proj(x)) * m.up_proj(x)), module
            )
        elif hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            module.tidal_window = windows[module.layer_idx]
    for cfg in _configs(model):
        if cfg._attn_implementation != EXACT_ATTENTION:
            cfg.tidal_default_attention = cfg._attn_implementation
        cfg._attn_implementation = EXACT_ATTENTION
    use_engine_numerics(model, compute_dtype)
    model.tidal_exact = True
    return model


def is_exact(model: torch.nn.Module) -> bool:
    """Whether ``make_exact`` switched this model (or the model it wraps)."""
    return bool(getattr(model, "tidal_exact", False))


def exact_forward(fn, module):
    """An instance ``forward`` that runs ``fn(module, ...)`` (the exact ops) where no gradient is recorded,
    and the module's class forward (the default, fast ops) where one is: see the module doc."""
    default = type(module).forward

    def forward(*args, **kwargs):
        if torch.is_grad_enabled():
            return default(module, *args, **kwargs)
        return fn(module, *args, **kwargs)

    return forward


def bound_forward(fn, module):
    """``fn`` with ``module`` as its first argument (an instance ``forward`` that shadows the class's)."""

    def forward(*args, **kwargs):
        return fn(module, *args, **kwargs)

    return forward


def hf_exact_shared_moe(block, hidden_states: torch.Tensor) -> torch.Tensor:
    """A transformers Qwen2-MoE block (router, experts, gated shared expert) through the exact ops."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    _, weights, ids = block.gate(x)
    routed = block.experts(x, ids, weights)
    gate_logit = gate_column(x, block.shared_expert_gate.weight)
    return shared_expert_mix(routed, gate_logit, block.shared_expert(x)).view(shape)
