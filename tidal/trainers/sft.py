"""Supervised fine-tuning: next-token loss on response tokens (all tokens in pretrain mode).

``SFTObjective`` plugs into ``SupervisedTrainer``; ``run_sft`` wires data, model, optimizer and
logging from the component configs (the CLI calls it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from tidal.config import (
    CheckpointConfig,
    DatasetConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from tidal.data import (
    SFTDataConfig,
    SFTSample,
    build_sft_samples,
    collate_packed,
    collate_padded,
    load_dataset_spec,
)
from tidal.distributed import World, init_world, parallelize
from tidal.logging import LoggingConfig, get_logger
from tidal.models import Precision, load_causal_lm, load_tokenizer, token_logprobs
from tidal.trainers.loop import Optimization, SupervisedTrainer
from tidal.trainers.optim import build_optimizer, build_scheduler

log = get_logger(__name__)


@dataclass
class SFTObjective:
    """Sum of −log p over trained tokens, divided by the step's trained-token count."""

    pad_id: int
    packing: bool = False
    aux_loss_coef: float = 0.0

    def weight(self, sample: SFTSample) -> float:
        return float(sum(sample.loss_mask[1:]))

    def collate(self, samples: Sequence[SFTSample]) -> dict:
        batch = (collate_packed if self.packing else collate_padded)(list(samples), self.pad_id)
        batch["num_tokens"] = sum(len(s) for s in samples)
        return batch

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        extra = {"output_router_logits": True} if self.aux_loss_coef > 0 else {}
        with precision.autocast():
            logprobs, outputs = token_logprobs(model, batch, **extra)
        mask = batch["loss_mask"].to(logprobs.dtype)
        nll = -(logprobs * mask).sum()
        loss = nll / normaliser
        metrics = {"loss": loss.detach()}
        if self.aux_loss_coef > 0:
            aux = getattr(outputs, "aux_loss", None)
            if aux is None:
                raise ValueError("--aux_loss_coef > 0 needs a mixture-of-experts model that returns aux_loss")
            # Weight the per-micro-batch aux loss by its share of the step's tokens.
            aux_term = self.aux_loss_coef * aux * (mask.sum() / normaliser)
            loss = loss + aux_term
            metrics["aux_loss"] = aux_term.detach()
        return loss, metrics


@dataclass
class SFTRun:
    """Everything an SFT run is configured by (one small config per component)."""

    model: ModelConfig
    data: SFTDataConfig
    train: TrainConfig
    optim: OptimConfig
    ckpt: CheckpointConfig
    logging: LoggingConfig
    dist: DistributedConfig
    datasets: DatasetConfig
    run_dir: str | None = None


def load_sft_samples(spec: str, probs, split: str, max_samples, tokenizer, cfg: SFTDataConfig, seed: int):
    dataset = load_dataset_spec(spec, probs, split=split, max_samples=max_samples, seed=seed)
    samples, skipped = build_sft_samples(dataset, tokenizer, cfg, source=spec)
    if skipped.count:
        log.warning("%s: %s", spec, skipped.summary())
    return samples


def build_optimization(
    model: nn.Module,
    run_model: ModelConfig,
    optim: OptimConfig,
    dist_cfg: DistributedConfig,
    world: World,
    total_steps: int,
) -> Optimization:
    """Shard the model, then build AdamW, the schedule and the precision policy for it."""
    precision = Precision.create(run_model.param_dtype, world.device)
    model = parallelize(model, dist_cfg, world, precision.dtype)
    optimizer = build_optimizer(model, optim)
    scheduler = build_scheduler(optimizer, optim, total_steps)
    return Optimization(model, optimizer, scheduler, precision, optim.max_norm)


def run_sft(run: SFTRun, world: World | None = None) -> list[dict]:
    """Train a causal LM with SFT as configured; returns per-step metrics."""
    world = world or init_world()
    torch.manual_seed(run.train.seed)
    tokenizer = load_tokenizer(run.model.pretrain, run.model)
    ds = run.datasets
    train = load_sft_samples(
        ds.dataset, ds.dataset_probs, ds.dataset_split, ds.max_samples, tokenizer, run.data, run.train.seed
    )
    evals = None
    if ds.eval_dataset:
        evals = load_sft_samples(
            ds.eval_dataset, None, ds.eval_split, None, tokenizer, run.data, run.train.seed
        )
    run.train.micro_steps_per_step(world.world_size)  # validates the batch arithmetic early
    steps = (len(train) // run.train.train_batch_size) * run.train.max_epochs
    if steps == 0:
        raise ValueError(
            f"--dataset {ds.dataset}: {len(train)} usable samples is fewer than one --train_batch_size "
            f"({run.train.train_batch_size})"
        )
    model = load_causal_lm(run.model, world.device)
    opt = build_optimization(model, run.model, run.optim, run.dist, world, steps)
    objective = SFTObjective(tokenizer.pad_token_id, run.train.packing_samples, run.model.aux_loss_coef)
    run_dir = Path(run.run_dir or Path(run.ckpt.save_path) / "run")
    log.info(
        "SFT: %d train samples, %d steps, device %s x%d", len(train), steps, world.device, world.world_size
    )
    trainer = SupervisedTrainer(
        objective, opt, tokenizer, world, run.train, run.ckpt, run.logging, run_dir, run_config=_flat(run)
    )
    return trainer.fit(train, evals)


def _flat(run: SFTRun) -> dict:
    return {k: v for k, v in asdict(run).items()}
