"""Make experience: trajectories → ``Experience`` with log-probs, values, KL and advantages.

Each step is a small function the RL loop calls in order: ``from_trajectories`` (tensors, done by
the rollout), ``shape_rewards`` (overlong and stop-properly penalties, normalisation), ``forward_logprobs`` /
``forward_values`` (model passes in micro-batches, no grad) and ``add_advantages`` (KL, group
baselines, reward clipping, returns and whitening from ``tidal.algorithms``).

This is the one path for one process and for data-parallel ranks alike. A rank holds only its share
of the rollout, so the two batch-wide statistics — the running reward moments and the advantage
whitening — come in as a ``BatchReduction``: this process's batch alone (``LOCAL``), or every
rank's (``BatchReduction.over(world)``). A prompt's samples stay on one rank, so group baselines
need nothing from the others.

Order of the reward steps (OpenRLHF's): overlong penalty → stop-properly penalty → normalisation →
group baseline → clip to ``--reward_clip_range`` → KL penalty. Clipping comes *after* the baseline, so it bounds the shaped
reward that reaches the advantages, not the raw reward the baseline is computed from.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from tidal.algorithms import compute_kl, estimate_advantages, masked_whiten, overlong_penalty
from tidal.algorithms.advantages import Whitening, masked_centre
from tidal.algorithms.rewards import RunningMoments, stop_properly_penalty
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.collectives import gather_values, world_masked_mean, world_masked_whiten
from tidal.distributed.world import World
from tidal.experience.experience import Experience, forced_experts, micro_batches, model_batch, unflatten
from tidal.experience.images import ExperienceImages
from tidal.logging.phases import Progress
from tidal.models.forward import token_logprobs
from tidal.models.moe_routing import replayed_routing
from tidal.models.precision import Precision
from tidal.models.ring_attention import active_ring, turns
from tidal.rewards.base import check_finite


def _this_batch(values: Tensor) -> Tensor:
    return values


@dataclass(frozen=True)
class BatchReduction:
    """The batch-wide statistics of the experience path: ``whiten`` (advantages over the batch),
    ``centre`` (the same without the std, ``--no_advantage_std_norm``) and ``gather`` (the rewards
    that update the running moments)."""

    whiten: Whitening = masked_whiten
    gather: Callable[[Tensor], Tensor] = _this_batch
    centre: Whitening = masked_centre

    @classmethod
    def over(cls, world: World) -> BatchReduction:
        """Statistics over every rank's share of the rollout (this batch alone with one process)."""
        if not world.distributed:
            return LOCAL
        return cls(
            partial(world_masked_whiten, world=world),
            partial(gather_values, world=world),
            partial(world_masked_centre, world=world),
        )


def world_masked_centre(x: Tensor, mask: Tensor, world: World) -> Tensor:
    """``masked_centre`` with the mean over every process's masked entries."""
    centred = x - world_masked_mean(x, mask, world)
    return torch.where(mask != 0, centred, torch.zeros((), dtype=x.dtype, device=x.device))


LOCAL = BatchReduction()


def from_trajectories(trajectories: Sequence, pad_id: int) -> Experience:
    """Right-padded tensors from ``tidal.agents.Trajectory`` objects (rewards 0 where unscored)."""
    width = max(len(t.token_ids) for t in trajectories)
    n = len(trajectories)
    seq = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    act = torch.zeros((n, width), dtype=torch.long)
    logp = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        length = len(t.token_ids)
        seq[i, :length] = torch.tensor(t.token_ids)
        attn[i, :length] = 1
        act[i, :length] = torch.tensor(t.action_mask)
        logp[i, :length] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    # Single-turn trajectories are scored later; agents reward (and optionally score) them directly.
    # Executors that override ``run`` skip the per-sample checks, so agent rewards are checked here too.
    rewards = check_finite(
        [t.reward if t.reward is not None else 0.0 for t in trajectories], "reward", "agent"
    )
    scores = check_finite(
        [t.score if t.score is not None else float(r) for t, r in zip(trajectories, rewards, strict=True)],
        "score",
        "agent",
    )
    return Experience(
        seq,
        attn,
        act,
        logp,
        rewards=rewards,
        scores=scores,
        routed_experts=_routed_experts(trajectories, width),
        truncated=torch.tensor([getattr(t, "finish_reason", None) == "length" for t in trajectories]),
        images=ExperienceImages.from_trajectories(trajectories),
        weight_updates=_weight_updates(trajectories, width),
    )


def _weight_updates(trajectories: Sequence, width: int) -> Tensor | None:
    """Partial rollouts: each token's weight updates during its rollout ``[N, width]``; None without."""
    if all(getattr(t, "weight_updates", None) is None for t in trajectories):
        return None
    out = torch.zeros((len(trajectories), width), dtype=torch.long)
    for i, t in enumerate(trajectories):
        out[i, : len(t.weight_updates)] = torch.tensor(t.weight_updates)
    return out


def _routed_experts(trajectories: Sequence, width: int) -> Tensor | None:
    """Router replay: the engine's expert ids ``[N, width, layers, k]`` (-1 where none was recorded: the
    last token, padding); ``None`` when the rollout recorded none."""
    routed = [getattr(t, "routed_experts", None) for t in trajectories]
    if all(r is None for r in routed):
        return None
    shape = next(r for r in routed if r is not None).shape[1:]
    out = torch.full((len(trajectories), width, *shape), -1, dtype=torch.int16)
    for i, (t, r) in enumerate(zip(trajectories, routed, strict=True)):
        if r is None:
            raise ValueError(f"router replay: sample {i} of the rollout has no recorded experts")
        n = min(len(r), len(t.token_ids))  # a truncated trajectory drops the routing past its end
        out[i, :n] = torch.as_tensor(r[:n], dtype=torch.int16)
    return out


