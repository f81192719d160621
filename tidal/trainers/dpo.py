"""Direct preference optimisation: DPO (Rafailov et al., arXiv 2305.18290), IPO (``--ipo``, Azar et
al., arXiv 2310.12036) and conservative DPO (``--label_smoothing``), with an optional NLL term on the
chosen responses (``--nll_loss_coef``, as OpenRLHF).

Each micro-batch runs chosen and rejected sequences through the policy in one forward (chosen rows
first, ``tidal.data.pairs.collate_pairs``) and through the frozen reference
(``tidal.trainers.reference``: a separate copy, or the LoRA base with adapters disabled). A
sequence's log-prob is the sum over its response tokens. The loss per pair comes from
``tidal.algorithms.preference.DPO_LOSSES`` and is divided by the number of pairs in the whole step, so
micro-batching never changes the update; the NLL term is each chosen response's mean token NLL,
normalised the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from tidal.algorithms.preference import DPO_LOSSES
from tidal.config.supervised import DPOConfig as DPOConfig
from tidal.config.supervised import DPORun as DPORun
from tidal.data.pairs import PairSample, collate_pairs
from tidal.distributed import World
from tidal.models import Precision
from tidal.trainers.common import Recipe, fit_recipe
from tidal.trainers.reference import (
    Reference,
    build_reference,
    moe_aux_term,
    moe_router_logits,
    sequence_logps,
)
from tidal.trainers.rm import load_pair_samples


@dataclass
class DPOObjective:
    """Pairwise DPO-family loss over response log-probs; the normalisation unit is one pair."""

    reference: Reference
    cfg: DPOConfig
    pad_id: int
    packing: bool = False
    aux_loss_coef: float = 0.0

    def weight(self, sample: PairSample) -> float:
        return 1.0

    def collate(self, samples: Sequence[PairSample]) -> dict:
        batch = collate_pairs(list(samples), self.pad_id, self.packing)
        batch["num_tokens"] = sum(len(s.chosen_ids) + len(s.rejected_ids) for s in samples)
        return batch

    def reference_logps(self, batch: dict, precision: Precision) -> Tensor:
        with self.reference.use() as reference:
            logps, _, _ = sequence_logps(reference, batch, precision)
        return logps

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        ref_logps = self.reference_logps(batch, precision)
        with moe_router_logits(model, self.aux_loss_coef) as router_logits:
            logps, counts, _ = sequence_logps(model, batch, precision)
        loss, metrics = self.loss_from_logps(logps, counts, ref_logps, normaliser)
        share = logps.shape[0] / 2 / normaliser
        # A dense model has no router: its load-balancing loss is 0 (as SFT and PPO; docs/openrlhf.md).
        aux = moe_aux_term(model, router_logits, batch, self.aux_loss_coef, share)
        if aux is not None:
            loss = loss + aux
            metrics["aux_loss"] = aux.detach()
            metrics["loss"] = loss.detach()
        return loss, metrics

    def loss_from_logps(self, logps: Tensor, counts: Tensor, ref_logps: Tensor, normaliser: float):
        """``(loss, metrics)`` from sequence log-probs ``[2B]`` (chosen first) and token counts."""
        n = logps.shape[0] // 2
        losses, chosen_rewards, rejected_rewards = DPO_LOSSES[self.cfg.loss_name](
            logps[:n], logps[n:], ref_logps[:n], ref_logps[n:], self.cfg.beta, self.cfg.label_smoothing
        )
        loss = losses.sum() / normaliser
        metrics = {
            "preference_loss": loss.detach(),
            "chosen_reward": chosen_rewards.sum() / normaliser,
            "rejected_reward": rejected_rewards.sum() / normaliser,
            "reward_accuracy": (chosen_rewards > rejected_rewards).float().sum() / normaliser,
            "reward_margin": (chosen_rewards - rejected_rewards).sum() / normaliser,
        }
        if self.cfg.nll_loss_coef > 0:
            # Mean token NLL of each chosen response (OpenRLHF's nll_loss), one unit per pair.
            nll = (-logps[:n] / counts[:n].clamp(min=1)).sum() / normaliser
            loss = loss + self.cfg.nll_loss_coef * nll
            metrics["nll_loss"] = nll.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics


class DPORecipe(Recipe):
    label = "DPO"
    load_samples = staticmethod(load_pair_samples)

    def load_frozen(self, run: DPORun, model: nn.Module, world: World) -> Reference:
        return build_reference(model, run.model, run.ref, run.dist, world)

    def objective(self, run: DPORun, tokenizer, train, frozen: Reference) -> DPOObjective:
        return DPOObjective(
            frozen, run.dpo, tokenizer.pad_token_id, run.train.packing_samples, run.model.aux_loss_coef
        )

    def describe(self, run: DPORun, frozen: Reference) -> str:
        return f" ({run.dpo.loss_name}, beta {run.dpo.beta:g}, reference {type(frozen).__name__})"


def run_dpo(run: DPORun, world: World | None = None) -> list[dict]:
    """Train a causal LM with DPO/IPO/cDPO as configured; returns per-step metrics."""
    return fit_recipe(DPORecipe(), run, world)
