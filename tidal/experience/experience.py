"""``Experience``: one rollout batch as typed tensors, and how it is cut into micro-batches.

Every per-token tensor is ``[N, T]`` and aligned with ``sequences``: column ``t`` describes token
``t`` (its log-prob given tokens ``< t``, its value, its reward). ``action_mask`` is 1 on tokens the
policy generated (0 on prompt, padding and environment feedback), so losses never touch anything
else. Rows are right-padded; ``attention_mask`` marks real tokens. ``routed_experts`` (router replay) is
per-token too, with two more dimensions (MoE layer, top-k slot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from tidal.experience.images import ExperienceImages


@dataclass
class Experience:
    """Sequences of a rollout and everything computed about them (OpenRLHF's fields, typed)."""

    sequences: Tensor  # [N, T] token ids: prompt, actions, feedback, padding
    attention_mask: Tensor  # [N, T] 1 on real tokens
    action_mask: Tensor  # [N, T] 1 on policy-generated tokens
    rollout_logprobs: Tensor  # [N, T] the engine's log-probs of the sampled tokens
    rewards: Tensor  # [N] scalar reward per sample (after shaping)
    scores: Tensor  # [N] scores for dynamic filtering / logging
    old_logprobs: Tensor | None = None  # [N, T] policy log-probs before the update
    ref_logprobs: Tensor | None = None  # [N, T] reference-model log-probs
    values: Tensor | None = None  # [N, T] critic values
    kl: Tensor | None = None  # [N, T] per-token KL estimate (policy vs reference)
    advantages: Tensor | None = None  # [N, T]
    returns: Tensor | None = None  # [N, T]
    # --moe_router_replay: [N, T, MoE layers, k] experts the engine routed each token to (-1: not recorded)
    routed_experts: Tensor | None = None
    # [N] bool: the sample ended at the token limit (finish reason "length"); --stop_properly_penalty_coef
    truncated: Tensor | None = None
    # RL with images: each row's pixels and grids (not a tensor: rows hold different image counts)
    images: ExperienceImages | None = None
    # --partial_rollout_enable: [N, T] weight updates the engine received during the rollout before each
    # token was sampled (0 on prompt and padding)
    weight_updates: Tensor | None = None

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)}

    def select(self, rows: Sequence[int] | Tensor) -> Experience:
        """The given rows, trimmed to their longest real length."""
        index = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[index].sum(-1).max())
        picked = {}
        for name, value in self.tensors().items():
            value = value[index]
            picked[name] = value[:, :width] if value.dim() >= 2 else value
        images = None if self.images is None else self.images.select(index)
        return replace(self, **picked, images=images)

    def to(self, device: torch.device) -> Experience:
        images = None if self.images is None else self.images.to(device)
        return replace(self, **{k: v.to(device) for k, v in self.tensors().items()}, images=images)

    @staticmethod
    def concat(parts: Sequence[Experience]) -> Experience:
        """Stack experiences row-wise, right-padding to the widest."""
        width = max(p.sequences.shape[1] for p in parts)
        out = {}
        for f in fields(Experience):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "images":
                out["images"] = ExperienceImages.concat(values, [len(p) for p in parts])
                continue
            if any(v is None for v in values):
                continue
            if values[0].dim() >= 2:  # per-token: pad the token dimension (-1 for expert ids: unrecorded)
                fill = -1 if f.name == "routed_experts" else 0
                values = [_pad_tokens(v, width, fill) for v in values]
            out[f.name] = torch.cat(values)
        return Experience(**out)


def _pad_tokens(x: Tensor, width: int, value: int = 0) -> Tensor:
    """Right-pad dimension 1 (tokens) of a per-token tensor to ``width``."""
    pad = [0, 0] * (x.dim() - 2) + [0, width - x.shape[1]]
    return torch.nn.functional.pad(x, pad, value=value)


def model_batch(exp: Experience, packing: bool) -> dict[str, Tensor]:
    """Inputs for ``tidal.models.forward``: padded rows, or one packed row with segment ids.

    Per-token tensors of the experience are flattened the same way by ``flatten_like``.
    """
    lengths = exp.attention_mask.sum(-1)
    images = {} if exp.images is None else exp.images.batch()  # pixels, grids, images per row
    if not packing:
        positions = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
        batch = {"input_ids": exp.sequences, "attention_mask": exp.attention_mask, "position_ids": positions}
        return {**batch, **images}
    keep = exp.attention_mask.bool()
    batch = {
        "input_ids": exp.sequences[keep][None],
        "position_ids": torch.cat([torch.arange(int(n), device=exp.sequences.device) for n in lengths])[None],
        "segment_ids": torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)[
            None
        ],
    }
    return {**batch, **images, "seq_lens": lengths} if images else batch


def flatten_like(x: Tensor, exp: Experience, packing: bool) -> Tensor:
    """A per-token ``[N, T, ...]`` tensor in the layout of ``model_batch`` (``[1, ΣT, ...]`` when packed)."""
    return x[exp.attention_mask.bool()][None] if packing else x


def forced_experts(exp: Experience, packing: bool) -> Tensor | None:
    """Router replay: ``routed_experts`` as the routers of ``model_batch``'s forward see the tokens —
    ``[tokens, MoE layers, k]``, rows flattened (padding included) or packed; ``None`` without replay."""
    if exp.routed_experts is None:
        return None
    routed = flatten_like(exp.routed_experts, exp, packing)
    return routed.reshape(-1, *routed.shape[2:])


def unflatten(x: Tensor, exp: Experience, packing: bool) -> Tensor:
    """Inverse of ``flatten_like``: back to ``[N, T]`` (zeros on padding)."""
    if not packing:
        return x
    out = x.new_zeros(exp.attention_mask.shape)
    out[exp.attention_mask.bool()] = x[0]
    return out


def micro_batches(exp: Experience, size: int, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch: ``size`` rows each, or rows up to a token budget.

    With ``max_tokens`` (``--use_dynamic_batch``) rows are grouped greedily in order so that each
    micro-batch holds at most ``max_tokens`` real tokens (a longer row goes alone).
    """
    n = len(exp)
    if max_tokens is None:
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    lengths = exp.attention_mask.sum(-1).tolist()
    groups: list[list[int]] = [[]]
    used = 0
    for i, length in enumerate(lengths):
        if groups[-1] and used + length > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += length
    return groups
