"""Reward-model training on preference pairs (Bradley–Terry; InstructGPT, arXiv 2203.02155).

``RMObjective`` scores the chosen and rejected sequences of each pair with the value model
(``tidal.models.value_model``: the head's value at the last token) and applies a pairwise loss from
``RM_LOSSES``. Metrics: loss, accuracy (chosen scored above rejected), mean reward gap and mean
chosen/rejected rewards; the eval set gets the same ones under ``eval/``.

As in OpenRLHF v0.9.2's ``train_rm``:

- ``--margin_loss``: the sigmoid loss subtracts each pair's ``margin`` (a dataset column, as Llama 2):
  −log σ(r_c − r_r − margin). Every row must then have a numeric margin (a row without one is a
  one-line ``DataError`` naming the file and row; OpenRLHF silently uses 0). Without the flag the
  column is not used. ``--loss logexp`` has no margin term, so the two together are refused.
- ``--compute_fp32_loss``: the loss is computed on float32 rewards; without it, on the rewards
  rounded to the model's compute dtype (``--param_dtype``; float32 on the CPU, where both agree).

``--normalize_reward``: after training, the mean and standard deviation of the model's rewards (chosen
and rejected) over the eval set, or the training set without one, are written into the saved
config (``mean``, ``std``); loading the model with ``--normalize_reward`` (PPO, ``serve_rm``) then
returns ``(reward − mean) / std``. The final folder loads with ``AutoModelForSequenceClassification``.

Under ``--ring_attn_size`` (packed pairs) the value model's per-token values are computed chunk by
chunk over the ring group and gathered into the whole row (``ValueHeadMixin.values``), so each
sequence's last-token reward is read as with one process; the ring group takes turns over its ranks'
micro-batches (``SupervisedTrainer``), for training, evaluation and the reward statistics alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from tidal.algorithms.preference import RM_LOSSES
from tidal.config.supervised import RMConfig as RMConfig
from tidal.config.supervised import RMRun as RMRun
from tidal.data.errors import DataError
from tidal.data.pairs import PairDataConfig, PairSample, build_pair_samples, collate_pairs, identical_pairs
from tidal.distributed import World
from tidal.logging import get_logger
from tidal.models import Precision
from tidal.models.ring_attention import active_ring, turns
from tidal.models.value_model import load_value_model, reward_config
from tidal.models.vision import is_vision_language
from tidal.models.vision_value import load_vision_value_model
from tidal.trainers.common import Recipe, fit_recipe, load_samples
from tidal.trainers.loop import SupervisedTrainer, reduce_metrics, to_device

log = get_logger(__name__)


@dataclass
class RMObjective:
    """Pairwise loss summed over pairs, divided by the step's pair count; with ``margin_loss`` each
    pair's margin enters the loss, with ``fp32_loss`` it is computed on float32 rewards (else on the
    rewards rounded to the compute dtype, as OpenRLHF's bf16 reward model gives them)."""

    pad_id: int
    loss_fn: Callable[..., torch.Tensor]
    packing: bool = False
    margin_loss: bool = False
    fp32_loss: bool = False

    def weight(self, sample: PairSample) -> float:
        return 1.0

    def collate(self, samples: Sequence[PairSample]) -> dict:
        batch = collate_pairs(list(samples), self.pad_id, self.packing)
        batch["num_tokens"] = sum(len(s.chosen_ids) + len(s.rejected_ids) for s in samples)
        return batch

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        with precision.autocast():
            rewards = model.scores(batch)
        loss_rewards = rewards.to(torch.float32 if self.fp32_loss else precision.dtype)
        per_pair = self.loss_fn(*loss_rewards.chunk(2), batch["margin"] if self.margin_loss else None)
        loss = per_pair.sum() / normaliser
        chosen, rejected = rewards.float().chunk(2)  # metrics in float32 either way
        gap = (chosen - rejected).detach()
        metrics = {
            "loss": loss.detach(),
            "acc": (gap > 0).float().sum() / normaliser,
            "reward_gap": gap.sum() / normaliser,
            "chosen_reward": chosen.detach().sum() / normaliser,
            "rejected_reward": rejected.detach().sum() / normaliser,
        }
        return loss, metrics


