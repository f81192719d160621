"""What the RL loop asks of the roles it does not train, wherever they run.

The loop (``tidal.trainers.ppo.trainer``) trains the policy on its own device; the critic it also
trains and three other roles may sit with it or on devices of their own, and the loop sees only these
protocols:

- ``RolloutRole``: prompts in, trajectories out (the trainer scores and packs them:
  ``tidal.experience.scoring``); takes the
  policy's weights after each update. ``LocalRollout`` (an engine on this device), ``RemoteRollout``
  (engine processes / Ray actors), ``DataParallelRollout`` (this rank's share of either).
- ``ReferenceRole``: per-token log-probs of the reference policy. ``LocalReference`` /
  ``RemoteReference`` (``tidal.placement.frozen_roles``).
- ``RewardRole``: reward-model scores of an ``Experience``. ``tidal.experience.reward_models.RewardModels`` /
  ``RemoteRewardModels``.
- ``CriticRole``: the value model the loop trains with the policy (GAE). ``LocalCritic`` (on the
  policy workers) / ``RemoteCritic`` (a worker process of its own, trained while the policy updates;
  ``tidal.trainers.ppo.critic``).

``PlacedRun`` is the part of an RL run's configuration placement reads (``PPORun`` has it), so this
package never imports the trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor, nn

from tidal.agents import Trajectory
from tidal.config import ModelConfig, PromptDataConfig, TrainConfig
from tidal.config.data import VisionConfig
from tidal.config.distributed import DistributedConfig
from tidal.config.placement import PlacementConfig
from tidal.config.rl import (
    AgentConfig,
    AlgorithmConfig,
    CriticConfig,
    FrozenModelsConfig,
    RewardConfig,
    RolloutConfig,
)
from tidal.config.training import OptimConfig
from tidal.data.prompts import PromptSample
from tidal.experience.experience import Experience
from tidal.rewards.base import RewardResult


class RolloutRole(Protocol):
    """Generation and agents for the RL loop; see the module docstring."""

    def generate(
        self, prompts: Sequence[PromptSample], n: int, temperature: float, seed: int
    ) -> list[Trajectory]:
        """``n`` trajectories per prompt (prompt-major); sample seeds follow ``seed`` and the global prompt
        index."""
        ...

    def sync_weights(self, policy: nn.Module) -> int:
        """Load the policy's current weights into the engine(s); the number of tensors loaded."""
        ...

    def sleep(self) -> None:
        """Free the engine's device memory until the next ``generate`` (``--vllm_enable_sleep``)."""
        ...

    def close(self) -> None:
        """Stop what runs outside this process (engine workers)."""
        ...


class ReferenceRole(Protocol):
    """The frozen reference policy, for the KL penalty or loss."""

    def logprobs(
        self, exp: Experience, micro: int, packing: bool, temperature: float, max_tokens: int | None
    ) -> Tensor:
        """Per-token log-probs ``[N, T]`` of ``exp.sequences`` (in micro-batches of ``micro`` rows, or
        of at most ``max_tokens`` tokens), on ``exp``'s device."""
        ...

    def close(self) -> None: ...


class RewardRole(Protocol):
    """One or more reward models scoring whole samples."""

    def __call__(self, exp: Experience) -> RewardResult: ...

    def close(self) -> None: ...


class CriticRole(Protocol):
    """The critic (value model) the loop trains, wherever it runs."""

    def values(self, exp: Experience, micro: int, packing: bool, max_tokens: int | None) -> Tensor:
        """Values ``[N, T]`` of ``exp`` (no grad; micro-batches as for the reference), on ``exp``'s device."""
        ...

    def start_train(self, exp: Experience, shape, generator) -> None:
        """Begin the PPO epochs on ``exp`` (``shape``: a ``tidal.trainers.ppo.update.StepShape``), shuffled
        from ``generator``, which is left as if the update had drawn from it here. A remote critic trains
        while the caller goes on (the policy update); a local one trains now."""
        ...

    def finish_train(self) -> dict[str, float]:
        """The update's statistics (``critic/...``, ``grad_norm``, ``lr``), once it is done."""
        ...

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient so far."""
        ...

    def checkpoint_parts(self) -> dict:
        """Trained parts the trainer's checkpoints shard (``{"critic": Optimization}`` when local)."""
        ...

    def checkpoint_state(self) -> dict:
        """Checkpoint state by name (``state_dict`` / ``load_state_dict``) the trainer saves besides them."""
        ...

    def set_awake(self, awake: bool) -> None:
        """``--deepspeed_enable_sleep``: reload (True) or offload (False) a critic on the policy's device."""
        ...

    def export(self, tokenizer, path) -> None:
        """The critic as a Hugging Face folder at ``path`` (``--save_value_network``); every rank calls it."""
        ...

    def close(self) -> None: ...


class PlacedRun(Protocol):
    """The configs placement reads from an RL run (``tidal.trainers.ppo.PPORun``)."""

    actor: ModelConfig
    data: PromptDataConfig
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    reward: RewardConfig
    critic: CriticConfig
    agent: AgentConfig
    frozen: FrozenModelsConfig
    train: TrainConfig
    placement: PlacementConfig
    critic_optim: OptimConfig
    dist: DistributedConfig
    vision: VisionConfig  # images in prompts: the critic (tidal.trainers.ppo.critic) reads them too

    @property
    def critic_source(self) -> str: ...
