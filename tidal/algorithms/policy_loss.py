"""Policy-gradient losses: PPO and GSPO (clipped surrogates), CISPO and SAPO (tidal additions).

One signature for the family, chosen by name from ``POLICY_LOSSES``::

    loss_fn(logp, old_logp, advantages, action_mask, **params) -> (per_token_loss [B, T], stats)

``params`` are the loss's own parameters, carried by a small typed object whose fields are the loss's
keyword names (``kwargs()``): ``ClipParams`` for ppo, gspo and cispo (the clip ε ``clip_eps_low``,
``clip_eps_high``, and ``dual_clip``, which only the clipped surrogates ppo and gspo accept),
``SapoParams`` for sapo (its gate temperatures ``tau_pos``, ``tau_neg``).
``AlgorithmConfig.policy_loss_params()`` builds the one the flags select.

``per_token_loss`` is 0 on masked positions; reduce it with ``masked.aggregate_loss``. ``stats`` are
detached scalars over the action tokens: ``clip_ratio`` (tokens where the clipped branch is taken),
``dual_clip_ratio`` and ``approx_kl`` (k3 estimate of KL(π_old || π), i.e. mean of ρ − 1 − log ρ).

Sign convention: the *loss* is minimised, so the surrogate objective enters with a minus sign:
``loss = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A)``. Dual clip (Ye et al. 2019, arXiv 1912.09729) with
c > 1 bounds the objective from below for negative advantages: ``objective = max(min(ρA, clip·A), cA)``
when A < 0, i.e. ``loss = min(loss, −cA) = min(loss, c|A|)``, so a huge ρ on a bad action cannot
blow up the loss. Asymmetric ε ("clip-higher") is DAPO's (arXiv 2503.14476).

The log-ratio is clamped to ±20 before ``exp`` (ρ ≤ 4.9e8) so float32 never overflows.

Each loss also declares its own aggregation (``DEFAULT_AGGREGATION``), used when ``--loss_agg_mode`` is
not given (``loss_aggregation``): ``ppo`` the token mean, ``gspo`` the per-sequence mean, as OpenRLHF
always aggregates them (its ``PolicyLoss`` sets ``token_level_loss=False`` for GSPO); ``cispo`` the
token mean and ``sapo`` the per-sequence mean, as their papers write the objective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from tidal.algorithms.masked import masked_mean
from tidal.algorithms.registry import register

POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
# loss name -> its ``masked.LOSS_AGGREGATIONS`` mode when ``--loss_agg_mode`` is not given
DEFAULT_AGGREGATION: dict[str, str] = {}

LOG_RATIO_CLAMP = 20.0
# SAPO's gate temperatures (τ_pos, τ_neg) when --tau_pos/--tau_neg are not given: the paper's
SAPO_TAUS = (1.0, 1.05)


class _LossParams:
    """A loss's parameters as a frozen dataclass whose field names are the loss's keyword arguments."""

    def kwargs(self) -> dict[str, float | None]:
        return asdict(self)


@dataclass(frozen=True)
class ClipParams(_LossParams):
    """The parameters of the clipped losses (ppo, gspo, cispo): the clip ε and, for ppo and gspo only,
    the dual-clip constant c."""

    clip_eps_low: float
    clip_eps_high: float | None = None  # None: clip_eps_low (symmetric)
    dual_clip: float | None = None


@dataclass(frozen=True)
class SapoParams(_LossParams):
    """SAPO's parameters: its gate temperatures for positive and negative advantages."""

    tau_pos: float = SAPO_TAUS[0]
    tau_neg: float = SAPO_TAUS[1]


PolicyLossParams = ClipParams | SapoParams


def policy_loss(name: str, aggregation: str) -> Callable:
    """Register the decorated loss as ``POLICY_LOSSES[name]`` with its default aggregation mode."""

    def add(fn: Callable) -> Callable:
        register(POLICY_LOSSES, name)(fn)
        DEFAULT_AGGREGATION[name] = aggregation
        return fn

    return add


def loss_aggregation(loss_type: str, requested: str | None = None) -> str:
    """The aggregation mode of ``loss_type``: ``requested`` (an explicit ``--loss_agg_mode``) when given,
    else the loss's own default (``DEFAULT_AGGREGATION``)."""
    return DEFAULT_AGGREGATION[loss_type] if requested is None else requested


def _masked_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log π − log π_old on action tokens, 0 on padding (exp of garbage would poison the gradient)."""
    zero = torch.zeros_like(logp, dtype=torch.float32)
    return torch.where(mask, logp.float() - old_logp.float(), zero)


def _ratio(log_ratio: Tensor) -> Tensor:
    """ρ = exp(log-ratio), the log-ratio clamped to ±``LOG_RATIO_CLAMP`` so float32 never overflows."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _approx_kl(token_log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(π_old || π) over the action tokens: mean of ρ − 1 − log ρ."""
    return masked_mean(torch.expm1(token_log_ratio) - token_log_ratio, mask)


def _refuse_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise ValueError(f"dual_clip is a bound of the ppo/gspo clipped surrogate; {name} has none")


