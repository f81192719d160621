"""What the trainers that run on ``SupervisedTrainer`` (SFT, RM, PRM, DPO, KTO, KD) share: the run
base (``SupervisedRun``, defined in ``tidal.config.supervised``), the build recipe (``Recipe`` +
``fit_recipe``), and the wiring both use (loading a dataset spec into samples, the step-count check,
the optimizer stack, the run folder).

A trainer module holds only what is specific to it: its objective, its data, its configs (its run
extends ``SupervisedRun``; the configs live in ``tidal.config.supervised``) and a ``Recipe`` subclass
saying how its samples, model, frozen models and objective are built; ``fit_recipe`` does the rest, in
the same order for every trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from tidal.config import (
    CheckpointConfig,
    ConfigError,
    DatasetConfig,
    TrainConfig,
)
from tidal.config.supervised import SupervisedRun as SupervisedRun
from tidal.config.supervised import ring_problems as ring_problems
from tidal.config.supervised import trainer_kind
from tidal.distributed import World, init_world
from tidal.distributed.mesh import ring_group
from tidal.distributed.tensor_parallel import with_tensor_parallel
from tidal.logging import get_logger
from tidal.models import load_causal_lm, load_tokenizer
from tidal.models.ring_attention import head_stride_problem, use_ring
from tidal.models.vision import freeze_vision, is_vision_language
from tidal.rollout.models.registry import FAMILIES, VISION_FAMILIES, feature_refusal
from tidal.trainers.loop import Objective, SupervisedTrainer
from tidal.trainers.optimization import build_optimization

log = get_logger(__name__)

# builder(dataset, tokenizer, cfg, source=...) -> (samples, SkipStats), e.g. build_sft_samples
SampleBuilder = Callable[..., tuple[list, object]]
# loader(spec, probs, split, max_samples, tokenizer, data_cfg, seed) -> samples, e.g. load_sft_samples
SampleLoader = Callable[..., list]


def load_samples(
    builder: SampleBuilder, spec: str, probs, split: str, max_samples, tokenizer, cfg, seed: int, images=None
):
    """Load a ``--dataset``-style spec and build its samples; skipped rows are logged. ``images`` (a
    ``tidal.data.vision.ImageSamples``) checks every row's images first and gives the samples theirs."""
    # here, not at the top: ``datasets`` (with pandas, pyarrow) costs ~1 s of start-up, and processes
    # that import this module without loading data (a trainer's worker processes) pay nothing for it
    from tidal.data import load_dataset_spec

    if images is not None:
        builder = images.wrap(builder)
    dataset = load_dataset_spec(spec, probs, split=split, max_samples=max_samples, seed=seed)
    samples, skipped = builder(dataset, tokenizer, cfg, source=spec)
    if skipped.count:
        log.warning("%s: %s", spec, skipped.summary())
    return samples


def train_and_eval_samples(load: Callable, ds: DatasetConfig, tokenizer, cfg, seed: int, **extra):
    """``(train, eval or None)`` samples with ``load(spec, probs, split, max_samples, tokenizer, cfg, seed)``
    (and the ``extra`` keyword arguments: a vision run's ``images``)."""
    train = load(
        ds.dataset, ds.dataset_probs, ds.dataset_split, ds.max_samples, tokenizer, cfg, seed, **extra
    )
    evals = (
        load(ds.eval_dataset, None, ds.eval_split, None, tokenizer, cfg, seed, **extra)
        if ds.eval_dataset
        else None
    )
    return train, evals


def run_images(run: Any, tokenizer):
    """A run's ``ImageSamples`` (runs with a ``vision`` config: SFT, DPO, RM), else None: the model's
    image processor when it is a vision-language model, the image flags checked against it."""
    cfg = getattr(run, "vision", None)
    if cfg is None:
        return None
    from tidal.data.vision import ImageSamples, load_vision_processor

    try:
        processor = load_vision_processor(run.model.pretrain, tokenizer)
    except ConfigError:
        if cfg.max_images_per_prompt > 0:
            raise
        processor = None  # a VLM whose processor tidal cannot use trains on text as before
    images = ImageSamples(cfg, processor)
    vision_model = processor is not None or is_vision_language(run.model.pretrain)
    images.check(run.model.pretrain, vision_model, run.dist.ring_attn_size, run.dist.ds_tensor_parallel_size)
    return images


# Layer kinds (``config.layer_types``) whose state runs along the whole row rather than attending within
# each packed sample's own segment.
RECURRENT_LAYER_WORDS = ("linear", "mamba", "conv", "ssm", "recurrent")


