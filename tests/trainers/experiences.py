"""``Experience`` builders shared by the RL tests: hand-made rows, no model or engine behind them."""

from __future__ import annotations

import torch

from tidal.experience.experience import Experience


def reward_rows(rewards: torch.Tensor, width: int = 3, truncated: torch.Tensor | None = None) -> Experience:
    """One row per reward, ``width`` tokens of id 1: one prompt token, then action tokens; ``rewards`` as
    both rewards and scores, zero rollout and old log-probs (for the reward and advantage arithmetic)."""
    n = rewards.numel()
    ones = torch.ones(n, width, dtype=torch.long)
    mask = ones.clone()
    mask[:, 0] = 0  # one prompt token
    zeros = torch.zeros(n, width)
    return Experience(ones, ones, mask, zeros, rewards=rewards.clone(), scores=rewards.clone(),
                      old_logprobs=zeros.clone(), truncated=truncated)  # fmt: skip


def policy_rows(
    n: int, width: int, seed: int, prompt_tokens: int = 3, lengths: list[int] | None = None
) -> Experience:
    """``n`` rows of random token ids (``lengths`` tokens each, right-padded; default: all ``width``), the
    first ``prompt_tokens`` of each a prompt, with random advantages on the action tokens and zero rollout
    log-probs, rewards and scores (for a policy update). Drawn from a generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    attn = torch.ones(n, width, dtype=torch.long)
    for row, length in enumerate(lengths or []):
        attn[row, length:] = 0
    action = attn.clone()
    action[:, :prompt_tokens] = 0
    seq = torch.randint(5, 500, (n, width), generator=g) * attn
    zeros = torch.zeros(n, width)
    return Experience(seq, attn, action, zeros, rewards=torch.zeros(n), scores=torch.zeros(n),
                      advantages=torch.randn(n, width, generator=g) * action)  # fmt: skip
