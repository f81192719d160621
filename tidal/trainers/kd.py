"""Knowledge distillation: train a student on SFT data to match a frozen teacher's next-token
distributions (Hinton et al., arXiv 1503.02531), mixed with the usual LM loss.

Per trained token: ``(1 − α)·LM + α·(−Σ_v p_teacher(v) log p_student(v))`` with α = ``--kd_coef``
(``tidal.algorithms.distill.kd_loss``), summed and divided by the step's trained-token count, as
SFT. Teacher and student must share the tokenizer: the data are tokenized once, with the
student's. ``--teacher_offload`` keeps the teacher in CPU memory between its forwards.

Under ``--ring_attn_size`` (packed rows) the student and the teacher both run on this rank's chunk of
the row as ring attention; the loss is token-wise, so each rank computes its chunk's per-token loss
and KL and only those ``[T]`` values are all-gathered into the whole row (never the logits): every
rank then sums the same row, as one process does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from tidal.algorithms.distill import distillation_cross_entropy, kd_loss
from tidal.algorithms.logprobs import entropy_from_logits
from tidal.config.supervised import KDConfig as KDConfig
from tidal.config.supervised import KDRun as KDRun
from tidal.data import IGNORE_INDEX, next_token_targets
from tidal.distributed import World
from tidal.models import Precision, model_inputs
from tidal.models.forward import ring_chunk
from tidal.models.frozen import FrozenModel, load_frozen
from tidal.models.logprob_head import DEFAULT_CHUNK, chunkable_head, chunked_rows, head_output
from tidal.trainers.common import Recipe, fit_recipe
from tidal.trainers.reference import check_same_vocab, moe_aux_term, moe_router_logits
from tidal.trainers.sft import SFTBatching, load_sft_samples

# A model's forward keyword arguments for the tokens of this forward (``model_inputs`` of the batch, or
# ``RingChunk.model_kwargs`` of this rank's chunk).
Inputs = Callable[[nn.Module], dict]


@dataclass
class KDObjective(SFTBatching):
    """``kd_loss`` summed over trained tokens, divided by the step's trained-token count."""

    teacher: FrozenModel
    pad_id: int
    alpha: float
    packing: bool = False
    aux_loss_coef: float = 0.0
    fused_head: bool = False  # --use_liger_kernel: the student's head runs chunk by chunk inside the loss

    def teacher_logits(self, inputs: Inputs, precision: Precision) -> torch.Tensor:
        with self.teacher.use() as teacher, precision.autocast():
            return teacher(**inputs(teacher), use_cache=False).logits

    def per_token(self, model: nn.Module, inputs: Inputs, precision: Precision, targets: torch.Tensor):
        """``(kd_loss [B, T], KL(teacher ‖ student) [B, T], detached)`` of the tokens ``inputs(model)``
        feeds a model (the micro-batch, or this rank's chunk of it under ring attention)."""
        head = chunkable_head(model) if self.fused_head else None
        if head is None:
            with precision.autocast():
                student = model(**inputs(model), use_cache=False).logits
            teacher = self.teacher_logits(inputs, precision)
            per_token = kd_loss(student, teacher, targets, alpha=self.alpha)
            with torch.no_grad():
                kl = distillation_cross_entropy(student, teacher) - entropy_from_logits(teacher)
            return per_token, kl
        teacher = self.teacher_logits(inputs, precision)  # first: the student's head consumes it

        def chunk(h, teacher_chunk, target_chunk):
            z = nn.functional.linear(h, head.weight, head.bias)
            loss = kd_loss(z[None], teacher_chunk[None], target_chunk[None], alpha=self.alpha)[0]
            with torch.no_grad():
                kl = distillation_cross_entropy(z, teacher_chunk) - entropy_from_logits(teacher_chunk)
            return loss, kl

        def fused(hidden):
            flat = hidden.reshape(-1, hidden.shape[-1])
            rows = (flat, teacher.reshape(flat.shape[0], -1), targets.reshape(-1))
            return torch.stack(chunked_rows(chunk, DEFAULT_CHUNK, *rows))

        with precision.autocast(), head_output(head, fused):
            per_token, kl = model(**inputs(model), use_cache=False).logits
        return per_token.view(targets.shape), kl.view(targets.shape).detach()

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        targets = next_token_targets(batch["input_ids"], batch["loss_mask"])
        chunk = ring_chunk(batch)
        with moe_router_logits(model, self.aux_loss_coef) as router_logits:
            if chunk is None:
                per_token, kl = self.per_token(model, partial(model_inputs, batch=batch), precision, targets)
            else:  # token-wise: each rank's chunk, then the whole row's [T] values (no logits travel)
                local = self.per_token(
                    model, chunk.model_kwargs, precision, chunk.local(targets, IGNORE_INDEX)
                )
                per_token, kl = (chunk.whole(t) for t in local)
        loss = per_token.sum() / normaliser
        metrics = {"loss": loss.detach()}
        # KL(p_teacher || p_student) = cross-entropy − teacher entropy: what distillation minimises.
        trained = targets != -100
        metrics["teacher_kl"] = kl[trained].sum() / normaliser
        # A dense model has no router: its load-balancing loss is 0 (as SFT and PPO; docs/openrlhf.md).
        share = float(trained.sum()) / normaliser
        aux = moe_aux_term(model, router_logits, batch, self.aux_loss_coef, share)
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
            frozen, tokenizer.pad_token_id, run.kd.kd_coef, run.train.packing_samples, run.model.aux_loss_coef,
            fused_head=run.kernels.use_liger_kernel,
        )  # fmt: skip

    def describe(self, run: KDRun, frozen: FrozenModel) -> str:
        return f" (teacher {run.kd.teacher_model})"


def run_kd(run: KDRun, world: World | None = None) -> list[dict]:
    """Distil ``--teacher_model`` into ``--pretrain`` on SFT data; returns per-step metrics."""
    return fit_recipe(KDRecipe(), run, world)
