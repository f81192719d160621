"""Build the roles an RL rank does not train: its rollout and reference, here or on separate workers.

``build_roles`` is the one place that turns a run's placement (``tidal.config.placement``) into
objects: for each role, the local implementation on this process's device, or the remote one
driving this rank's separate workers (child processes it starts, or the Ray actors the driver
placed for it); with several data-parallel ranks the rollout is this rank's share. The reward
models are built here too (on this device or on workers of their own); the experience path
(``tidal.experience.scoring``) scores with them. The critic the loop trains is built by the trainer
(``tidal.trainers.ppo.critic.build_critic``), on workers this package starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tidal.config import ConfigError
from tidal.config.placement import separate_critic
from tidal.distributed.world import World
from tidal.experience.reward_models import RewardModels
from tidal.inference.scoring import check_same_tokenizer
from tidal.logging import get_logger
from tidal.logging.phases import phase
from tidal.models import load_causal_lm
from tidal.models.frozen import FrozenModel, frozen_copy_config
from tidal.models.precision import Precision
from tidal.models.value_model import load_value_model
from tidal.placement.data_parallel import DataParallelRollout
from tidal.placement.frozen_roles import LocalReference, RemoteReference, RemoteRewardModels, reference_source
from tidal.placement.protocols import PlacedRun, ReferenceRole, RewardRole, RolloutRole
from tidal.placement.remote_rollout import RemoteRollout
from tidal.placement.roles import start_workers, worker_counts
from tidal.placement.rollout import LocalRollout

log = get_logger(__name__)


@dataclass
class Roles:
    """This rank's frozen and generating roles (``reference`` / ``reward_models`` are None when the run
    needs none)."""

    reference: ReferenceRole | None
    rollout: RolloutRole
    reward_models: RewardRole | None = None

    def close(self) -> None:
        self.rollout.close()
        for role in (self.reference, self.reward_models):
            if role is not None:
                role.close()


def build_roles(
    run: PlacedRun, world: World, tokenizer, precision: Precision, ray_actors: dict | None = None
) -> Roles:
    """The reference and rollout of this rank (see the module docstring); ``precision``: the policy's,
    which a reference on this device shares. ``ray_actors``: in Ray mode, this rank's separate workers
    per role."""
    if run.reward.teacher_model:  # before any worker starts: the teacher scores the student's token ids
        check_same_tokenizer(run.reward.teacher_model, tokenizer, flag="--teacher_model")
    workers = start_workers(run, world.world_size, ray_actors)
    try:
        reference = build_reference(run, world.device, precision, workers["reference"])
        # the reward models load before the engine, as they always did (same RNG draws)
        reward_models = RemoteRewardModels(workers["reward model"]) if workers["reward model"] else None
        reward_models = reward_models or build_reward_models(run, world.device)
        return Roles(reference, build_rollout(run, world, tokenizer, workers), reward_models)
    except BaseException:
        for handles in workers.values():
            for w in handles:
                w.close()
        raise


def build_reference(
    run: PlacedRun, device: torch.device, precision: Precision, workers: list
) -> ReferenceRole | None:
    if not run.algorithm.needs_reference:
        return None
    if workers:
        return RemoteReference(workers)
    # on-policy distillation: the teacher is the model the KL penalty pulls the policy towards
    with phase(f"reference model: {reference_source(run)}"):
        model = load_causal_lm(frozen_copy_config(run.actor, reference_source(run)), device)
        reference = LocalReference(FrozenModel(model, device, run.frozen.offload), precision)
    return reference


def build_rollout(run: PlacedRun, world: World, tokenizer, workers: dict[str, list]) -> RolloutRole:
    """The engine on this device (``LocalRollout``) or this rank's separate engines (``RemoteRollout``)."""
    device, pad_id = world.device, tokenizer.pad_token_id
    if workers["engine"]:
        rollout = RemoteRollout(workers["engine"], tokenizer, run.rollout, device, pad_id)
    else:
        rollout = LocalRollout(run.actor.pretrain, tokenizer, run.rollout, run.agent, device, pad_id,
                               run.data.apply_chat_template, run.train.seed)  # fmt: skip
    return DataParallelRollout(rollout, world) if world.distributed else rollout


def critic_workers(run: PlacedRun, world_size: int) -> int:
    """Critic workers per trainer: 1 for a critic on devices of its own, whose count must then be the
    number of processes (under torchrun the flags' sizes are not the launcher's), else 0."""
    if not (run.algorithm.needs_critic and separate_critic(run.placement)):
        return 0
    count = run.placement.role_count("critic")
    if count != world_size:
        raise ConfigError(
            f"--critic_num_nodes x --critic_num_gpus_per_node = {count}: a critic on devices of its own runs one "
            f"worker per policy worker, so it must be {world_size} (the processes of this run)"
        )
    return 1


def critic_ray_problem(run: PlacedRun) -> str | None:
    """Ray mode has no critic workers of its own yet (its actors are placed by the driver, which does
    not start a process group for them): a critic on devices of its own is refused there."""
    if run.algorithm.needs_critic and separate_critic(run.placement):
        return ("--critic_num_nodes/--critic_num_gpus_per_node: a critic on devices of its own runs in local "
                "mode or under torchrun (a critic process per trainer), not in Ray mode; leave them unset, "
                "pass --colocate_critic_reward, or launch with torchrun")  # fmt: skip
    return None


def build_reward_models(run: PlacedRun, device: torch.device) -> RewardRole | None:
    if not run.reward.pretrain:
        return None
    models: list[nn.Module] = [
        load_value_model(
            frozen_copy_config(run.actor, path),
            device,
            run.critic.value_head_prefix,
            normalize_reward=run.reward.normalize,
            trained_head=True,
        )  # fmt: skip
        for path in run.reward.pretrain.split(",")
    ]
    precision = Precision.create(run.actor.param_dtype, device)
    return RewardModels(models, precision, run.rollout.micro_rollout_batch_size, run.frozen.offload)


def log_placement(run: PlacedRun, world: World) -> None:
    """Say once how the roles are placed: local mode (all counts 1) or data-parallel processes; a
    placement these processes cannot honour fails here, before any model loads."""
    counts = worker_counts(run, world.world_size) | {"critic": critic_workers(run, world.world_size)}
    separate = ", ".join(f"{n} {role} worker(s)" for role, n in counts.items() if n)
    where = f"; on devices of their own: {separate}" if separate else ""
    if world.tp_size > 1:
        log.info("data x tensor parallel: process %d of %d (data-parallel group %d of %d, %d tensor-"
                 "parallel ranks each) on %s with a policy shard and the colocated roles%s", world.rank,
                 world.world_size, world.dp_rank, world.dp_size, world.tp_size, world.device,
                 where)  # fmt: skip
    elif world.distributed:
        log.info("data parallel: process %d of %d on %s with a policy shard and the colocated roles%s",
                 world.rank, world.world_size, world.device, where)  # fmt: skip
    else:
        log.info("local mode: the policy and the colocated roles on %s%s", world.device, where)
