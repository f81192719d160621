"""``tidal ppo`` / ``python -m tidal.cli.train_ppo`` (alias ``train_ppo_ray``): RL with the seed's flags."""

from __future__ import annotations

import argparse

from tidal.cli.common import make_parser, module_main, run_command
from tidal.config import (
    CheckpointConfig,
    DistributedConfig,
    ModelConfig,
    OptimConfig,
    PromptDataConfig,
    TrainConfig,
    config_from_args,
)
from tidal.config.placement import PlacementConfig
from tidal.config.rl import RLConfig, RLModelsConfig, RolloutConfig
from tidal.logging import LoggingConfig

GROUPS = [
    (ModelConfig, "policy model"),
    (PromptDataConfig, "prompts"),
    (RolloutConfig, "rollout (tidal's engine; --vllm_* flags)"),
    (RLConfig, "RL algorithm"),
    (RLModelsConfig, "rewards, critic and agents"),
    (TrainConfig, "training"),
    (
        OptimConfig,
        "optimizer (learning rates: --actor_learning_rate / --critic_learning_rate)",
        ["learning_rate"],
    ),
    (CheckpointConfig, "checkpoints"),
    (LoggingConfig, "logging"),
    (DistributedConfig, "distributed (FSDP2)"),
    (PlacementConfig, "placement (Ray)"),
]


def build_parser(prog: str = "tidal ppo") -> argparse.ArgumentParser:
    parser = make_parser(prog, "RL: PPO, REINFORCE++, RLOO, GRPO, Dr.GRPO with rewards or agents.", GROUPS)
    parser.set_defaults(train_batch_size=128, micro_train_batch_size=4, ckpt_path="./ckpt/checkpoints_ppo")
    return parser


def run_from_namespace(ns: argparse.Namespace):
    from tidal.trainers.ppo import PPORun

    return PPORun(
        model=config_from_args(ModelConfig, ns),
        data=config_from_args(PromptDataConfig, ns),
        rollout=config_from_args(RolloutConfig, ns),
        rl=config_from_args(RLConfig, ns),
        models=config_from_args(RLModelsConfig, ns),
        train=config_from_args(TrainConfig, ns),
        optim=config_from_args(OptimConfig, ns),
        ckpt=config_from_args(CheckpointConfig, ns),
        logging=config_from_args(LoggingConfig, ns),
        dist=config_from_args(DistributedConfig, ns),
        placement=config_from_args(PlacementConfig, ns),
    )


def parse_run(argv: list[str]):
    """Flags → ``PPORun`` without training (for scripts and tests)."""
    return run_from_namespace(build_parser().parse_args(argv))


def main(argv: list[str] | None = None, prog: str = "tidal ppo"):
    from tidal.trainers.ppo import run_ppo

    return run_command(build_parser(prog), argv, lambda ns: run_ppo(run_from_namespace(ns)))


if __name__ == "__main__":
    module_main(lambda argv: main(argv, prog="python -m tidal.cli.train_ppo"))