@torch.no_grad()
def _per_token(
    fn: Callable[[dict], Tensor],
    exp: Experience,
    micro: int,
    packing: bool,
    max_tokens=None,
    model: nn.Module | None = None,
    replay: bool = False,
    label: str = "forward",
) -> Tensor:
    """Run ``fn`` over micro-batches of ``exp`` and reassemble an ``[N, T]`` tensor; with ``replay``,
    ``model``'s routers take the experts the engine recorded (``--moe_router_replay``). Under ring
    attention the ring group takes turns (``ring_attention.turns``): every rank runs every rank's
    micro-batches and keeps its own."""
    device = exp.sequences.device
    out = torch.zeros(exp.sequences.shape, dtype=torch.float32, device=device)
    groups = micro_batches(exp, micro, max_tokens)
    with Progress(f"make experience: {label}", len(groups), "micro-batches") as progress:
        return _run_micro_batches(fn, exp, groups, packing, out, progress, model, replay)


def _run_micro_batches(fn, exp, groups, packing, out, progress, model, replay) -> Tensor:
    """``_per_token``'s loop, each micro-batch counted by ``progress`` (under a ring: this rank's own)."""
    device = out.device
    ring = active_ring()
    if ring is not None:
        batches = [{k: v.cpu() for k, v in model_batch(exp.select(rows), packing).items()} for rows in groups]
        own = iter(groups)
        for mine, batch in turns(batches, ring):
            values = fn({k: v.to(device) for k, v in batch.items()})
            if mine:
                progress.update(1)
                rows = next(own)
                values = unflatten(values.float(), exp.select(rows), packing)
                out[rows, : values.shape[1]] = values
        return out
    for rows in groups:
        part = exp.select(rows)
        with replayed_routing(model, forced_experts(part, packing) if replay else None):
            values = unflatten(fn(model_batch(part, packing)).float(), part, packing)
        out[rows, : values.shape[1]] = values
        progress.update(1)
    return out


def forward_logprobs(
    model: nn.Module,
    exp: Experience,
    micro: int,
    packing: bool,
    temperature: float,
    precision: Precision,
    max_tokens: int | None = None,
    replay: bool = False,
) -> Tensor:
    """Per-token log-probs ``[N, T]`` of ``exp.sequences`` under ``model`` (sampling temperature applied);
    ``replay``: route every token to the experts the engine chose (``exp.routed_experts``)."""
    model.eval()

    def fn(batch):
        with precision.autocast():
            return token_logprobs(model, batch, temperature)[0]

    return _per_token(fn, exp, micro, packing, max_tokens, model, replay, label="log-probs")


def forward_values(
    critic, exp: Experience, micro: int, packing: bool, precision: Precision, max_tokens: int | None = None
) -> Tensor:
    """Critic values ``[N, T]`` aligned with tokens: column t is V(state before token t)."""
    critic.eval()

    def fn(batch):
        with precision.autocast():
            return shift_values(critic.values(batch))

    return _per_token(fn, exp, micro, packing, max_tokens, label="values")


def shift_values(raw: Tensor) -> Tensor:
    """The critic reads token t and values the state after it; token t's action is taken from t − 1."""
    return torch.cat([raw.new_zeros(raw.shape[0], 1), raw[:, :-1]], dim=1)


def shape_rewards(
    exp: Experience,
    cfg: AlgorithmConfig,
    max_new_tokens: int,
    moments: RunningMoments | None,
    reduction: BatchReduction = LOCAL,
) -> Tensor:
    """Scalar rewards after the DAPO overlong penalty, the stop-properly penalty (truncated samples'
    rewards scaled by ``--stop_properly_penalty_coef``) and running normalisation (clipping comes
    later, after the group baseline, in ``add_advantages``). The moments take in the rewards of the
    whole rollout (``reduction.gather``), so every rank normalises alike."""
    rewards = exp.rewards.clone()
    if cfg.overlong_buffer_len:
        lengths = exp.action_mask.sum(-1)
        rewards += overlong_penalty(
            lengths, max_new_tokens, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        )
    if cfg.stop_properly_penalty_coef is not None and exp.truncated is not None:
        rewards = stop_properly_penalty(rewards, exp.truncated, cfg.stop_properly_penalty_coef)
    if moments is not None:
        moments.update(reduction.gather(rewards))
        rewards = moments.normalize(rewards)
    return rewards


def add_advantages(
    exp: Experience, cfg: AlgorithmConfig, n_samples: int, kl_coef: float, reduction: BatchReduction = LOCAL
) -> Experience:
    """Fill ``kl``, ``advantages`` and ``returns`` (KL goes into the reward unless ``--use_kl_loss``).

    The shaped reward is clipped to ``--reward_clip_range`` after the group baseline; estimators that
    whiten (gae, reinforce, reinforce_baseline) do it with ``reduction.whiten``, or only centre the
    advantages with ``reduction.centre`` under ``--no_advantage_std_norm``."""
    mask = exp.action_mask
    if exp.ref_logprobs is not None:
        exp.kl = compute_kl(exp.old_logprobs, exp.ref_logprobs, mask, cfg.kl_estimator)
    kl_in_reward = exp.kl if not cfg.use_kl_loss else None
    exp.advantages, exp.returns, _ = estimate_advantages(
        cfg.advantage_estimator, exp.rewards, mask, n_samples, kl=kl_in_reward, kl_coef=kl_coef,
        values=exp.values, gamma=cfg.gamma, lambd=cfg.lambd, reward_clip_range=tuple(cfg.reward_clip_range),
        whiten=reduction.centre if cfg.no_advantage_std_norm else reduction.whiten,
    )  # fmt: skip
    return exp
