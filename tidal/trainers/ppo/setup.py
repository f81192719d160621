"""Build an RL run's parts from its configs: every role on this process's device.

One process is local mode; several (torchrun, or Ray workers from ``ray_mode``) each build the same
parts, with the policy and critic FSDP2-sharded and the rollout split by ``DataParallelRollout``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.data import build_prompt_samples, load_dataset_spec
from tidal.distributed import World, init_world
from tidal.logging import get_logger
from tidal.models import load_causal_lm, load_tokenizer
from tidal.models.loading import check_model_folder, model_load_error
from tidal.models.precision import Precision
from tidal.models.value_model import load_value_model
from tidal.rewards.models import RewardModels
from tidal.trainers.common import build_optimization, seed_everything
from tidal.trainers.ppo.config import PPORun
from tidal.trainers.ppo.data_parallel import DataParallelRollout, check_data_parallel
from tidal.trainers.ppo.frozen_roles import (
    LocalReference,
    RemoteReference,
    RemoteRewardModels,
    frozen_copy_config,
)
from tidal.trainers.ppo.ray_mode import run_ppo_ray, wants_ray
from tidal.trainers.ppo.remote_rollout import RemoteRollout
from tidal.trainers.ppo.roles import start_workers, worker_counts
from tidal.trainers.ppo.rollout import LocalRollout
from tidal.trainers.ppo.trainer import PPOParts, PPOTrainer

log = get_logger(__name__)


def check_models_before_loading(run: PPORun) -> None:
    """Fail in one line, before anything loads, on a model folder the run cannot use: one without
    ``config.json``, or a policy architecture the rollout engine does not implement."""
    from transformers import AutoConfig

    from tidal.rollout.models import SUPPORTED_MODEL_TYPES

    folders = {"--pretrain": [run.model.pretrain], "--critic_pretrain": [run.models.critic_pretrain]}
    folders["--reward_pretrain"] = (run.models.reward_pretrain or "").split(",")
    for flag, paths in folders.items():
        for path in filter(None, paths):
            check_model_folder(path, flag)
    try:
        model_type = getattr(AutoConfig.from_pretrained(run.model.pretrain), "model_type", None)
    except (OSError, ValueError, KeyError) as err:
        raise model_load_error(run.model.pretrain, err) from err
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"--pretrain {run.model.pretrain}: model_type {model_type!r} is not supported by the rollout engine "
            f"of tidal ppo; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_prompts(run: PPORun, tokenizer, spec: str, probs, split: str, max_samples):
    d = run.data
    dataset = load_dataset_spec(spec, probs, split=split, max_samples=max_samples, seed=run.train.seed)
    prompts, skipped = build_prompt_samples(dataset, tokenizer, d.input_key, d.label_key, d.input_template,
                                            d.apply_chat_template, run.rollout.prompt_max_len, source=spec)  # fmt: skip
    if skipped.count:
        log.warning("%s: %s", spec, skipped.summary())
    return prompts


def total_update_steps(run: PPORun, num_prompts: int) -> int:
    rollouts = (num_prompts // run.rollout.rollout_batch_size) * run.models.num_episodes
    samples = run.rollout.rollout_batch_size * run.rollout.n_samples_per_prompt
    per_rollout = -(-samples // run.train.train_batch_size) * run.train.max_epochs
    return max(rollouts * per_rollout, 1)


def build_parts(run: PPORun, world: World, tokenizer, steps: int, ray_actors: dict | None = None) -> PPOParts:
    """The policy (and critic) on this device, and each other role here or on separate workers:
    started here as child processes, or the Ray actors the driver placed for this rank."""
    device = world.device
    actor_model = load_causal_lm(run.model, device)
    actor_optim = dataclasses.replace(run.optim, learning_rate=run.models.actor_learning_rate)
    actor = build_optimization(actor_model, run.model, actor_optim, run.dist, world, steps)
    critic = None
    if run.rl.needs_critic:
        critic_cfg = dataclasses.replace(run.model, pretrain=run.critic_source)
        critic_model = load_value_model(critic_cfg, device, run.models.value_head_prefix)
        critic_optim = dataclasses.replace(run.optim, learning_rate=run.models.critic_learning_rate)
        critic = build_optimization(critic_model, critic_cfg, critic_optim, run.dist, world, steps)
    workers = start_workers(run, world.world_size, ray_actors)
    try:
        reference = build_reference(run, device, actor.precision, workers["reference"])
        rollout = build_rollout(run, world, tokenizer, workers)
    except BaseException:
        for handles in workers.values():
            for w in handles:
                w.close()
        raise
    return PPOParts(actor, critic, reference, rollout, tokenizer)


def build_reference(run: PPORun, device: torch.device, precision: Precision, workers: list):
    if not run.rl.needs_reference:
        return None
    if workers:
        return RemoteReference(workers)
    model = load_causal_lm(frozen_copy_config(run.model, run.model.pretrain), device).eval()
    return LocalReference(model.requires_grad_(False), precision, device, run.models.ref_reward_offload)


def build_rollout(run: PPORun, world: World, tokenizer, workers: dict[str, list]):
    """The engine on this device (``LocalRollout``) or this rank's separate engines (``RemoteRollout``)."""
    device, pad_id = world.device, tokenizer.pad_token_id
    reward_models = RemoteRewardModels(workers["reward model"]) if workers["reward model"] else None
    reward_models = reward_models or build_reward_models(run, device)
    if workers["engine"]:
        rollout = RemoteRollout(
            workers["engine"], tokenizer, run.rollout, run.models, device, pad_id, reward_models
        )
    else:
        rollout = LocalRollout(run.model.pretrain, tokenizer, run.rollout, run.models, device, pad_id,
                               run.data.apply_chat_template, run.train.seed, reward_models=reward_models)  # fmt: skip
    return DataParallelRollout(rollout, world) if world.distributed else rollout


