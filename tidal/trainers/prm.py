"""Process-reward-model training (step-level supervision; Lightman et al., arXiv 2305.20050).

A causal LM learns to predict, at every step-marker token, the reward token of that step's label
(``tidal.algorithms.prm.prm_loss``: cross-entropy over the ``--reward_tokens`` logits, hard or soft
labels; over the whole vocabulary without ``--reward_tokens``). The loss is normalised by the step's
count of labelled steps; metrics are the loss and the step accuracy. The result is a plain causal-LM
HF folder: its reward for a step is the probability of the first reward token at the marker.

Under ``--ring_attn_size`` (packed rows) each rank of the ring group runs the model on its chunk of the
row; the head runs only at the chunk's step markers (the ``--use_liger_kernel`` path), and the
``[steps, reward tokens]`` logits of every chunk are all-gathered (``ring_attention.gather_rows``), so
every rank computes the loss of the whole row, as one process does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tidal.algorithms.prm import prm_loss
from tidal.config.supervised import PRMRun as PRMRun
from tidal.data.prm import PRMDataConfig, PRMSample, build_prm_samples, collate_prm, reward_token_ids
from tidal.distributed import World
from tidal.models import Precision, model_inputs
from tidal.models.forward import RingChunk, ring_chunk
from tidal.models.logprob_head import chunkable_head, head_output
from tidal.models.ring_attention import gather_rows
from tidal.trainers.common import Recipe, fit_recipe, load_samples


@dataclass
class PRMObjective:
    """Summed step cross-entropy divided by the optimizer step's number of labelled steps."""

    pad_id: int
    reward_ids: list[int] | None  # None: every vocabulary id (hard labels are token ids)
    packing: bool = False
    fused_head: bool = False  # --use_liger_kernel: the head runs only at step markers, on the reward rows

    def weight(self, sample: PRMSample) -> float:
        return float(len(sample.step_positions))

    def collate(self, samples: Sequence[PRMSample]) -> dict:
        batch = collate_prm(list(samples), self.pad_id, self.packing)
        batch["num_tokens"] = sum(len(s) for s in samples)
        return batch

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        mask = batch["placeholder_mask"]
        chunk = ring_chunk(batch)
        head = chunkable_head(model) if self.fused_head or chunk is not None else None
        if chunk is None and head is None:
            with precision.autocast():
                logits = model(**model_inputs(model, batch), use_cache=False).logits
            ids = self.reward_ids if self.reward_ids is not None else range(logits.shape[-1])
            loss, accuracy = prm_loss(logits, mask, batch["labels"], ids, num_steps=normaliser)
        else:
            logits = self.step_logits(model, batch, chunk, head, precision)
            selected = mask.bool()
            every = torch.ones(1, logits.shape[0], dtype=torch.bool, device=logits.device)
            labels = batch["labels"][selected][None]
            loss, accuracy = prm_loss(
                logits[None], every, labels, range(logits.shape[-1]), num_steps=normaliser
            )
        steps = mask.sum()
        return loss, {"loss": loss.detach(), "acc": accuracy * steps / normaliser}

    def step_logits(
        self,
        model: nn.Module,
        batch: dict,
        chunk: RingChunk | None,
        head: nn.Linear | None,
        precision: Precision,
    ) -> torch.Tensor:
        """``[steps, reward tokens]``: the only logits the loss reads, in row order. The head runs only at
        the step markers (on the reward tokens' rows) when it can be swapped, else the full logits are
        cut. Under ring attention each rank computes its chunk's steps and they are gathered."""
        mask = batch["placeholder_mask"] if chunk is None else chunk.local(batch["placeholder_mask"])
        selected, rows = mask.bool(), self.reward_ids
        inputs = model_inputs(model, batch) if chunk is None else chunk.model_kwargs(model)
        if head is None:  # a model whose head cannot be swapped (under ring attention only)
            with precision.autocast():
                logits = model(**inputs, use_cache=False).logits[selected]
            logits = logits if rows is None else logits[:, rows]
        else:

            def at_steps(hidden):
                weight = head.weight if rows is None else head.weight[rows]
                bias = head.bias if head.bias is None or rows is None else head.bias[rows]
                return nn.functional.linear(hidden[selected], weight, bias)

            with precision.autocast(), head_output(head, at_steps):
                logits = model(**inputs, use_cache=False).logits
        if chunk is None:
            return logits
        return gather_rows(logits, chunk.counts(batch["placeholder_mask"]), chunk.ring)


def load_prm_samples(spec: str, probs, split: str, max_samples, tokenizer, cfg: PRMDataConfig, seed: int):
    """PRM samples of a ``--dataset``-style spec (skipped rows are logged)."""
    return load_samples(build_prm_samples, spec, probs, split, max_samples, tokenizer, cfg, seed)


class PRMRecipe(Recipe):
    label = "PRM"
    load_samples = staticmethod(load_prm_samples)

    def objective(self, run: PRMRun, tokenizer, train, frozen) -> PRMObjective:
        return PRMObjective(
            tokenizer.pad_token_id, reward_token_ids(tokenizer, run.data), run.train.packing_samples,
            fused_head=run.kernels.use_liger_kernel,
        )  # fmt: skip


def run_prm(run: PRMRun, world: World | None = None) -> list[dict]:
    """Train a process reward model as configured; returns per-step metrics."""
    return fit_recipe(PRMRecipe(), run, world)
