"""Knowledge distillation: train a student on SFT data to match a frozen teacher's next-token
distributions (Hinton et al., arXiv 1503.02531), mixed with the usual LM loss.

Per trained token: ``(1 − α)·LM + α·(−Σ_v p_teacher(v) log p_student(v))`` with α = ``--kd_coef``
(``tidal.algorithms.distill.kd_loss``), summed and divided by the step's trained-token count, as
SFT. Teacher and student must share the tokenizer: the data are tokenized once, with the
student's. ``--teacher_offload`` keeps the teacher in CPU memory between its forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tidal.algorithms.distill import distillation_cross_entropy, kd_loss
from tidal.algorithms.logprobs import entropy_from_logits
from tidal.config.supervised import KDConfig as KDConfig
from tidal.config.supervised import KDRun as KDRun
from tidal.data import next_token_targets
from tidal.distributed import World
from tidal.models import Precision, model_inputs
from tidal.models.frozen import FrozenModel, load_frozen
from tidal.trainers.common import Recipe, fit_recipe
from tidal.trainers.reference import check_same_vocab, moe_aux_term, moe_router_logits
from tidal.trainers.sft import SFTBatching, load_sft_samples


@dataclass
class KDObjective(SFTBatching):
    """``kd_loss`` summed over trained tokens, divided by the step's trained-token count."""

    teacher: FrozenModel
    pad_id: int
    alpha: float
    packing: bool = False
    aux_loss_coef: float = 0.0

    def teacher_logits(self, batch: dict, precision: Precision) -> torch.Tensor:
        with self.teacher.use() as teacher, precision.autocast():
            return teacher(**model_inputs(teacher, batch), use_cache=False).logits

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        with precision.autocast(), moe_router_logits(model, self.aux_loss_coef) as router_logits:
            outputs = model(**model_inputs(model, batch), use_cache=False)
        student, teacher = outputs.logits, self.teacher_logits(batch, precision)
        targets = next_token_targets(batch["input_ids"], batch["loss_mask"])
        per_token = kd_loss(student, teacher, targets, alpha=self.alpha)
        loss = per_token.sum() / normaliser
        metrics = {"loss": loss.detach()}
        with torch.no_grad():
            # KL(p_teacher || p_student) = cross-entropy − teacher entropy: what distillation minimises.
            trained = targets != -100
            kl = distillation_cross_entropy(student, teacher) - entropy_from_logits(teacher)
            metrics["teacher_kl"] = kl[trained].sum() / normaliser
        # A dense model has no router: its load-balancing loss is 0 (as SFT and PPO; docs/openrlhf.md).
        share = float(trained.sum()) / normaliser
        aux = moe_aux_term(model, router_logits, batch, self.aux_loss_coef, share, dense_is_zero=True)
        if aux is not None:
            loss = loss + aux
            metrics["aux_loss"] = aux.detach()
        return loss, metrics


class KDRecipe(Recipe):
    label = "KD"
    load_samples = staticmethod(load_sft_samples)

    def load_frozen(self, run: KDRun, model: nn.Module, world: World) -> FrozenModel:
        kd = run.kd
        teacher = load_frozen(
            kd.teacher_model, run.model, kd.teacher_offload, run.dist, world, "--teacher_model"
        )
        check_same_vocab(model, teacher.model, f"--teacher_model {kd.teacher_model}")
        return teacher

    def objective(self, run: KDRun, tokenizer, train, frozen: FrozenModel) -> KDObjective:
        return KDObjective(
            frozen, tokenizer.pad_token_id, run.kd.kd_coef, run.train.packing_samples, run.model.aux_loss_coef
        )

    def describe(self, run: KDRun, frozen: FrozenModel) -> str:
        return f" (teacher {run.kd.teacher_model})"


def run_kd(run: KDRun, world: World | None = None) -> list[dict]:
    """Distil ``--teacher_model`` into ``--pretrain`` on SFT data; returns per-step metrics."""
    return fit_recipe(KDRecipe(), run, world)