class RewardModelTrainer(SupervisedTrainer):
    """The supervised loop, exporting the value-head name, pad id and (optionally) reward statistics."""

    def __init__(self, *args, stats_samples: Sequence[PairSample] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.stats_samples = stats_samples  # the pairs whose reward mean/std are saved (--normalize_reward)

    def export_config(self) -> dict:
        mean = std = None
        if self.stats_samples:
            mean, std = self.reward_stats(self.stats_samples)
            log.info("reward normalisation: mean %.4f, std %.4f", mean, std)
        return reward_config(self.opt.model, self.tokenizer, mean, std)

    @torch.no_grad()
    def reward_stats(self, samples: Sequence[PairSample]) -> tuple[float, float]:
        """Mean and (unbiased) std of the rewards of every chosen and rejected sequence, all devices."""
        model, world = self.opt.model, self.world
        was_training = model.training
        model.eval()
        sums = {"n": 0.0, "s": 0.0, "ss": 0.0}
        # Every rank runs as many forwards as the one with the most micro-batches (FSDP2 all-gathers).
        micro = self.even_micro_batches(self.eval_share(samples), samples[0])
        for mine, (counted, collated) in turns(micro, active_ring()):  # a ring group scores each rank's pairs
            with self.opt.precision.autocast():
                r = model.scores(to_device(collated, world.device)).double()
            if not (mine and counted):
                continue
            sums["n"] += r.numel()
            sums["s"] += r.sum().item()
            sums["ss"] += r.pow(2).sum().item()
        model.train(was_training)
        total = {k: v * world.dp_size for k, v in reduce_metrics(sums, world).items()}
        mean = total["s"] / total["n"]
        var = max(total["ss"] - total["n"] * mean**2, 0.0) / max(total["n"] - 1, 1)
        return mean, math.sqrt(var) if var > 0 else 1.0


def load_pair_samples(
    spec: str, probs, split: str, max_samples, tokenizer, cfg: PairDataConfig, seed: int, images=None
):
    """Preference pairs of a ``--dataset``-style spec (skipped pairs are logged, identical ones checked;
    ``images``: with their prompts' images)."""
    samples = load_samples(build_pair_samples, spec, probs, split, max_samples, tokenizer, cfg, seed, images)
    return check_identical_pairs(samples, spec, cfg)


def load_margin_pair_samples(
    spec: str, probs, split: str, max_samples, tokenizer, cfg, seed: int, images=None
):
    """Like ``load_pair_samples``, but every row must have a numeric ``margin`` (``--margin_loss``)."""
    builder = partial(build_pair_samples, require_margin=True)
    samples = load_samples(builder, spec, probs, split, max_samples, tokenizer, cfg, seed, images)
    return check_identical_pairs(samples, spec, cfg)


def check_identical_pairs(samples: list[PairSample], spec: str, cfg: PairDataConfig) -> list[PairSample]:
    """Refuse pairs that are all identical (chosen == rejected after rendering: nothing to learn, the
    loss would sit still with a zero gradient); warn, naming how many and which rows, when some are."""
    rows = identical_pairs(samples)
    keys = f"--chosen_key {cfg.chosen_key} / --rejected_key {cfg.rejected_key}"
    if rows and len(rows) == len(samples):
        raise DataError(
            f"{spec}: chosen and rejected are identical in all {len(rows)} pairs ({keys}): there is no "
            "preference to learn; check the keys or the data"
        )
    if rows:
        log.warning(
            "%s: chosen and rejected are identical in %d of %d pairs (rows %s%s): they carry no preference "
            "and only dilute the others", spec, len(rows), len(samples), ", ".join(map(str, rows[:10])),
            ", ..." if len(rows) > 10 else "",
        )  # fmt: skip
    return samples


def _warn_unused_margins(run: RMRun, train: Sequence[PairSample]) -> None:
    if not run.rm.margin_loss and any(s.margin != 0 for s in train):
        log.warning("the dataset's margin column is not used without --margin_loss (as in OpenRLHF)")


class RMRecipe(Recipe):
    label = "RM"
    trainer_cls = RewardModelTrainer

    def __init__(self, margin_loss: bool = False):
        # --margin_loss requires the margin in every row, so it picks the sample loader.
        self.load_samples = load_margin_pair_samples if margin_loss else load_pair_samples

    def load_model(self, run: RMRun, world: World) -> nn.Module:
        if is_vision_language(run.model.pretrain):  # transformers has no sequence-classification VLMs
            return load_vision_value_model(run.model, world.device, run.rm.value_head_prefix)
        return load_value_model(run.model, world.device, run.rm.value_head_prefix)

    def objective(self, run: RMRun, tokenizer, train, frozen) -> RMObjective:
        _warn_unused_margins(run, train)
        rm = run.rm
        return RMObjective(
            tokenizer.pad_token_id, RM_LOSSES[rm.loss], run.train.packing_samples, rm.margin_loss,
            rm.compute_fp32_loss,
        )  # fmt: skip

    def trainer_kwargs(self, run: RMRun, train, evals) -> dict:
        return {"stats_samples": (evals or train) if run.rm.normalize_reward else None}


def run_rm(run: RMRun, world: World | None = None) -> list[dict]:
    """Train a reward model as configured; returns per-step metrics."""
    return fit_recipe(RMRecipe(run.rm.margin_loss), run, world)
