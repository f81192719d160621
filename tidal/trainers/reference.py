"""The reference model of DPO and KTO, and the per-sequence log-probs the preference objectives compare.

Two kinds of reference:

- a ``tidal.models.frozen.FrozenModel``: a separate frozen copy (``--ref_pretrain``, default
  ``--pretrain``), optionally kept in CPU memory between forwards (``--ref_offload``);
- ``DisabledAdapters``: under LoRA the reference is the policy's own base model with its adapters
  switched off (peft ``disable_adapter()``), so no second copy is loaded.

Both switch the module to eval mode for the reference forward (no dropout) and restore the mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from tidal.config import ConfigError, DistributedConfig, ModelConfig
from tidal.config.supervised import ReferenceConfig as ReferenceConfig
from tidal.distributed import World
from tidal.models import Precision, token_logprobs
from tidal.models.frozen import FrozenModel, eval_mode, load_frozen
from tidal.models.moe_routing import capture_router_logits, router_aux_loss


class DisabledAdapters:
    """The LoRA policy's base model: the same weights with every adapter switched off."""

    def __init__(self, policy: nn.Module):
        if not hasattr(policy, "disable_adapter"):
            raise TypeError(f"{type(policy).__name__} has no LoRA adapters to disable")
        self.model = policy

    @contextlib.contextmanager
    def use(self) -> Iterator[nn.Module]:
        with torch.no_grad(), eval_mode(self.model), self.model.disable_adapter():
            yield self.model


Reference = FrozenModel | DisabledAdapters


def build_reference(
    policy: nn.Module,
    model_cfg: ModelConfig,
    ref_cfg: ReferenceConfig,
    dist_cfg: DistributedConfig,
    world: World,
) -> Reference:
    """The reference for DPO/KTO as ``ReferenceConfig`` describes (see the module docstring)."""
    same_base = ref_cfg.ref_pretrain in (None, model_cfg.pretrain)
    if model_cfg.lora_rank > 0 and same_base:
        if ref_cfg.ref_offload:
            raise ConfigError(
                "--ref_offload has nothing to offload with --lora_rank: the reference is the policy's own "
                "base model with adapters disabled (give a different --ref_pretrain to load a copy)"
            )
        return DisabledAdapters(policy)
    path = ref_cfg.ref_pretrain or model_cfg.pretrain
    frozen = load_frozen(path, model_cfg, ref_cfg.ref_offload, dist_cfg, world, "--ref_pretrain")
    check_same_vocab(policy, frozen.model, f"--ref_pretrain {path}")
    return frozen


def check_same_vocab(policy: nn.Module, other: nn.Module, what: str) -> None:
    """Log-probs are compared token by token, so both models must share the vocabulary."""
    a, b = policy.get_output_embeddings().weight.shape[0], other.get_output_embeddings().weight.shape[0]
    if a != b:
        raise ConfigError(
            f"{what}: vocabulary size {b} differs from the policy's {a}; use the same tokenizer"
        )


def sequence_logps(model: nn.Module, batch: dict, precision: Precision, **forward_kwargs):
    """Per-sample sums of log-probs over ``loss_mask`` tokens ``[B]``, their token counts ``[B]``,
    and the forward outputs. Packed rows are split by ``segment_ids``."""
    with precision.autocast():
        logprobs, outputs = token_logprobs(model, batch, **forward_kwargs)
    mask = batch["loss_mask"].to(logprobs.dtype)
    picked = logprobs * mask
    if "segment_ids" not in batch:
        return picked.sum(-1), mask.sum(-1), outputs
    segments = batch["segment_ids"][0]
    n = int(batch["seq_lens"].numel())
    sums = picked.new_zeros(n).index_add(0, segments, picked[0])
    counts = mask.new_zeros(n).index_add(0, segments, mask[0])
    return sums, counts, outputs


@contextlib.contextmanager
def moe_router_logits(model: nn.Module, coef: float) -> Iterator[list[torch.Tensor]]:
    """The routers' logits of the forwards run inside, when ``--aux_loss_coef`` > 0 (else nothing).

    Hooks the routers (``tidal.models.moe_routing``) instead of passing ``output_router_logits=True``:
    HF then computes its own aux loss from the forward's attention mask, which fails on packed rows."""
    if coef <= 0:
        yield []
        return
    with capture_router_logits(model) as logits:
        yield logits


def moe_aux_term(
    model: nn.Module,
    router_logits: list[torch.Tensor],
    batch: dict,
    coef: float,
    share: float,
) -> torch.Tensor | None:
    """``--aux_loss_coef`` × the MoE load-balancing loss, weighted by this micro-batch's ``share`` of the
    step (so accumulation leaves the update unchanged); ``None`` when the coefficient is 0 or the model
    is dense (it has no router: the term is 0, as every trainer treats it)."""
    if coef <= 0:
        return None
    # Packed rows hold only real tokens; padded rows count only the attended ones.
    tokens = None if "segment_ids" in batch else batch.get("attention_mask")
    aux = router_aux_loss(model, router_logits, tokens)
    if aux is None:
        return None
    return coef * aux * share
