"""Where RL roles run: the seed's Ray placement flags.

In local mode (one process, the default for one device) every role shares the device — the
hybrid engine — and the counts below describe the Ray deployment they would get. On a machine
without GPUs, ``*_num_gpus_per_node`` counts CPU worker processes.
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
