"""RL for language models: one trainer for PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO."""

from tidal.trainers.ppo.config import PPORun
from tidal.trainers.ppo.setup import run_ppo
from tidal.trainers.ppo.trainer import PPOParts, PPOTrainer

__all__ = ["PPOParts", "PPORun", "PPOTrainer", "run_ppo"]
