"""``tidal ppo`` / ``python -m tidal.cli.train_ppo`` (alias ``train_ppo_ray``): RL with the seed's flags."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.config.ppo import PPORun

COMMAND = TrainerCommand(
    "ppo",
    "RL: PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO with reward functions, servers or agents.",
    PPORun,
    "tidal.trainers.ppo.entry:run_ppo",
    {
        "actor": "policy model",
        "data": "prompts",
        "rollout": "rollout (tidal's engine; --vllm_* flags)",
        "algorithm": "RL algorithm",
        "reward": "rewards",
        "critic": "critic",
        "agent": "agents",
        "frozen": "reference and reward models",
        "train": "training",
        "ema": "EMA of the policy (the saved model with --enable_ema)",
        "ptx": "PPO-ptx: pretraining loss in the policy update",
        "actor_optim": "optimizer (shared by policy and critic; --actor_learning_rate and --actor_* for the policy)",
        "critic_optim": "critic optimizer (--critic_learning_rate and --critic_*; other flags are shared)",
        **{k: v for k, v in COMMON_TITLES.items() if k in ("ckpt", "logging", "dist")},
        "best": "best checkpoint by an evaluation metric",
        "placement": "placement (Ray)",
        "vision": "images (vision-language models)",
    },
    roles={"actor_optim": "actor", "critic_optim": "critic"},  # --actor_adam_betas... (OpenRLHF HEAD)
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
