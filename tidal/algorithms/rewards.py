"""Reward shaping: KL-in-reward token rewards, reward normalisation, DAPO overlong penalty, ProRL
stop-properly penalty and dynamic filtering.

Scalar rewards ``R`` are ``[N]`` (one per sample); per-token tensors are ``[B, T]`` over action
tokens with an ``action_mask`` that may be left- or right-aligned, or have holes (multi-turn
observations); the *last* action token of a row is found from the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


def last_action_index(action_mask: Tensor) -> Tensor:
    """Index ``[B]`` of the last nonzero mask position of each row (0 for an empty row)."""
    positions = torch.arange(1, action_mask.shape[-1] + 1, device=action_mask.device)
    return ((action_mask != 0).long() * positions).argmax(dim=-1)


def kl_penalized_rewards(
    rewards: Tensor,
    kl: Tensor | None,
    action_mask: Tensor,
    kl_coef: float = 0.0,
    reward_clip_range: tuple[float, float] | None = None,
) -> Tensor:
    """Per-token rewards ``[B, T]``: ``−β·kl_t`` on every action token, plus the scalar reward ``R``
    (clipped to ``[low, high] = reward_clip_range`` when given) on the last action token of each row.

    ``R`` is the reward *after* the group baseline (OpenRLHF's ``compute_reward`` clips the shaped
    reward too), so clipping bounds what reaches the advantages. With ``--use_kl_loss`` pass
    ``kl=None`` (or ``kl_coef=0``): the KL then goes into the loss. Rows with no action token get no
    reward. (Stiennon et al. 2020, arXiv 2009.01325.)
    """
    mask = action_mask != 0
    rewards = rewards.to(torch.float32).reshape(-1)
    if reward_clip_range is not None:
        low, high = reward_clip_range
        rewards = rewards.clamp(low, high)
    token_rewards = torch.zeros(action_mask.shape, dtype=torch.float32, device=action_mask.device)
    if kl is not None and kl_coef != 0.0:
        token_rewards = torch.where(mask, -kl_coef * kl.float(), token_rewards)
    terminal = rewards * mask.any(dim=-1)
    return token_rewards.scatter_add(-1, last_action_index(action_mask).unsqueeze(-1), terminal.unsqueeze(-1))


def normalize_rewards(rewards: Tensor, eps: float = 1e-8) -> Tensor:
    """Batch normalisation of scalar rewards: ``(R − mean) / (std + eps)`` (population std)."""
    rewards = rewards.float()
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


@dataclass
class RunningMoments:
    """Running mean/std of all rewards seen so far (parallel-merge update of Chan et al.).

    ``update(batch)`` folds a batch in; ``normalize(x)`` returns ``(x − mean) / (std + eps)``.
    Keep it in the trainer's checkpoint state so resumed runs normalise identically.
    """

    mean: float = 0.0
    var: float = 1.0
    count: float = 0.0
    eps: float = 1e-8
    _m2: float = field(default=0.0, repr=False)

    def update(self, batch: Tensor) -> None:
        batch = batch.detach().double().reshape(-1)
        n = batch.numel()
        if n == 0:
            return
        batch_mean = float(batch.mean())
        batch_m2 = float(((batch - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self._m2 += batch_m2 + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total
        self.var = self._m2 / total

    def normalize(self, x: Tensor) -> Tensor:
        return (x - self.mean) / (self.var**0.5 + self.eps)


def overlong_penalty(
    response_lengths: Tensor, max_new_tokens: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (arXiv 2503.14476, §3.4), one value per sample ``[N]``.

    0 while ``len ≤ max_new − buf``; then ``−min(len − (max_new − buf), buf) / buf · factor``,
    growing linearly to ``−factor`` at ``len = max_new``. Add it to the scalar reward.
    """
    if buffer_len <= 0:
        raise ValueError(f"overlong buffer length must be positive, got {buffer_len}")
    excess = response_lengths.float() - (max_new_tokens - buffer_len)
    return -excess.clamp(0, buffer_len) / buffer_len * penalty_factor


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """ProRL's stop-properly penalty (OpenRLHF v0.9.2 ``--stop_properly_penalty_coef``), ``[N]``:
    the reward of a sample cut at the token limit (finish reason "length") is *multiplied* by
    ``coef`` in [0, 1] (0 zeroes it); samples that stopped by themselves keep theirs. A scaling, not
    a subtraction: a negative reward of a truncated sample moves towards 0."""
    if not 0.0 <= coef <= 1.0:
        raise ValueError(f"stop_properly_penalty_coef must be in [0, 1], got {coef}")
    scale = torch.where(truncated.bool().to(rewards.device), coef, 1.0)
    return rewards * scale.to(rewards.dtype)


def dynamic_filter_mask(
    scores: Tensor, n_samples_per_prompt: int, low: float = 0.0, high: float = 1.0
) -> Tensor:
    """DAPO dynamic sampling (arXiv 2503.14476, §3.2): keep-mask ``[N]`` (bool) over samples.

    ``scores`` ``[N]`` are consecutive groups of ``n`` samples of the same prompt; a group is kept
    when ``low < mean(scores) < high`` (strict), i.e. by default groups that are all-wrong or
    all-right (zero advantage for every sample) are dropped.
    """
    groups = group_by_prompt(scores.float(), n_samples_per_prompt)
    group_mean = groups.mean(dim=-1)
    keep = (group_mean > low) & (group_mean < high)
    return keep.repeat_interleave(n_samples_per_prompt)


def group_by_prompt(values: Tensor, n: int) -> Tensor:
    """View ``[N]`` values as ``[N // n, n]``: consecutive groups of ``n`` samples per prompt."""
    values = values.reshape(-1)
    if n < 1 or values.numel() % n:
        raise ValueError(f"{values.numel()} samples cannot be split into groups of n_samples_per_prompt={n}")
    return values.view(-1, n)
