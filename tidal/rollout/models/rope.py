"""Rotary position embeddings: the inverse frequencies of every supported ``rope_type`` and a cos/sin table.

transformers 5 keeps RoPE settings in ``config.rope_parameters``; older configs use ``rope_theta`` and
``rope_scaling``. Scaled variants (linear, dynamic NTK, yarn, llama3) reuse transformers' own frequency
functions so we stay identical to the reference implementation.

"dynamic" is computed once for ``max_model_len`` (transformers recomputes it whenever a batch grows
past ``max_position_embeddings``); both agree whenever ``max_model_len <= max_position_embeddings``.
"""

from __future__ import annotations

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inv_freq_and_scale(config, head_dim: int, max_model_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the cos/sin scale ("attention factor", yarn only)."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the rollout decoder")
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"seq_len": max_model_len} if rope_type == "dynamic" else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scale)


def rope_table(inv_freq: torch.Tensor, scale: float, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_len, head_dim] (float32), in the rotate-half layout of HF checkpoints."""
    positions = torch.arange(max_len, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, d]; cos/sin [tokens, d] already gathered at the tokens' positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
