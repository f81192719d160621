"""Rewards from reward models (``--reward_pretrain``, comma-separated): the sum of their scores.

The models read the trajectory's token ids directly (token-in-token-out: no re-tokenisation), so
they must share the policy's tokenizer, as in OpenRLHF.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tidal.experience.experience import Experience, micro_batches, model_batch
from tidal.models.frozen import FrozenModel
from tidal.models.precision import Precision
from tidal.rewards.base import RewardResult, check_finite


class RewardModels:
    """Score an ``Experience`` with one or more value-head reward models (frozen; with ``offload`` each
    stays in CPU memory except while it scores)."""

    def __init__(
        self, models: Sequence[nn.Module], precision: Precision, micro_size: int, offload: bool = False
    ):
        self.frozen = [FrozenModel(model, precision.device, offload) for model in models]
        self.precision, self.micro_size = precision, micro_size

    @torch.no_grad()
    def __call__(self, exp: Experience) -> RewardResult:
        exp = exp.to(self.precision.device)  # rollouts arrive on the CPU
        total = torch.zeros(len(exp), dtype=torch.float32)
        per_model = {}
        for i, frozen in enumerate(self.frozen):
            with frozen.use() as model:
                scores = torch.cat(
                    [self._score(model, exp.select(rows)) for rows in micro_batches(exp, self.micro_size)]
                )
            total += check_finite(scores, "reward", f"reward model {_model_name(model, i)}")
            per_model[f"reward_model_{i}"] = float(scores.mean())
        return RewardResult(rewards=total, extra_logs=per_model if len(self.frozen) > 1 else {})

    def close(self) -> None:
        """Nothing to release: the models live in this process (``RemoteRewardModels`` has workers)."""

    def _score(self, model: nn.Module, exp: Experience) -> torch.Tensor:
        with self.precision.autocast():
            return model.scores(model_batch(exp, packing=False)).float()


def _model_name(model: nn.Module, index: int) -> str:
    """The checkpoint a reward model was loaded from (its ``--reward_pretrain`` entry), for messages."""
    config = getattr(model, "config", None)
    path = getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None)
    return f"{index} ({path})" if path else str(index)