def build_reward_models(run: PPORun, device: torch.device) -> RewardModels | None:
    if not run.models.reward_pretrain:
        return None
    models: list[nn.Module] = [
        load_value_model(
            frozen_copy_config(run.model, path),
            device,
            run.models.value_head_prefix,
            normalize_reward=run.rl.normalize_reward,
            trained_head=True,
        )  # fmt: skip
        for path in run.models.reward_pretrain.split(",")
    ]
    precision = Precision.create(run.model.param_dtype, device)
    return RewardModels(
        models, precision, run.rollout.micro_rollout_batch_size, run.models.ref_reward_offload
    )


def log_local_mode(run: PPORun, world: World) -> None:
    """Say once how the roles are placed: local mode (all counts 1) or data-parallel processes."""
    counts = worker_counts(run, world.world_size)
    separate = ", ".join(f"{n} {role} worker(s)" for role, n in counts.items() if n)
    where = f"; on devices of their own: {separate}" if separate else ""
    if world.distributed:
        log.info("data parallel: process %d of %d on %s with a policy shard and the colocated roles%s",
                 world.rank, world.world_size, world.device, where)  # fmt: skip
    else:
        log.info("local mode: the policy and the colocated roles on %s%s", world.device, where)


def run_ppo(run: PPORun, world: World | None = None, ray_actors: dict | None = None) -> list[dict]:
    """Train a policy with RL as configured; returns per-rollout metrics (rank 0's in Ray mode).

    ``ray_actors``: in Ray mode, this rank's separate workers per role (actors the driver placed)."""
    check_models_before_loading(run)
    if world is None and wants_ray(run):
        return run_ppo_ray(run)
    world = world or init_world()
    seed_everything(run.train)
    tokenizer = load_tokenizer(run.model.pretrain, run.model)
    d = run.data
    prompts = load_prompts(run, tokenizer, d.prompt_data, d.prompt_data_probs, d.prompt_split, d.max_samples)
    if len(prompts) < run.rollout.rollout_batch_size:
        raise ConfigError(
            f"--prompt_data {d.prompt_data}: {len(prompts)} prompts is fewer than one --rollout_batch_size "
            f"({run.rollout.rollout_batch_size})"
        )
    evals = load_prompts(run, tokenizer, d.eval_dataset, None, d.eval_split, None) if d.eval_dataset else None
    check_data_parallel(run, world, len(evals) if evals is not None else None)
    log_local_mode(run, world)
    parts = build_parts(run, world, tokenizer, total_update_steps(run, len(prompts)), ray_actors)
    log.info("RL (%s): %d prompts, device %s", run.rl.advantage_estimator, len(prompts), world.device)
    try:
        return PPOTrainer(run, parts, prompts, evals, world).fit()
    finally:
        parts.rollout.close()
        if parts.reference is not None:
            parts.reference.close()
