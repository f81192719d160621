"""Gemma 4's mixture-of-experts block (``enable_moe_block``: the 26B-A4B checkpoints), beside the dense MLP.

In such a layer (transformers' ``Gemma4TextDecoderLayer``, ``Gemma4TextRouter``) the feed-forward part
reads the post-attention hidden state ``h`` twice:

- the dense MLP as usual, ``post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))``;
- the routed experts: the router normalises ``h`` (no weight), multiplies it by its ``scale`` vector and
  ``hidden_size ** -0.5``, projects to ``num_experts`` logits, takes the softmax (float32) top-k
  (``top_k_experts``), renormalises over the k and multiplies each weight by its expert's
  ``per_expert_scale``; the experts (stacked ``gate_up_proj`` / ``down_proj``, ``moe.Experts``, gated by
  the model's activation) run on ``pre_feedforward_layernorm_2(h)``, and their weighted sum goes through
  ``post_feedforward_layernorm_2``;

the two are added, then ``post_feedforward_layernorm`` and the residual as in a dense layer. The router
is Gemma 4's own, so router replay (which forces plain softmax top-k weights) is refused for the family.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.rollout.models.moe import Experts, MoEArgs


def gemma4_moe_args(config) -> MoEArgs:
    """The routed experts of a Gemma 4 config (every layer has them when ``enable_moe_block``)."""
    return MoEArgs(
        num_experts=config.num_experts,
        top_k=config.top_k_experts,
        intermediate_size=config.moe_intermediate_size,
        renormalize=True,
        weights_in_model_dtype=False,
        sparse_layers=(True,) * config.num_hidden_layers,
    )


class Gemma4Router(nn.Module):
    """(weights [tokens, k] float32, expert ids [tokens, k]) of each token's experts."""

    def __init__(self, hidden_size: int, moe: MoEArgs, norm: nn.Module):
        super().__init__()
        self.norm = norm  # an unweighted RMSNorm
        self.proj = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.top_k = moe.top_k
        self.root = hidden_size**-0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(self.norm(h) * self.scale * self.root)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


def add_moe_block(layer: nn.Module, hidden_size: int, hidden_act: str, moe: MoEArgs, norm_cls, eps: float):
    """Give a decoder layer the router, experts and three extra norms, under transformers' names."""
    layer.router = Gemma4Router(hidden_size, moe, norm_cls(hidden_size, eps, with_weight=False))
    layer.experts = Experts(moe, hidden_size, hidden_act)
    layer.post_feedforward_layernorm_1 = norm_cls(hidden_size, eps)
    layer.pre_feedforward_layernorm_2 = norm_cls(hidden_size, eps)
    layer.post_feedforward_layernorm_2 = norm_cls(hidden_size, eps)


def feed_forward(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The layer's feed-forward output before ``post_feedforward_layernorm``: the dense MLP's, plus the
    routed experts' where the layer has them."""
    dense = layer.mlp(layer.pre_feedforward_layernorm(h))
    if not hasattr(layer, "experts"):
        return dense
    weights, ids = layer.router(h)
    routed = layer.experts(layer.pre_feedforward_layernorm_2(h), weights, ids)
    return layer.post_feedforward_layernorm_1(dense) + layer.post_feedforward_layernorm_2(routed)