def packing_problem(pretrain: str) -> str | None:
    """Why packed rows cannot train ``pretrain``'s family (None: they can). Packing keeps samples apart by
    masking attention; a recurrent layer (Gated DeltaNet, Mamba) would carry one sample's state into the
    next. The engine's registry says so for its families (``packing_samples`` refusals); a family outside
    it is refused when its config declares such layers."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(pretrain)
    except Exception:  # not a readable folder: loading the model reports it, in its own words
        return None
    model_type = getattr(config, "model_type", None)
    if problem := feature_refusal(model_type, "packing_samples"):
        return problem
    if model_type in FAMILIES or model_type in VISION_FAMILIES:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = {str(kind) for kind in getattr(text, "layer_types", None) or ()}
    recurrent = sorted(k for k in kinds if any(word in k for word in RECURRENT_LAYER_WORDS))
    if recurrent:
        return (
            f"packing_samples is not supported for the {model_type} family: its {', '.join(recurrent)} layers "
            "would carry one packed sample's state into the next"
        )
    return None


def training_steps(n_samples: int, train: TrainConfig, world: World, dataset: str) -> int:
    """Optimizer steps of the run; fails early on batch arithmetic or too little data."""
    train.micro_steps_per_step(world.dp_size)  # validates the batch arithmetic early
    steps = (n_samples // train.train_batch_size) * train.max_epochs
    if steps == 0:
        raise ConfigError(
            f"--dataset {dataset}: {n_samples} usable samples is fewer than one --train_batch_size "
            f"({train.train_batch_size})"
        )
    return steps


def run_folder(run_dir: str | None, ckpt: CheckpointConfig) -> Path:
    """Where metrics and the run config go (``<save_path>/run`` unless the run names one)."""
    return Path(run_dir or Path(ckpt.save_path) / "run")


def flat_config(run) -> dict:
    """The run's configs as one plain dict, recorded with the metrics."""
    return dict(asdict(run))


def seed_everything(train: TrainConfig) -> None:
    """Seed Python, numpy and torch; ``--full_determinism`` also forces deterministic kernels."""
    import os
    import random

    import numpy as np
    import torch

    random.seed(train.seed)
    np.random.seed(train.seed)
    torch.manual_seed(train.seed)
    if train.full_determinism:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


class Recipe(ABC):
    """How one supervised trainer builds its run: ``fit_recipe`` calls these hooks in a fixed order.

    A subclass sets ``label`` and ``load_samples`` and defines ``objective``; the other hooks default
    to a causal LM policy, no frozen models and the plain ``SupervisedTrainer`` (a subclass of it is
    where a trainer changes the step, e.g. KTO's KL estimate, or the export, e.g. RM's ``export_config``).
    """

    label: ClassVar[str]  # names the trainer in the start-up log line
    load_samples: ClassVar[SampleLoader]  # one --dataset spec -> samples (a staticmethod)
    trainer_cls: ClassVar[type[SupervisedTrainer]] = SupervisedTrainer  # KTO, RM: a subclass

    def load_model(self, run: Any, world: World) -> nn.Module:
        """The model to train, on ``world``'s device."""
        return load_causal_lm(run.model, world.device)

    def load_frozen(self, run: Any, model: nn.Module, world: World) -> Any:
        """Frozen models the objective reads (a reference, a teacher), or None; loaded before the
        policy is sharded."""
        return None

    @abstractmethod
    def objective(self, run: Any, tokenizer, train: Sequence, frozen: Any) -> Objective:
        """The loss the loop trains, given the training samples and what ``load_frozen`` returned."""

    def trainer_kwargs(self, run: Any, train: Sequence, evals: Sequence | None) -> dict:
        """Extra arguments of ``trainer_cls``."""
        return {}

    def describe(self, run: Any, frozen: Any) -> str:
        """Trainer-specific words for the start-up log line."""
        return ""


def fit_recipe(recipe: Recipe, run: SupervisedRun, world: World | None = None) -> list[dict]:
    """Build and train ``run`` as ``recipe`` says; returns per-step metrics.

    The order is fixed (it decides what the seeded RNG initialises): checks, seeding, tokenizer (and a
    vision-language model's image processor), samples, step count, model, frozen models, optimizer
    stack, objective, training.
    """
    world = with_tensor_parallel(world or init_world(), run.dist.ds_tensor_parallel_size)
    run.check(world)  # every problem of the run at once, before the tokenizer, data or models load
    if run.train.packing_samples and (problem := packing_problem(run.model.pretrain)):
        raise ConfigError(f"--packing_samples: {problem} (--pretrain {run.model.pretrain}); drop the flag")
    ring = ring_group(world, run.dist.ring_attn_size, run.dist.ring_head_stride)
    seed_everything(run.train)
    tokenizer = load_tokenizer(run.model.pretrain, run.model)
    images = run_images(run, tokenizer)
    ds, extra = run.datasets, ({"images": images} if images is not None else {})
    train, evals = train_and_eval_samples(
        recipe.load_samples, ds, tokenizer, run.data, run.train.seed, **extra
    )
    steps = training_steps(len(train), run.train, world, ds.dataset)
    model = recipe.load_model(run, world)
    if images is not None and images.cfg.freeze_visual_encoder:
        log.info("--freeze_visual_encoder: %d vision parameters frozen", freeze_vision(model))
    if ring is not None and (problem := head_stride_problem(model, ring.head_stride)):
        raise ConfigError(problem)
    frozen = recipe.load_frozen(run, model, world)
    opt = build_optimization(model, run.model, run.optim, run.dist, world, steps)
    objective = recipe.objective(run, tokenizer, train, frozen)
    log.info(
        "%s%s: %d train samples, %d steps, device %s x%d",
        recipe.label, recipe.describe(run, frozen), len(train), steps, world.device, world.world_size,
    )  # fmt: skip
    exported = images.processor if images is not None and images.processor else tokenizer  # + image processor
    trainer = recipe.trainer_cls(
        objective, opt, exported, world, run.train, run.ckpt, run.logging, run_folder(run.run_dir, run.ckpt),
        run_config=flat_config(run), kind=trainer_kind(run), **recipe.trainer_kwargs(run, train, evals),
    )  # fmt: skip
    with use_ring(ring):  # packed forwards of this run split their rows over the ring group
        return trainer.fit(train, evals)
