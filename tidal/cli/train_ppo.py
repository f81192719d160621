"""``tidal ppo`` / ``python -m tidal.cli.train_ppo`` (alias ``train_ppo_ray``): RL with the seed's flags."""

from tidal.cli.common import COMMON_TITLES, TrainerCommand
from tidal.trainers.ppo import PPORun, run_ppo

COMMAND = TrainerCommand(
    "ppo",
    "RL: PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO with reward functions, servers or agents.",
    PPORun,
    run_ppo,
    {
        "model": "policy model",
        "data": "prompts",
        "rollout": "rollout (tidal's engine; --vllm_* flags)",
        "rl": "RL algorithm",
        "models": "rewards, critic and agents",
        **{k: v for k, v in COMMON_TITLES.items() if k not in ("model", "datasets")},
        "optim": "optimizer (learning rates: --actor_learning_rate / --critic_learning_rate)",
        "placement": "placement (Ray)",
    },
    exclude={"optim": ("learning_rate",)},
    defaults={"train_batch_size": 128, "micro_train_batch_size": 4, "ckpt_path": "./ckpt/checkpoints_ppo"},
)
build_parser, parse_run, main = COMMAND.build_parser, COMMAND.parse_run, COMMAND.main

if __name__ == "__main__":
    COMMAND.module_main()