def _clipped_surrogate(
    log_ratio: Tensor,
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float,
    clip_eps_high: float | None,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    advantages = advantages.float()
    ratio = _ratio(log_ratio)
    surr_unclipped = ratio * advantages
    surr_clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.min(surr_unclipped, surr_clipped)
    clipped = surr_clipped < surr_unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (bound < loss)
        loss = torch.where(dual_clipped, bound, loss)
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    with torch.no_grad():
        stats = {
            "clip_ratio": masked_mean(clipped.float(), mask),
            "dual_clip_ratio": masked_mean(dual_clipped.float(), mask),
            "approx_kl": _approx_kl(token_log_ratio, mask),
        }
    return loss, stats


@policy_loss("ppo", aggregation="token")
def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al., arXiv 1707.06347) with per-token ratio
    ρ_t = exp(log π_t − log π_old,t)."""
    mask = action_mask != 0
    log_ratio = _masked_log_ratio(logp, old_logp, mask)
    return _clipped_surrogate(
        log_ratio, log_ratio.detach(), advantages, mask, clip_eps_low, clip_eps_high, dual_clip
    )


@policy_loss("gspo", aggregation="sequence")
def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., arXiv 2507.18071): sequence-level ratio s_i = exp(mean_t log-ratio).

    Implemented as GSPO-token: log s_{i,t} = sg[log s_i] + log π_t − sg[log π_t], whose value is the
    sequence ratio on every token (so clipping is per sequence) and whose gradient is s_i·∇log π_t.
    With a per-sequence advantage this equals GSPO's gradient; it also accepts per-token
    advantages. The paper's ε are tiny (3e-4 / 4e-4, the defaults here). Its default aggregation is
    ``"sequence"`` (mean over sequences of token means), the paper's and OpenRLHF's: only then is the
    GSPO-token gradient the sequence objective's. An explicit ``--loss_agg_mode token`` weighs every
    token the same instead (long sequences count more), a different objective than OpenRLHF's.
    """
    mask = action_mask != 0
    zero = torch.zeros_like(logp, dtype=torch.float32)
    logp = torch.where(mask, logp.float(), zero)
    token_log_ratio = torch.where(mask, logp - old_logp.float(), zero)
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach()
    return _clipped_surrogate(
        log_ratio, token_log_ratio.detach(), advantages, mask, clip_eps_low, clip_eps_high, dual_clip
    )


@policy_loss("cispo", aggregation="token")
def cispo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): ``loss = −sg(r̂)·A·log π`` with the clipped
    importance-sampling weight ``r̂ = clip(ρ, 1−ε_low, 1+ε_high)``, ρ = π/π_old.

    The weight is clipped and detached, never the token: every token keeps the gradient r̂·A·∇log π,
    where PPO's clipped branch gives it none. The loss *value* is the paper's (it contains log π, so it
    is not comparable with ppo's); the gradient is what matters. ``clip_ratio``: the fraction of tokens
    whose weight was clipped. The paper sets no lower bound (ε_low ≥ 1) and tunes ε_high only.
    """
    _refuse_dual_clip("cispo", dual_clip)
    clip_eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    mask = action_mask != 0
    log_ratio = _masked_log_ratio(logp, old_logp, mask).detach()
    ratio = _ratio(log_ratio)
    weight = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    logp = torch.where(mask, logp.float(), torch.zeros_like(logp, dtype=torch.float32))
    loss = torch.where(mask, -weight * advantages.float() * logp, torch.zeros_like(logp))
    stats = {
        "clip_ratio": masked_mean((weight != ratio).float(), mask),
        "approx_kl": _approx_kl(log_ratio, mask),
    }
    return loss, stats


@policy_loss("sapo", aggregation="sequence")
def sapo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    tau_pos: float = SAPO_TAUS[0],
    tau_neg: float = SAPO_TAUS[1],
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, "Soft Adaptive Policy Optimization", arXiv 2511.20347): ``loss = −f(ρ)·A`` with the
    soft gate ``f(ρ) = σ(τ(ρ − 1))·4/τ`` in place of the hard clip, τ = ``tau_pos`` where A > 0, else
    ``tau_neg`` (the paper's defaults 1.0 and 1.05: negative updates fade faster).

    The gradient is ``w·ρ·A·∇log π`` with ``w = 4σ(1−σ)``: 1 on-policy (ρ = 1, where it equals PPO's),
    decaying smoothly as ρ leaves 1; ``gate_weight`` is the mean w over the action tokens.
    """
    _refuse_dual_clip("sapo", dual_clip)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos} tau_neg={tau_neg}")
    mask = action_mask != 0
    advantages = advantages.float()
    log_ratio = _masked_log_ratio(logp, old_logp, mask)
    ratio = _ratio(log_ratio)
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0))
    loss = torch.where(mask, -gate * (4.0 / tau) * advantages, torch.zeros_like(ratio))
    with torch.no_grad():
        stats = {
            "gate_weight": masked_mean(4.0 * gate * (1.0 - gate), mask),
            "approx_kl": _approx_kl(log_ratio.detach(), mask),
        }
    return loss, stats
