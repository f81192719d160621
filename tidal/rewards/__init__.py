"""Rewards for RL: user reward functions, remote reward servers, and the result type they share.

    from tidal.rewards import load_reward_source
    source = load_reward_source("examples/reward_func.py")      # or "http://host:5000/get_reward"
    result = source(queries, prompts, labels)                      # RewardResult
    result.rewards, result.scores, result.extra_logs

The HTTP reward *server* (``tidal serve_rm``) lives in ``tidal.rewards.server`` and is imported on demand.
"""

from tidal.rewards.base import RewardError, RewardResult, RewardSource, check_finite, to_reward_result
from tidal.rewards.function import RewardFunction, load_python_file
from tidal.rewards.loader import load_reward_source
from tidal.rewards.remote import RemoteReward
from tidal.rewards.sandbox import run_tests as run_tests

__all__ = [
    "RemoteReward",
    "RewardError",
    "RewardFunction",
    "RewardResult",
    "RewardSource",
    "check_finite",
    "load_python_file",
    "load_reward_source",
    "to_reward_result",
]
