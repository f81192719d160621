"""``PPORun``: every component config of an RL run, and the checks that span several of them."""

from __future__ import annotations

from dataclasses import dataclass

from tidal.config import (
    CheckpointConfig,
    ConfigError,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    PromptDataConfig,
    TrainConfig,
)
from tidal.config.placement import (
    PlacementConfig,
    check_placement,
    separate_engines,
    separate_reference,
    separate_reward,
)
from tidal.config.rl import RLConfig, RLModelsConfig, RolloutConfig
from tidal.logging import LoggingConfig

# rloo and group baselines compare samples of the same prompt
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")


@dataclass
class PPORun:
    """An RL run: policy model, prompts, rollout, algorithm, other models, schedule and I/O."""

    model: ModelConfig
    data: PromptDataConfig
    rollout: RolloutConfig
    rl: RLConfig
    models: RLModelsConfig
    train: TrainConfig
    optim: OptimConfig
    ckpt: CheckpointConfig
    logging: LoggingConfig
    dist: DistributedConfig
    placement: PlacementConfig

    def __post_init__(self) -> None:
        if self.rl.advantage_estimator in GROUP_ESTIMATORS and self.rollout.n_samples_per_prompt < 2:
            raise ConfigError(
                f"--advantage_estimator {self.rl.advantage_estimator} compares samples of a prompt: "
                "set --n_samples_per_prompt >= 2"
            )
        if self.rl.dynamic_filtering and self.rollout.n_samples_per_prompt < 2:
            raise ConfigError("--dynamic_filtering needs --n_samples_per_prompt >= 2")
        if self.rl.use_kl_loss and self.rl.init_kl_coef <= 0:
            raise ConfigError("--use_kl_loss needs --init_kl_coef > 0")
        if self.placement.async_train and (
            self.rollout.vllm_enable_sleep or self.placement.deepspeed_enable_sleep
        ):
            raise ConfigError(
                "--async_train generates while training, so the engine and trainer cannot sleep in turn: "
                "drop --vllm_enable_sleep/--deepspeed_enable_sleep"
            )
        check_placement(
            self.placement, self.rollout.vllm_num_engines, self.rollout.vllm_tensor_parallel_size,
            self.rl.needs_reference, self.rl.needs_critic, bool(self.models.reward_pretrain),
        )  # fmt: skip
        if separate_engines(self.placement, self.rollout.vllm_num_engines) and self.rollout.vllm_enable_sleep:
            raise ConfigError(
                "--vllm_enable_sleep frees a colocated engine's memory for the trainer, but --vllm_num_engines "
                "without --colocate_all_models puts the engines on devices of their own: drop it, or pass "
                "--colocate_all_models"
            )
        p = self.placement
        colocated = (self.rl.needs_reference and not separate_reference(p)) or (
            bool(self.models.reward_pretrain) and not separate_reward(p)
        )
        if self.models.ref_reward_offload and not colocated:
            raise ConfigError(
                "--ref_reward_offload keeps a reference or reward model that shares the policy's device in host "
                "memory between uses, but this run has none (no --init_kl_coef > 0 / --reward_pretrain, or "
                "they run on devices of their own)"
            )
        samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if self.train.train_batch_size > samples:
            raise ConfigError(
                f"--train_batch_size {self.train.train_batch_size} exceeds the samples of one rollout "
                f"(--rollout_batch_size x --n_samples_per_prompt = {samples})"
            )

    @property
    def critic_source(self) -> str:
        """OpenRLHF's default: the critic starts from the first reward model, else the policy."""
        if self.models.critic_pretrain:
            return self.models.critic_pretrain
        if self.models.reward_pretrain:
            return self.models.reward_pretrain.split(",")[0]
        return self.model.pretrain
