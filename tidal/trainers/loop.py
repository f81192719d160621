"""The supervised training loop shared by SFT, reward-model, DPO, KTO and distillation trainers.

A trainer supplies an ``Objective`` (how to collate samples and compute the loss); the loop does
the rest: deterministic data order, gradient accumulation, clipping, the LR schedule, evaluation,
logging, checkpoints and exact resume.

Loss normalisation. Every objective divides its summed loss by ``normaliser``, the number of
units (tokens for SFT, pairs for DPO) in the *whole optimizer step across all devices*, divided by
the device count (gradients are averaged over devices). So splitting a step into micro-batches or
devices never changes the update, and each metric an objective returns is a contribution that
sums (over micro-batches and devices) to the step's mean.

Faults. A step whose loss or gradient norm is not finite is skipped and counted
(``train/nonfinite_steps``); ``--max_nonfinite_steps`` such steps in a row stop the run
(``tidal.trainers.optim.NonFiniteGuard``). SIGTERM/SIGINT finish the current step, write a
checkpoint when ``--save_steps`` checkpointing is on, and raise ``TrainingInterrupted``
(``tidal.checkpoint.interrupt``). Resume, checkpoints, their rotation and the exports go through one
``tidal.checkpoint.Checkpointer``, which records the trainer and model they belong to.

Ring attention (``--ring_attn_size N``). Each rank keeps its own share of the data; the ranks of a
ring group take turns (``tidal.models.ring_attention.turns``): for every micro-batch of every rank of
the group, all N ranks run its forward and backward together, each over its chunk of the sequence.
Every rank of the group computes the same loss for that micro-batch and keeps the gradient of its
chunk, so the ring's gradients sum to the micro-batch's, and only the owner counts the loss and
metrics: normalisers, metrics and the update are those of plain data parallelism. The ranks may hold
different numbers of micro-batches (even none): the gradients are synchronised on the ring's final
turn (``Turns.total``, the sum of the ranks' counts), and every rank reduces the same metric keys.

Evaluation covers every eval sample exactly once on any number of devices, whatever the eval set's
size (>= 1): device ``r`` takes samples ``r, r + D, ...``, so shares differ by one sample and a rank
may hold none. Every rank still runs as many forwards as the rank with the most micro-batches
(``even_micro_batches``: the shortfall is filled with uncounted forwards of the eval set's first
sample), because each forward of an FSDP2 model all-gathers its parameters with every rank, and the
metric keys are unioned over ranks before the reduction; the metrics are those of one process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from tidal.checkpoint import Checkpointer, LoopState, StopSignals, flat_settings
from tidal.config import CheckpointConfig, TrainConfig
from tidal.distributed.collectives import all_gather_objects, max_over_world
from tidal.distributed.fsdp import set_gradient_sync
from tidal.distributed.tensor_parallel import clip_grad_norm
from tidal.distributed.world import World
from tidal.logging import LoggingConfig, MetricsLogger, ProgressBar, Throughput, get_logger
from tidal.models.precision import Precision
from tidal.models.ring_attention import active_ring, turns
from tidal.trainers.data_position import DataPosition, epoch_batches, resume_offset
from tidal.trainers.optimization import Optimization

log = get_logger(__name__)

T = TypeVar("T")


class Objective(Protocol):
    """What a supervised trainer plugs into the loop."""

    def weight(self, sample: Any) -> float:
        """Normalisation units in one sample (e.g. its trained tokens)."""

    def collate(self, samples: Sequence[Any]) -> dict:
        """Tensors for one micro-batch (on the CPU; the loop moves them)."""

    def loss(self, model: nn.Module, batch: dict, normaliser: float, precision: Precision):
        """``(loss, metrics)`` with loss already divided by ``normaliser``."""


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def note_keys(sums: dict[str, float], metrics: dict) -> None:
    """Give ``sums`` the keys of a micro-batch's ``metrics`` that another rank counts (a ring peer's):
    ``reduce_metrics`` needs the same keys on every rank, and under ring attention a rank may own
    none of the step's micro-batches."""
    for k in metrics:
        sums.setdefault(k, 0.0)


def reduce_metrics(sums: dict[str, float], world: World) -> dict[str, float]:
    """Sum metric contributions over devices and divide by the device count (one collective)."""
    if not world.distributed:
        return dict(sums)
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return {k: v / world.world_size for k, v in zip(keys, t.tolist(), strict=True)}


def with_every_key(sums: dict[str, float], world: World) -> dict[str, float]:
    """``sums`` with a 0 for each key another rank has and this one lacks (one gather of the key
    names), so ``reduce_metrics`` lines up the same keys on every rank whatever each one saw."""
    if not world.distributed:
        return dict(sums)
    keys = set().union(*all_gather_objects(sorted(sums), world))
    return {k: sums.get(k, 0.0) for k in sorted(keys)}


def pad_turns(items: Sequence[Any], count: int, filler: Any) -> list[tuple[bool, Any]]:
    """``(counted, item)`` for each of ``items``, then ``(False, filler)`` up to ``count`` entries."""
    return [(True, item) for item in items] + [(False, filler)] * (count - len(items))


