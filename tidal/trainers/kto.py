"""Kahneman–Tversky optimisation (KTO, Ethayarajh et al., arXiv 2402.01306) on unpaired data.

Each sample is a prompt, a response and a desirable/undesirable label. The loss
(``tidal.algorithms.preference.kto_loss``) compares the response's log-ratio π − ref with a
reference point KL: desirable ``w_d·(1 − σ(β(logratio − KL)))``, undesirable
``w_u·(1 − σ(β(KL − logratio)))``.

KL is estimated from *mismatched* pairs (prompt of one sample, response of another, as in the paper
and TRL): mean(π − ref), detached and clamped at 0. We estimate it once per optimizer step over the
step's samples on every device (``KTOTrainer`` runs that no-grad pass before the step), and the loss
is summed over samples and divided by the step's sample count. TRL shifts the responses by one
within each device's batch, which makes the pairs depend on how the step is split; we swap
responses between neighbours (samples 0↔1, 2↔3, …) instead, so with an even per-device share the
pairs, the estimate and hence the update are the same for any number of devices or micro-batches.

Under ``--ring_attn_size`` (packed rows) the mismatched-pair forwards take ring turns like the loss's
(``ring_attention.turns``): every rank of the ring group runs each rank's micro-batches, each over its
chunk, and only the owner counts the log-ratios, so the estimate is the one of plain data parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tidal.algorithms.preference import kto_loss
from tidal.config import ConfigError
from tidal.config.supervised import KTOConfig as KTOConfig
from tidal.config.supervised import KTORun as KTORun
from tidal.data import collate_packed, collate_padded
from tidal.data.unpaired import UnpairedSample, build_unpaired_samples
from tidal.distributed import World
from tidal.logging import get_logger
from tidal.models import Precision
from tidal.models.frozen import eval_mode
from tidal.models.ring_attention import active_ring, turns
from tidal.trainers.common import Recipe, fit_recipe, load_samples
from tidal.trainers.loop import SupervisedTrainer, reduce_metrics, to_device
from tidal.trainers.reference import (
    Reference,
    build_reference,
    moe_aux_term,
    moe_router_logits,
    sequence_logps,
)

log = get_logger(__name__)


@dataclass
class KTOObjective:
    """KTO loss per sample, divided by the step's sample count. ``kl`` and the per-class unit counts
    are set by ``KTOTrainer`` for each step (they are step-level quantities)."""

    reference: Reference
    cfg: KTOConfig
    pad_id: int
    packing: bool = False
    aux_loss_coef: float = 0.0
    kl: float = 0.0
    desirable_units: float = 0.0
    undesirable_units: float = 0.0

    def weight(self, sample: UnpairedSample) -> float:
        return 1.0

    def collate(self, samples: Sequence[UnpairedSample]) -> dict:
        sft = [s.as_sft() for s in samples]
        batch = (collate_packed if self.packing else collate_padded)(sft, self.pad_id)
        batch["desirable"] = torch.tensor([s.desirable for s in samples], dtype=torch.bool)
        batch["num_tokens"] = sum(len(s) for s in samples)
        return batch

    def logratios(self, model: nn.Module, batch: dict, precision: Precision, aux_loss_coef: float = 0.0):
        """``(π [B], ref [B], the policy forward's router logits)`` over the response tokens (router
        logits only with ``aux_loss_coef`` > 0, and never the reference's, which may share routers)."""
        with self.reference.use() as reference:
            ref_logps, _, _ = sequence_logps(reference, batch, precision)
        with moe_router_logits(model, aux_loss_coef) as router_logits:
            logps, _, _ = sequence_logps(model, batch, precision)
        return logps, ref_logps, router_logits

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        logps, ref_logps, router_logits = self.logratios(model, batch, precision, self.aux_loss_coef)
        desirable, cfg = batch["desirable"], self.cfg
        losses, rewards = kto_loss(
            logps,
            ref_logps,
            desirable,
            torch.tensor(self.kl, device=logps.device),
            cfg.beta,
            cfg.desirable_loss_weight,
            cfg.undesirable_loss_weight,
        )
        loss = losses.sum() / normaliser
        metrics = {"kl": torch.tensor(self.kl * len(losses) / normaliser)}
        for name, mask, units in (
            ("desirable_reward", desirable, self.desirable_units),
            ("undesirable_reward", ~desirable, self.undesirable_units),
        ):
            if units > 0:
                metrics[name] = rewards[mask].sum() / units
        # A dense model has no router: its load-balancing loss is 0 (as SFT and PPO; docs/openrlhf.md).
        share = len(losses) / normaliser
        aux = moe_aux_term(model, router_logits, batch, self.aux_loss_coef, share)
        if aux is not None:
            loss = loss + aux
            metrics["aux_loss"] = aux.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics


def mismatched(samples: Sequence[UnpairedSample]) -> list[UnpairedSample]:
    """Each prompt with its neighbour's response (0↔1, 2↔3, …; an odd last one takes the one before)."""
    n = len(samples)
    return [s.with_response(samples[i ^ 1 if i ^ 1 < n else i - 1]) for i, s in enumerate(samples)]


class KTOTrainer(SupervisedTrainer):
    """``SupervisedTrainer`` plus the step-level KL reference point and class counts."""

    objective: KTOObjective

    def train_step(self, samples: Sequence[UnpairedSample]) -> dict[str, float]:
        self.prepare_step(samples)
        return super().train_step(samples)

    def evaluate(self, samples: Sequence[UnpairedSample]) -> dict[str, float]:
        # The eval set's pairs are those of one process over the whole set (an eval set of one sample
        # pairs it with itself, as OpenRLHF's shift does in a batch of one); each device scores its
        # share of them, so any eval set size on any number of devices gives one process's metrics.
        self.estimate(self.eval_share(samples), self.eval_share(mismatched(samples)), samples[0])
        return super().evaluate(samples)

    def prepare_step(self, samples: Sequence[UnpairedSample]) -> None:
        # Every device's share of a step has the same size (the batch splits evenly), so every rank
        # decides this alike.
        if len(samples) < 2:
            raise ConfigError(
                "KTO estimates its KL term from mismatched pairs within a batch: each device needs at "
                f"least 2 samples per step (--train_batch_size / devices), got {len(samples)}"
            )
        self.estimate(samples, mismatched(samples), samples[0])

    def estimate(
        self, samples: Sequence[UnpairedSample], pairs: Sequence[UnpairedSample], filler: UnpairedSample
    ) -> None:
        """Set the objective's KL reference point from this device's mismatched ``pairs`` and its class
        counts from its ``samples``, both summed over devices (``filler`` pads the forwards: see
        ``SupervisedTrainer.even_micro_batches``)."""
        obj = self.objective
        sums = {"logratio": 0.0, "n": float(len(pairs))}
        with torch.no_grad(), eval_mode(self.opt.model):
            micro = self.even_micro_batches(pairs, filler)
            for mine, (counted, collated) in turns(
                micro, active_ring()
            ):  # a ring group runs each rank's pairs
                batch = to_device(collated, self.world.device)
                logps, ref_logps, _ = obj.logratios(self.opt.model, batch, self.opt.precision)
                if mine and counted:
                    sums["logratio"] += float((logps - ref_logps).sum())
        sums["desirable"] = float(sum(s.desirable for s in samples))
        sums["undesirable"] = len(samples) - sums["desirable"]
        total = reduce_metrics(sums, self.world)  # sums over devices / device count
        # kto_kl_estimate's mean, clamped at 0, taken over every device's mismatched pairs.
        obj.kl = max(total["logratio"] / total["n"], 0.0)
        obj.desirable_units, obj.undesirable_units = total["desirable"], total["undesirable"]


def load_unpaired_samples(spec: str, probs, split: str, max_samples, tokenizer, cfg, seed: int):
    samples = load_samples(build_unpaired_samples, spec, probs, split, max_samples, tokenizer, cfg, seed)
    desirable = sum(s.desirable for s in samples)
    if desirable in (0, len(samples)):
        log.warning("%s: every sample is %sdesirable", spec, "" if desirable else "un")
    return samples


class KTORecipe(Recipe):
    label = "KTO"
    load_samples = staticmethod(load_unpaired_samples)
    trainer_cls = KTOTrainer

    def load_frozen(self, run: KTORun, model: nn.Module, world: World) -> Reference:
        return build_reference(model, run.model, run.ref, run.dist, world)

    def objective(self, run: KTORun, tokenizer, train, frozen: Reference) -> KTOObjective:
        return KTOObjective(
            frozen, run.kto, tokenizer.pad_token_id, run.train.packing_samples, run.model.aux_loss_coef
        )

    def describe(self, run: KTORun, frozen: Reference) -> str:
        return f" (beta {run.kto.beta:g}, reference {type(frozen).__name__})"


def run_kto(run: KTORun, world: World | None = None) -> list[dict]:
    """Train a causal LM with KTO as configured; returns per-step metrics."""
    return fit_recipe(KTORecipe(), run, world)
