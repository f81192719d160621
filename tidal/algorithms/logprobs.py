"""Log-probabilities and entropy from logits, memory-friendly.

``logits`` are ``[B, T, V]`` (or ``[N, V]``); ``logits[..., t, :]`` scores ``tokens[..., t]``: callers
shift by one for next-token prediction (``logits[:, :-1]`` against ``input_ids[:, 1:]``).
Everything is computed in float32 (bf16 log-softmax loses ~2 digits), one chunk of ``chunk_size``
positions at a time, so the float32 copy of a ``[chunk, V]`` slice is the only large temporary:
``log π(x) = z_x − logsumexp(z)`` never materialises the full log-softmax. (Under autograd each
chunk's activations are still kept for backward; chunking then mainly caps the float32 upcast.)
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunks(t: Tensor, chunk_size: int | None) -> tuple[Tensor, ...]:
    # split along the position dimension (-2 for logits, -1 for token ids is handled by callers)
    return (t,) if chunk_size is None else t.split(chunk_size, dim=-2)


def gather_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> Tensor:
    """``log softmax(logits / temperature)`` at ``tokens``; shape of ``tokens``, float32.

    ``tokens`` must be valid ids (replace padding/ignore ids, e.g. −100, before calling).
    """
    pieces = []
    token_chunks = (tokens,) if chunk_size is None else tokens.split(chunk_size, dim=-1)
    for logit_chunk, token_chunk in zip(_chunks(logits, chunk_size), token_chunks, strict=True):
        z = logit_chunk.float()
        if temperature != 1.0:
            z = z / temperature
        picked = z.gather(-1, token_chunk.unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(pieces, dim=-1)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int | None = None) -> Tensor:
    """Per-position entropy ``H = logsumexp(z) − Σ softmax(z)·z`` with ``z = logits / temperature``
    (stable: no log of a probability); shape ``logits.shape[:-1]``, float32.

    The RL entropy bonus (``--entropy_loss_coef``) passes the sampling temperature, so it is the
    entropy of π_T = softmax(logits / T): the distribution the rollouts were sampled from and whose
    log-probs the policy ratios use, so the bonus regularises the policy being optimised. OpenRLHF
    takes the entropy of the raw logits (T = 1); the two agree at ``--temperature 1``."""
    pieces = []
    for logit_chunk in _chunks(logits, chunk_size):
        z = logit_chunk.float()
        if temperature != 1.0:
            z = z / temperature
        probs = torch.softmax(z, dim=-1)
        pieces.append(torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1))
    return torch.cat(pieces, dim=-1)