def optimizer_step(opt: Optimization) -> float:
    """Unscale (fp16), clip, step and zero the gradients; returns the pre-clip gradient norm.

    The step is skipped (gradients dropped) when ``opt.guard`` rejects it: the loss given to
    ``opt.guard.observe_loss`` for this step or the gradient norm is not finite. The norm is the
    same on every rank (FSDP reduces it), so all ranks skip together."""
    optimizer, scaler = opt.optimizer, opt.precision.scaler
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in opt.model.parameters() if p.grad is not None]
    max_norm = opt.max_norm if opt.max_norm > 0 else math.inf
    norm = clip_grad_norm(params, max_norm)  # torch's clip, per mesh under tensor parallelism
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    apply = opt.guard.allow(opt.guard.take_loss(), norm, scaled=scaler is not None)
    if apply and scaler:
        scaler.step(optimizer)
        scaler.update()
    elif apply:
        optimizer.step()
    elif scaler:
        scaler.update()  # records the overflow (lowers the scale) without stepping
    optimizer.zero_grad(set_to_none=True)
    return norm


# The summed loss of a step's micro-batches, reduced with the metrics and checked before the update.
STEP_LOSS = "_step_loss"


def backward(loss: torch.Tensor, precision: Precision) -> None:
    (precision.scaler.scale(loss) if precision.scaler else loss).backward()


# Config groups a checkpoint records; resuming with other values warns (see tidal.checkpoint.manager).
SETTINGS = ("model", "datasets", "data", "train", "optim")


