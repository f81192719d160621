"""RL for language models: one trainer for PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO.

The algorithm only: ``config`` (``PPORun``), ``trainer`` (the loop, one step read top to bottom),
``update`` (policy and value losses over a rollout) and ``entry`` (``run_ppo``: where the ranks run,
then build and fit). The experience path is ``tidal.experience.maker``; where the rollout, reference
and reward models run is ``tidal.placement``.
"""

from tidal.trainers.ppo.config import PPORun
from tidal.trainers.ppo.entry import run_ppo
from tidal.trainers.ppo.trainer import PPOParts, PPOTrainer

__all__ = ["PPOParts", "PPORun", "PPOTrainer", "run_ppo"]
