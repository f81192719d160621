"""Trajectories → a scored ``Experience``: the first steps of the experience path.

A rollout role (``tidal.placement``) returns trajectories only; ``RewardScorer.experience`` packs them
(``maker.from_trajectories``) and gives every sample its reward and score from the run's source:

- agents that rewarded every episode themselves (``--agent_func_path`` / ``--agent_endpoint``) keep theirs;
- reward models (``--reward_pretrain``: ``reward_models.RewardModels`` here, or a role on workers of
  its own; any ``Experience → RewardResult`` callable) score the packed sequences;
- on-policy distillation with no other source (``--teacher_model`` alone) rewards 0: the KL to the
  teacher is the signal;
- else the reward function or server (``--remote_rm_url``) scores the decoded text with the labels.

Every value passes ``tidal.rewards.check_finite`` inside its source. The rest of the path (shaping,
log-probs, values, advantages) is ``maker.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tidal.agents.base import Trajectory, rollout_logs
from tidal.config.args import ConfigError
from tidal.config.rl import AgentConfig, RewardConfig
from tidal.experience.experience import Experience
from tidal.experience.maker import from_trajectories
from tidal.rewards import RewardResult, load_reward_source


class RewardModelScorer(Protocol):
    """Reward models as the experience path sees them: packed samples in, one reward each out
    (``tidal.placement.protocols.RewardRole`` has this shape)."""

    def __call__(self, exp: Experience) -> RewardResult: ...

    def close(self) -> None: ...


def check_reward_sources(reward: RewardConfig, agent: AgentConfig) -> None:
    """Refuse an RL run with nothing to reward it (called before any model or engine loads)."""
    if not (
        agent.func_path or agent.endpoint or reward.remote_url or reward.pretrain or reward.teacher_model
    ):
        raise ConfigError(
            "RL needs rewards: pass --remote_rm_url, --reward_pretrain, --agent_func_path, --agent_endpoint "
            "or --teacher_model"
        )


class RewardScorer:
    """The run's reward source, applied to each rollout's trajectories (see the module docstring)."""

    def __init__(
        self,
        reward: RewardConfig,
        agent: AgentConfig,
        pad_id: int,
        reward_models: RewardModelScorer | None = None,
    ):
        check_reward_sources(reward, agent)
        self.pad_id, self.reward_models = pad_id, reward_models
        self.source = (
            load_reward_source(reward.remote_url, timeout=reward.timeout, max_retries=reward.retries)
            if reward.remote_url
            else None
        )
        # on-policy distillation may run on the teacher's signal alone (scalar rewards 0)
        self.distilling = bool(reward.teacher_model)

    def experience(self, trajectories: list[Trajectory]) -> tuple[Experience, dict[str, float]]:
        """The trajectories (prompt-major) packed with their rewards and scores, and the step's reward
        logs: the source's extra logs, then the agents' own logs and failed-episode counts."""
        exp = from_trajectories(trajectories, self.pad_id)
        result = self.score(trajectories, exp)
        exp.rewards, exp.scores = result.rewards.float(), result.scores.float()
        return exp, result.extra_logs | rollout_logs(trajectories)

    def score(self, trajectories: Sequence[Trajectory], exp: Experience) -> RewardResult:
        if all(t.reward is not None for t in trajectories):  # agents already rewarded every sample
            return RewardResult(rewards=exp.rewards, scores=exp.scores)
        if self.reward_models is not None:
            return self.reward_models(exp)
        if self.distilling and self.source is None:  # the KL to the teacher is the only signal
            return RewardResult(rewards=torch.zeros(len(trajectories)))
        # each trajectory carries its prompt's label (the executors start it with the label they were given)
        queries = [t.prompt + t.response_text for t in trajectories]
        return self.source(queries, [t.prompt for t in trajectories], [t.label for t in trajectories])

    def close(self) -> None:
        """Release reward models on devices of their own."""
        if self.reward_models is not None:
            self.reward_models.close()
