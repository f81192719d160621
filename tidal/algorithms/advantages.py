"""Advantage estimators for the PPO family (PPO, REINFORCE++, GRPO, Dr. GRPO, RLOO).

An estimator is two steps plus two facts, kept together in one registry entry so a trainer does
``est = ADVANTAGE_ESTIMATORS[name]`` and never branches on the name:

1. ``est.baseline(R, n)`` shapes the scalar rewards ``R`` ``[N]`` within each prompt group of ``n``
   consecutive samples (``N = num_prompts · n``);
2. the shaped ``R`` becomes per-token rewards (``rewards.kl_penalized_rewards``), and
   ``est.compute(token_rewards, action_mask, values, gamma, lambd)`` turns them into
   ``(advantages, returns)``, both ``[B, T]``, whitened over the batch when ``est.whiten`` (only
   centred, ``masked_centre``, with ``--no_advantage_std_norm``: OpenRLHF v0.9.2 subtracts the
   batch mean and skips the division by the std);
3. ``est.needs_critic`` says whether values (a critic model) are required, ``est.grouped`` whether the
   baseline needs a prompt group (n ≥ 2), ``est.discounted`` whether γ < 1 applies.

A new estimator is one baseline function decorated with ``@advantage_estimator(name, returns, ...)``
in this file; the ``--advantage_estimator`` choices and the trainers read ``ADVANTAGE_ESTIMATORS``.

Group baselines (``group_std`` is the *unbiased* std, ``torch.std``'s default, as OpenRLHF, TRL and
verl compute GRPO; it needs n ≥ 2):

- ``gae``, ``reinforce``: R unchanged.
- ``reinforce_baseline`` (REINFORCE++-baseline, arXiv 2501.03262), ``dr_grpo`` (arXiv 2503.20783):
  R_i − mean(R).
- ``rloo`` (arXiv 2402.14740): R_i − (ΣR − R_i)/(n − 1), the mean of the *other* samples.
- ``group_norm`` (GRPO, arXiv 2402.03300): (R_i − mean(R)) / (std(R) + 1e−9).

Masked positions inside a row (multi-turn observations) are transparent: they carry neither reward
nor value, and the recursion skips them without discounting, so the next *action* token's value
bootstraps the current one. V after the last action token is 0. (OpenRLHF runs the recursion through
them as steps of reward 0 and value 0; the two agree at γ = λ = 1: docs/algorithms.md's differences.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tidal.algorithms.masked import masked_mean, masked_whiten
from tidal.algorithms.rewards import group_by_prompt, kl_penalized_rewards

GROUP_NORM_EPS = 1e-9

# (advantages, action_mask) -> whitened advantages: ``masked_whiten`` or its all-process version
Whitening = Callable[[Tensor, Tensor], Tensor]


def masked_centre(x: Tensor, mask: Tensor) -> Tensor:
    """``x − mean`` over the masked entries of the whole tensor, not divided by the std
    (``--no_advantage_std_norm``); masked-out entries become 0, as ``masked_whiten`` leaves them."""
    centred = x - masked_mean(x, mask)
    return torch.where(mask != 0, centred, torch.zeros((), dtype=x.dtype, device=x.device))


@dataclass(frozen=True)
class AdvantageEstimator:
    """One registry entry: the group baseline, the token-level recursion and the facts trainers and
    config checks read (never the name)."""

    baseline: Callable[[Tensor, int], Tensor]
    advantages_and_returns: Callable[..., tuple[Tensor, Tensor]]
    whiten: bool
    needs_critic: bool
    # γ < 1 applies (gae, reinforce); the group-baseline estimators use undiscounted returns, as
    # OpenRLHF forces γ = 1 for them (tidal refuses --gamma < 1 there instead of ignoring it)
    discounted: bool = False
    # the baseline compares the samples of a prompt group: needs n_samples_per_prompt >= 2
    grouped: bool = False

    def compute(
        self,
        token_rewards: Tensor,
        action_mask: Tensor,
        values: Tensor | None = None,
        gamma: float = 1.0,
        lambd: float = 1.0,
        whiten: Whitening = masked_whiten,
    ) -> tuple[Tensor, Tensor]:
        """``(advantages, returns)`` ``[B, T]``; advantages whitened by ``whiten`` when ``self.whiten``
        (over this batch by default; a data-parallel trainer passes a whitening over every process)."""
        advantages, returns = self.advantages_and_returns(token_rewards, action_mask, values, gamma, lambd)
        if self.whiten:
            advantages = whiten(advantages, action_mask)
        return advantages, returns


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def advantage_estimator(
    name: str,
    returns: Callable[..., tuple[Tensor, Tensor]],
    *,
    whiten: bool,
    needs_critic: bool = False,
    discounted: bool = False,
    grouped: bool = False,
):
    """Register the decorated baseline function as estimator ``name`` with its token-level recursion
    (``returns``) and facts; a function may carry several (``no_baseline`` is gae's and reinforce's)."""

    def add(baseline: Callable[[Tensor, int], Tensor]):
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            baseline, returns, whiten, needs_critic, discounted, grouped
        )
        return baseline

    return add


def _require_group(n: int, name: str) -> None:
    if n < 2:
        raise ValueError(f"advantage estimator {name!r} needs n_samples_per_prompt >= 2, got {n}")


@torch.no_grad()
def gae_advantages_and_returns(
    token_rewards: Tensor, action_mask: Tensor, values: Tensor | None, gamma: float = 1.0, lambd: float = 1.0
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al., arXiv 1506.02438): δ_t = r_t + γV_{t+1} − V_t, A_t = δ_t + γλA_{t+1},
    returns = A + V. Both outputs are 0 on masked positions and carry no gradient."""
    if values is None:
        raise ValueError("gae needs values from a critic")
    mask = action_mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=token_rewards.device)
    rewards = torch.where(mask, token_rewards.float(), zero)
    values = torch.where(mask, values.float(), zero)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        # masked positions are transparent: keep the carried value/advantage unchanged
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        advantages[:, t] = torch.where(mask[:, t], advantage, zero)
    return advantages, torch.where(mask, advantages + values, zero)


