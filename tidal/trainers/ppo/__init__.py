"""RL for language models: one trainer for PPO, REINFORCE++, REINFORCE++-baseline, RLOO, GRPO, Dr.GRPO.

The algorithm only: ``trainer`` (the loop, one step read top to bottom), ``update`` (policy and value
losses over a rollout), ``critic`` (the critic it trains, here or on a worker of its own) and ``entry``
(``run_ppo``: where the ranks run, then build and fit). The run's configs are ``tidal.config.ppo``
(``PPORun``, re-exported here); the experience path is ``tidal.experience``; where the rollout,
reference and reward models run is ``tidal.placement``.

The names below are imported on first use, so that ``tidal ppo --help`` imports no torch.
"""

from typing import TYPE_CHECKING

from tidal.lazy import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers, and for tests/test_imports.py's import graph
    from tidal.config.ppo import PPORun
    from tidal.trainers.ppo.entry import run_ppo
    from tidal.trainers.ppo.trainer import PPOParts, PPOTrainer

# name → the submodule that defines it, imported when the name is first used (see tidal.lazy)
_EXPORTS = {
    "PPOParts": "tidal.trainers.ppo.trainer",
    "PPORun": "tidal.config.ppo",
    "PPOTrainer": "tidal.trainers.ppo.trainer",
    "run_ppo": "tidal.trainers.ppo.entry",
}

__all__ = ["PPOParts", "PPORun", "PPOTrainer", "run_ppo"]  # literal: ruff reads it as the re-exports

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
