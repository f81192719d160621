"""Where RL roles run: the seed's Ray placement flags.

Local mode (all counts 1, the default): one process, every role and one rollout engine share its
device (the hybrid engine). With ``--actor_num_nodes x --actor_num_gpus_per_node`` > 1, ``tidal
ppo`` starts that many data-parallel policy workers as Ray actors, one per placement-group bundle
(a GPU, or on a machine without GPUs a CPU, so ``*_num_gpus_per_node`` then counts CPU worker
processes). Each worker holds its shard of the policy, its own rollout engine, and full copies of
the reference and reward models (and its critic shard): they always live with the policy ranks, so
the colocation flags must say so. ``check_placement`` rejects what this design cannot honour.

Rollout engines sit with the policy workers (one each) unless ``--vllm_num_engines E`` is given
without ``--colocate_all_models``: then every policy worker drives ``E / T`` engines of its own on
separate devices (GPUs after the trainers', or CPU processes), and weights reach them by bucketed
broadcast (``tidal.trainers.ppo.engines``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config.args import ConfigError, arg


@dataclass
class PlacementConfig:
    """Placement (Ray): devices per role, colocation, sleep modes and asynchronous training."""

    actor_num_nodes: int = arg(1, help="nodes for the policy")
    actor_num_gpus_per_node: int = arg(1, help="devices per node for the policy")
    ref_num_nodes: int = arg(1, help="nodes for the reference model")
    ref_num_gpus_per_node: int = arg(1, help="devices per node for the reference model")
    critic_num_nodes: int = arg(1, help="nodes for the critic")
    critic_num_gpus_per_node: int = arg(1, help="devices per node for the critic")
    reward_num_nodes: int = arg(1, help="nodes for the reward model")
    reward_num_gpus_per_node: int = arg(1, help="devices per node for the reward model")
    colocate_actor_ref: bool = arg(False, help="policy and reference share devices")
    colocate_critic_reward: bool = arg(False, help="critic and reward model share devices")
    colocate_all_models: bool = arg(False, help="all models and engines share devices (hybrid engine)")
    deepspeed_enable_sleep: bool = arg(
        False, help="offload trainer weights and optimizer state while generating"
    )
    async_train: bool = arg(False, help="generate the next rollout while training on the current one")
    async_queue_size: int = arg(1, help="max rollouts generated ahead of training (staleness bound)")

    def __post_init__(self) -> None:
        if self.async_queue_size < 1:
            raise ConfigError(f"--async_queue_size must be >= 1, got {self.async_queue_size}")
        counts = [self.actor_num_nodes, self.actor_num_gpus_per_node, self.ref_num_nodes, self.ref_num_gpus_per_node,
                  self.critic_num_nodes, self.critic_num_gpus_per_node, self.reward_num_nodes,
                  self.reward_num_gpus_per_node]  # fmt: skip
        if min(counts) < 1:
            raise ConfigError("--*_num_nodes and --*_num_gpus_per_node must be >= 1")

    @property
    def actor_world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def role_size(self, role: str) -> tuple[int, int]:
        return getattr(self, f"{role}_num_nodes"), getattr(self, f"{role}_num_gpus_per_node")


def separate_engines(p: PlacementConfig, vllm_num_engines: int | None) -> bool:
    """Engines on devices of their own (``--vllm_num_engines`` without ``--colocate_all_models``)."""
    return vllm_num_engines is not None and not p.colocate_all_models


def check_placement(
    p: PlacementConfig,
    vllm_num_engines: int | None,
    vllm_tensor_parallel_size: int,
    needs_reference: bool,
    needs_critic: bool,
    has_reward_model: bool,
) -> None:
    """Fail clearly on placements the data-parallel design cannot honour (see the module docstring)."""
    if vllm_tensor_parallel_size != 1:
        raise ConfigError(
            f"--vllm_tensor_parallel_size {vllm_tensor_parallel_size}: tidal's rollout engine runs on one "
            "device per policy worker; tensor-parallel engines are not supported (use 1)"
        )
    actor = p.role_size("actor")
    for role in ("ref", "critic", "reward"):
        if p.role_size(role) not in ((1, 1), actor):
            raise ConfigError(
                f"--{role}_num_nodes/--{role}_num_gpus_per_node {p.role_size(role)}: the {role} model lives "
                f"on the policy workers, so its size must be 1x1 or the actor's {actor[0]}x{actor[1]}"
            )
    w = p.actor_world_size
    if separate_engines(p, vllm_num_engines):
        check_separate_engines(p, vllm_num_engines, w)
    elif vllm_num_engines not in (None, w):
        raise ConfigError(
            f"--vllm_num_engines {vllm_num_engines} with --colocate_all_models: each of the {w} policy "
            f"workers runs one engine on its own device; set --vllm_num_engines {w} (or leave it unset)"
        )
    if w == 1:
        return
    separate = {
        "reference": needs_reference and not (p.colocate_all_models or p.colocate_actor_ref),
        "critic": needs_critic and not p.colocate_all_models,
        "reward model": has_reward_model and not p.colocate_all_models,
    }
    for role, bad in separate.items():
        if bad:
            flags = (
                "--colocate_actor_ref or --colocate_all_models"
                if role == "reference"
                else "--colocate_all_models"
            )
            raise ConfigError(
                f"a separately placed {role} is not supported with {w} policy workers: it runs on the "
                f"policy workers; pass {flags}"
            )


def check_separate_engines(p: PlacementConfig, engines: int, w: int) -> None:
    """``engines`` separate engines for ``w`` policy workers (processes)."""
    if engines < 1 or engines % w:
        raise ConfigError(
            f"--vllm_num_engines {engines}: without --colocate_all_models each of the {w} policy workers "
            f"drives the same number of engines on devices of their own, so it must be a multiple of {w}"
        )
    if p.deepspeed_enable_sleep:
        raise ConfigError(
            "--deepspeed_enable_sleep frees the policy's device for a colocated engine, but "
            f"--vllm_num_engines {engines} without --colocate_all_models puts the engines on devices of "
            "their own: drop it, or pass --colocate_all_models"
        )