@torch.no_grad()
def discounted_returns(
    token_rewards: Tensor,
    action_mask: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """A_t = Σ_{s≥t} γ^{s−t} r_s over action tokens; returns = A. ``values``/``lambd`` are unused
    (same signature as GAE)."""
    mask = action_mask != 0
    zero = torch.zeros((), dtype=torch.float32, device=token_rewards.device)
    rewards = torch.where(mask, token_rewards.float(), zero)
    if gamma == 1.0:  # fast path: a reverse cumulative sum
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[-1])):
            running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
    returns = torch.where(mask, returns, zero)
    return returns, returns.clone()


# ---- group baselines, each registered as the estimators that use it ----------------------------


@advantage_estimator("reinforce", discounted_returns, whiten=True, discounted=True)
@advantage_estimator("gae", gae_advantages_and_returns, whiten=True, needs_critic=True, discounted=True)
def no_baseline(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """R unchanged (``gae``, ``reinforce``)."""
    return rewards.float().reshape(-1)


@advantage_estimator("dr_grpo", discounted_returns, whiten=False, grouped=True)
@advantage_estimator("reinforce_baseline", discounted_returns, whiten=True, grouped=True)
def mean_baseline(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """R_i − mean of its group (REINFORCE++-baseline, Dr. GRPO)."""
    groups = group_by_prompt(rewards.float(), n_samples_per_prompt)
    return (groups - groups.mean(dim=-1, keepdim=True)).reshape(-1)


@advantage_estimator("rloo", discounted_returns, whiten=False, grouped=True)
def leave_one_out_baseline(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """RLOO (Ahmadian et al., arXiv 2402.14740): R_i − (ΣR − R_i)/(n − 1)."""
    _require_group(n_samples_per_prompt, "rloo")
    groups = group_by_prompt(rewards.float(), n_samples_per_prompt)
    others_mean = (groups.sum(dim=-1, keepdim=True) - groups) / (n_samples_per_prompt - 1)
    return (groups - others_mean).reshape(-1)


@advantage_estimator("group_norm", discounted_returns, whiten=False, grouped=True)
def group_normalized(rewards: Tensor, n_samples_per_prompt: int) -> Tensor:
    """GRPO (Shao et al., arXiv 2402.03300): (R_i − mean) / (unbiased std + 1e−9) per group."""
    _require_group(n_samples_per_prompt, "group_norm")
    groups = group_by_prompt(rewards.float(), n_samples_per_prompt)
    centred = groups - groups.mean(dim=-1, keepdim=True)
    return (centred / (groups.std(dim=-1, keepdim=True) + GROUP_NORM_EPS)).reshape(-1)


def estimate_advantages(
    estimator: str,
    rewards: Tensor,
    action_mask: Tensor,
    n_samples_per_prompt: int,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    reward_clip_range: tuple[float, float] | None = None,
    whiten: Whitening = masked_whiten,
) -> tuple[Tensor, Tensor, Tensor]:
    """Whole pipeline: group baseline on ``R`` → clip → KL-in-reward token rewards → advantages/returns.

    Returns ``(advantages, returns, token_rewards)``, all ``[B, T]``. The reward clip ``[low, high]``
    applies to the *shaped* scalar reward (after the group baseline) placed on the last action token,
    as OpenRLHF's ``compute_reward`` does: RLOO on ``[0, 0, 0, 20]`` with clip 10 gives
    ``[−6.67, −6.67, −6.67, 10]``. ``whiten`` is the batch whitening of the estimators that whiten.
    This is the one path of every trainer (one process or several).
    """
    est = ADVANTAGE_ESTIMATORS[estimator]
    if est.needs_critic and values is None:
        raise ValueError(f"advantage estimator {estimator!r} needs values from a critic")
    shaped = est.baseline(rewards, n_samples_per_prompt)
    token_rewards = kl_penalized_rewards(shaped, kl, action_mask, kl_coef, reward_clip_range)
    advantages, returns = est.compute(token_rewards, action_mask, values, gamma, lambd, whiten)
    return advantages, returns, token_rewards
