"""Batch-invariant sampled-token log-probs: each row's softmax sums are reduced over the vocabulary in an
order that depends only on its length (on CUDA, the Triton kernel, with a chunked torch backward).
"""

from __future__ import annotations

import torch

from tidal.rollout.batch_invariant import dispatch
from tidal.rollout.batch_invariant.elementwise import pointwise


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``tokens`` (float32), each row reduced on its own.
    ``temperature``: a number, or a tensor broadcasting against ``logits[..., :1]``."""
    if dispatch.on_triton(logits):
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
        if torch.is_grad_enabled() and logits.requires_grad:
            return _TokenLogprobs.apply(logits, tokens, temp)
        return dispatch.kernels().token_logprobs(logits, tokens, temp)
    z = logits.float()
    temp = torch.as_tensor(temperature, dtype=torch.float32, device=z.device)
    z = z / (temp if temp.dim() == 0 else temp[..., None])
    top = z.amax(-1, keepdim=True)
    total = pointwise(torch.exp, z - top).sum(-1, keepdim=True)
    lse = top + pointwise(torch.log, total)
    return (z.gather(-1, tokens[..., None]) - lse).squeeze(-1)


class _TokenLogprobs(torch.autograd.Function):
    """The log-prob kernel, with the gradient ``(onehot(token) - softmax(z)) / T`` computed over chunks of
    rows: a trainer's micro-batch has ~20k rows of a 152k vocabulary, whose float32 softmax at once
    would take ~12 GB per temporary."""

    CHUNK = 2048  # rows per backward chunk

    @staticmethod
    def forward(ctx, logits, tokens, temp):
        ctx.save_for_backward(logits, tokens, temp)
        return dispatch.kernels().token_logprobs(logits, tokens, temp)

    @staticmethod
    def backward(ctx, grad):
        logits, tokens, temp = ctx.saved_tensors
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        rows = logits.reshape(-1, vocab)
        toks = tokens.expand(lead).reshape(-1, 1)
        scale = (grad.float() / temp.expand(lead)).reshape(-1, 1)
        out = torch.empty_like(rows)
        for start in range(0, rows.shape[0], _TokenLogprobs.CHUNK):
            part = slice(start, start + _TokenLogprobs.CHUNK)
            temps = temp.expand(lead).reshape(-1, 1)[part]
            d = torch.softmax(rows[part].float() / temps, -1).mul_(-scale[part])
            out[part] = d.scatter_add_(1, toks[part], scale[part]).to(out.dtype)
        return out.view(logits.shape), None, None
