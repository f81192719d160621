"""RL for language models: one trainer for PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO.

The algorithm only: ``config`` (``PPORun``), ``trainer`` (the loop, one step read top to bottom),
``update`` (policy and value losses over a rollout) and ``entry`` (``run_ppo``: where the ranks run,
then build and fit). The experience path is ``tidal.experience.maker``; where the rollout, reference
and reward models run is ``tidal.placement``.

The names below are imported on first use, so that ``tidal ppo --help`` (which reads only ``config``)
imports no torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.trainers.ppo.config import PPORun
    from tidal.trainers.ppo.entry import run_ppo
    from tidal.trainers.ppo.trainer import PPOParts, PPOTrainer

# name → the submodule that defines it
_EXPORTS = {
    "PPOParts": "tidal.trainers.ppo.trainer",
    "PPORun": "tidal.trainers.ppo.config",
    "PPOTrainer": "tidal.trainers.ppo.trainer",
    "run_ppo": "tidal.trainers.ppo.entry",
}

__all__ = ["PPOParts", "PPORun", "PPOTrainer", "run_ppo"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
