"""Supervised fine-tuning: next-token loss on response tokens (all tokens in pretrain mode).

``SFTObjective`` plugs into ``SupervisedTrainer``; ``run_sft`` (the CLI calls it) builds and trains an
``SFTRun`` with ``SFTRecipe`` (``tidal.trainers.common.fit_recipe``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from tidal.config.supervised import SFTRun as SFTRun
from tidal.data import (
    SFTDataConfig,
    SFTSample,
    build_sft_samples,
    collate_packed,
    collate_padded,
)
from tidal.distributed import World
from tidal.models import Precision, token_logprobs
from tidal.trainers.common import Recipe, fit_recipe, load_samples
from tidal.trainers.reference import moe_aux_term, moe_router_logits


class SFTBatching:
    """How objectives over ``SFTSample``s weigh and collate them (needs ``pad_id`` and ``packing``)."""

    pad_id: int
    packing: bool

    def weight(self, sample: SFTSample) -> float:
        return float(sum(sample.loss_mask[1:]))  # trained tokens (the first token is never a target)

    def collate(self, samples: Sequence[SFTSample]) -> dict:
        batch = (collate_packed if self.packing else collate_padded)(list(samples), self.pad_id)
        batch["num_tokens"] = sum(len(s) for s in samples)
        return batch


@dataclass
class SFTObjective(SFTBatching):
    """Sum of −log p over trained tokens, divided by the step's trained-token count."""

    pad_id: int
    packing: bool = False
    aux_loss_coef: float = 0.0

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        with precision.autocast(), moe_router_logits(model, self.aux_loss_coef) as router_logits:
            logprobs, _ = token_logprobs(model, batch)
        mask = batch["loss_mask"].to(logprobs.dtype)
        nll = -(logprobs * mask).sum()
        loss = nll / normaliser
        metrics = {"loss": loss.detach()}
        # Weighted by the micro-batch's share of the step's tokens; a dense model adds 0, as OpenRLHF.
        share = mask.sum() / normaliser
        aux = moe_aux_term(model, router_logits, batch, self.aux_loss_coef, share)
        if aux is not None:
            loss = loss + aux
            metrics["aux_loss"] = aux.detach()
        return loss, metrics


def load_sft_samples(
    spec: str, probs, split: str, max_samples, tokenizer, cfg: SFTDataConfig, seed: int, images=None
):
    """SFT samples of a ``--dataset``-style spec (skipped rows are logged; ``images``: with their images)."""
    return load_samples(build_sft_samples, spec, probs, split, max_samples, tokenizer, cfg, seed, images)


class SFTRecipe(Recipe):
    label = "SFT"
    load_samples = staticmethod(load_sft_samples)

    def objective(self, run: SFTRun, tokenizer, train, frozen) -> SFTObjective:
        return SFTObjective(tokenizer.pad_token_id, run.train.packing_samples, run.model.aux_loss_coef)


def run_sft(run: SFTRun, world: World | None = None) -> list[dict]:
    """Train a causal LM with SFT as configured; returns per-step metrics."""
    return fit_recipe(SFTRecipe(), run, world)
