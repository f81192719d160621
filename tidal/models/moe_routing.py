"""The routers of HF mixture-of-experts models: capture their logits, and the load-balancing loss.

HF MoE families (Qwen3-MoE, Mixtral, ...) declare their router class in ``_can_record_outputs
["router_logits"]``; every instance of that class is one MoE layer's router, whose forward returns
``(router_logits, routing_weights, selected_experts)``. We hook those modules directly rather than
pass ``output_router_logits=True``: HF then computes its own aux loss with the forward's
``attention_mask``, which breaks on packed rows (a ``[B, 1, T, T]`` mask) — here the caller says
which tokens count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order; empty for a dense model."""
    classes = set()
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            classes.add(recorder.target_class)
    if not classes:
        return []
    return [m for m in model.modules() if isinstance(m, tuple(classes))]


def is_moe(model: nn.Module) -> bool:
    return bool(router_modules(model))


@contextlib.contextmanager
def capture_router_logits(model: nn.Module) -> Iterator[list[Tensor]]:
    """Collect each router's logits ``[tokens, experts]`` (layer order) of the forwards run inside."""
    logits: list[Tensor] = []

    def hook(_module, _inputs, output):
        logits.append(output[0])

    handles = [m.register_forward_hook(hook) for m in router_modules(model)]
    try:
        yield logits
    finally:
        for h in handles:
            h.remove()


def load_balancing_loss(router_logits: list[Tensor], top_k: int, token_mask: Tensor | None = None) -> Tensor:
    """Switch Transformer's load-balancing loss (HF's ``load_balancing_loss_func``): ``E × Σ_e f_e P_e``
    over every layer's tokens, with ``f_e`` the fraction of top-k picks that go to expert ``e`` and
    ``P_e`` its mean router probability. ``token_mask`` (``[tokens]``, 1 = counts) drops padding."""
    probs = torch.cat([x.float() for x in router_logits]).softmax(-1)  # [layers × tokens, E]
    n_experts = probs.shape[-1]
    weight = probs.new_ones(probs.shape[0])
    if token_mask is not None:
        weight = token_mask.reshape(-1).to(probs).repeat(len(router_logits))
    picks = F.one_hot(probs.topk(top_k, dim=-1).indices, n_experts).sum(1).to(probs)  # [rows, E]
    rows = weight.sum().clamp(min=1.0)
    tokens_per_expert = (picks * weight[:, None]).sum(0) / rows
    prob_per_expert = (probs * weight[:, None]).sum(0) / rows
    return (tokens_per_expert * prob_per_expert).sum() * n_experts


def router_top_k(model: nn.Module) -> int:
    """Experts per token of the model's routers."""
    router = router_modules(model)[0]
    return int(getattr(router, "top_k", None) or model.config.num_experts_per_tok)


def router_aux_loss(
    model: nn.Module, router_logits: list[Tensor], token_mask: Tensor | None
) -> Tensor | None:
    """The load-balancing loss of captured router logits; ``None`` for a dense model (no routers)."""
    if not router_logits:
        return None
    return load_balancing_loss(router_logits, router_top_k(model), token_mask)


# ---- router replay ----------------------------------------------------------------------------------
# A replaying router keeps its own logits (so its weights still get gradients) but takes the experts
# recorded by the engine: routing weights = softmax(own logits) at the forced experts, renormalised over
# them where the router renormalises (verl's "R3" convention). Rows with id -1 (not recorded, e.g. the
# last sampled token, which the engine never ran through the model) keep the router's own choice.
_FORCED = "_tidal_forced_experts"
_HOOK = "_tidal_replay_hook"


def _replay_hook(router: nn.Module, _inputs, output):
    forced = getattr(router, _FORCED, None)
    if forced is None:
        return output
    logits, scores, own_ids = output
    if forced.shape != own_ids.shape:
        raise ValueError(
            f"router replay: {tuple(forced.shape)} recorded expert ids for a router that saw "
            f"{tuple(own_ids.shape)} (tokens, top-k)"
        )
    forced = forced.to(own_ids.device)
    ids = torch.where(forced >= 0, forced.to(own_ids.dtype), own_ids)
    weights = logits.float().softmax(-1).gather(-1, ids)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights.to(scores.dtype), ids


def force_routing(model: nn.Module, experts: Tensor | None) -> None:
    """Make every router of ``model`` pick ``experts`` ``[tokens, layers, k]`` (the forward's tokens in
    its flattened order, one column per router in layer order); ``None`` restores normal routing.

    The forced ids stay until the next call, so a gradient-checkpointing recompute during backward
    routes the same way as the forward it repeats."""
    routers = router_modules(model)
    if experts is not None and experts.shape[1] != len(routers):
        raise ValueError(
            f"router replay: ids for {experts.shape[1]} MoE layers, the model has {len(routers)}"
        )
    for layer, router in enumerate(routers):
        if getattr(router, _HOOK, None) is None:
            setattr(router, _HOOK, router.register_forward_hook(_replay_hook))
        setattr(router, _FORCED, None if experts is None else experts[:, layer])


@contextlib.contextmanager
def replayed_routing(model: nn.Module, experts: Tensor | None) -> Iterator[None]:
    """``force_routing`` for the forwards inside (no-op for ``None``), then normal routing again."""
    if experts is None:
        yield
        return
    force_routing(model, experts)
    try:
        yield
    finally:
        force_routing(model, None)