class SupervisedTrainer:
    """Runs an ``Objective`` over fixed samples for ``max_epochs``; see the module docstring."""

    def __init__(
        self,
        objective: Objective,
        opt: Optimization,
        tokenizer,
        world: World,
        train_cfg: TrainConfig,
        ckpt_cfg: CheckpointConfig,
        log_cfg: LoggingConfig,
        run_dir: str | Path,
        run_config: dict | None = None,
        kind: str = "supervised",
    ):
        self.objective, self.opt, self.tokenizer, self.world = objective, opt, tokenizer, world
        self.cfg, self.ckpt_cfg, self.log_cfg = train_cfg, ckpt_cfg, log_cfg
        self.run_dir, self.run_config = Path(run_dir), run_config or {}
        self.micro_steps = train_cfg.micro_train_batch_size
        self.position = DataPosition()  # dataset size and samples of the epoch trained, for resume
        self.checkpointer = Checkpointer(
            ckpt_cfg, world, kind, {"model": opt}, flat_settings(self.run_config, SETTINGS),
            state={"nonfinite": opt.guard, "data": self.position}, hf_copy=self.export,
        )  # fmt: skip

    # ---- one optimizer step ------------------------------------------------------------------
    def _micro_batches(self, samples: Sequence[Any]) -> list[Sequence[Any]]:
        size = self.cfg.micro_train_batch_size
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    def _normaliser(self, samples: Sequence[Any]) -> float:
        local = sum(self.objective.weight(s) for s in samples)
        total = reduce_metrics({"w": local}, self.world)["w"] * self.world.world_size
        return max(total, 1e-8) / self.world.world_size

    def train_step(self, samples: Sequence[Any]) -> dict[str, float]:
        """Forward/backward every micro-batch of this device's share, then one optimizer update."""
        model, precision = self.opt.model, self.opt.precision
        model.train()
        normaliser = self._normaliser(samples)
        ring = active_ring()
        micro = [self.objective.collate(mb) for mb in self._micro_batches(samples)]
        schedule = turns(micro, ring)  # under a ring the ranks' counts may differ: sync on the ring's last
        sums: dict[str, float] = {STEP_LOSS: 0.0}
        tokens = 0
        for i, (mine, collated) in enumerate(schedule):
            batch = to_device(collated, self.world.device)
            set_gradient_sync(model, i == schedule.total - 1)
            loss, metrics = self.objective.loss(model, batch, normaliser, precision)
            backward(loss, precision)
            if not mine:  # another rank's micro-batch: it counts the loss and metrics
                note_keys(sums, metrics)
                continue
            tokens += int(batch.get("num_tokens", batch["input_ids"].numel()))
            sums[STEP_LOSS] += float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        stats = reduce_metrics(sums, self.world)  # the loss check must see every rank's loss
        self.opt.guard.observe_loss(stats.pop(STEP_LOSS))
        stats["grad_norm"] = optimizer_step(self.opt)
        stats["nonfinite_steps"] = float(self.opt.guard.skipped)
        stats["lr"] = self.opt.scheduler.get_last_lr()[0]
        stats["tokens"] = reduce_metrics({"t": tokens}, self.world)["t"] * self.world.dp_size
        self.opt.scheduler.step()
        return stats

    def eval_share(self, samples: Sequence[T]) -> Sequence[T]:
        """This device's share of an eval set: every ``dp_size``-th sample from its ``dp_rank``."""
        return samples[self.world.dp_rank :: self.world.dp_size]

    def even_micro_batches(self, share: Sequence[Any], filler: Any) -> list[tuple[bool, dict]]:
        """``(counted, collated)`` micro-batches of ``share``, padded with uncounted micro-batches of
        ``filler`` (one sample) to the most any rank has: an FSDP2 forward all-gathers parameters with
        every rank, so all ranks must run the same number of forwards."""
        micro = self._micro_batches(share)
        most = max_over_world(len(micro), self.world)
        dummy = self.objective.collate([filler]) if len(micro) < most else None
        return pad_turns([self.objective.collate(mb) for mb in micro], most, dummy)

    @torch.no_grad()
    def evaluate(self, samples: Sequence[Any]) -> dict[str, float]:
        """Metrics over all of ``samples`` (this device's share), normalised like training; the same
        as one process's for any eval set size (see the module docstring)."""
        model = self.opt.model
        model.eval()
        share = self.eval_share(samples)
        normaliser = self._normaliser(share)
        sums: dict[str, float] = {}
        for mine, (counted, collated) in turns(self.even_micro_batches(share, samples[0]), active_ring()):
            batch = to_device(collated, self.world.device)
            _, metrics = self.objective.loss(model, batch, normaliser, self.opt.precision)
            if not (mine and counted):  # a ring peer's micro-batch or padding: keys only
                note_keys(sums, metrics)
                continue
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return reduce_metrics(with_every_key(sums, self.world), self.world)

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self, train: Sequence[Any], eval_samples: Sequence[Any] | None = None) -> list[dict]:
        """Train for ``max_epochs``; returns the per-step metrics of this run (for tests and plots)."""
        cfg, world = self.cfg, self.world
        steps_per_epoch = len(train) // cfg.train_batch_size
        ckpt = self.checkpointer
        ckpt.check_space([self.opt.model], self.ckpt_cfg.save_path)  # before training, not after
        resumed = ckpt.resume()
        loop = resumed or LoopState()
        batch, n = cfg.train_batch_size, len(train)
        # a changed batch size or dataset continues after the samples trained (tidal.trainers.data_position)
        saved_batch = ckpt.resumed_setting("train.train_batch_size")
        offset = resume_offset(self.position, loop, n, batch, saved_batch) if resumed else 0
        first_epoch = loop.epoch
        history: list[dict] = []
        resume_step = ckpt.resume_step(loop)
        with (
            MetricsLogger(self.run_dir, self.log_cfg, self.run_config, world.is_main, resume_step) as logger,
            ProgressBar(
                steps_per_epoch * cfg.max_epochs,
                initial=loop.global_step,
                desc="train",
                is_main=world.is_main,
            ) as bar,
            StopSignals() as stop,
        ):
            speed = Throughput()
            for epoch in range(loop.epoch, cfg.max_epochs):
                skip = offset if epoch == first_epoch else 0
                batches = epoch_batches(n, batch, cfg.seed, epoch, world.dp_size, world.dp_rank, skip)
                for index in range(len(batches)):
                    stats = self.train_step([train[i] for i in batches[index]])
                    self.position.samples, self.position.offset = n, skip + (index + 1) * batch
                    loop = LoopState(loop.global_step + 1, epoch, -(-self.position.offset // batch))
                    stats["tokens_per_s"] = speed.update(int(stats["tokens"]))
                    stats["epoch"] = epoch + loop.step_in_epoch / (-(-skip // batch) + len(batches))
                    history.append({"step": loop.global_step, **stats})
                    bar.update(1, loss=stats.get("loss"), lr=stats["lr"], tok_s=stats["tokens_per_s"])
                    if self.log_cfg.should_log(loop.global_step):
                        logger.log(loop.global_step, stats)
                    self._maybe_eval(eval_samples, loop, logger, end_of_epoch=index + 1 == len(batches))
                    ckpt.maybe_save(loop)
                    signum = stop.requested(world)
                    if signum:
                        raise ckpt.stopped(signum, loop)
                loop = LoopState(loop.global_step, epoch + 1, 0)
            self.export(self.ckpt_cfg.save_path, final=True)
        return history

    def export(self, path: str | Path, final: bool = False) -> Path:
        """The trained model and tokenizer as a Hugging Face folder at ``path`` (``final``: rescued
        to a temporary folder, named in the error, when ``path`` has no room)."""
        return self.checkpointer.export(self.opt.model, self.tokenizer, path, self.export_config(), final)

    def export_config(self) -> dict | None:
        """Extra fields written into the exported model's config (reward models add normalisation)."""
        return None

    def _maybe_eval(self, eval_samples, loop: LoopState, logger: MetricsLogger, end_of_epoch: bool) -> None:
        if not eval_samples:
            return
        every = self.cfg.eval_steps
        if (every > 0 and loop.global_step % every == 0) or (every <= 0 and end_of_epoch):
            metrics = self.evaluate(eval_samples)
            logger.log(loop.global_step, metrics, prefix="eval")
            log.info("eval @ step %d: %s", loop.global_step, {k: round(v, 4) for k, v in metrics.items()})
