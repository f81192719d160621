"""Trainer fast paths against plain references on realistic shapes (skipped without a GPU): the Triton
LM-head log-probs and gradients at a 152k vocabulary over long sequences in bf16, and packed varlen
flash attention over long sequences of uneven lengths."""

from __future__ import annotations

import pytest
import torch

from tidal.algorithms.logprobs import gather_logprobs
from tidal.models.logprob_head import chunked_logprobs

pytestmark = pytest.mark.gpu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_lm_head_logprobs_and_grads_at_152k_vocab_bf16(temperature):
    """8,192 positions, hidden 896, vocabulary 151,936, bf16 weights: log-probs and both gradients of the
    chunked Triton path against full float32 logits of the same bf16 tensors."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden_size, vocab = 8192, 896, 151936
    hidden = (torch.randn(tokens, hidden_size, device="cuda", generator=gen)).to(torch.bfloat16)
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    upstream = torch.randn(tokens, device="cuda", generator=gen)

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = chunked_logprobs(h, w, None, targets, temperature, chunk_size=2048)
    (logp.float() * upstream).sum().backward()

    h_ref, w_ref = hidden.float().requires_grad_(), weight.float().requires_grad_()
    want = gather_logprobs(h_ref @ w_ref.T, targets, temperature)
    (want * upstream).sum().backward()
    # bf16 logits (the head matmul's output) round by ~0.4%: a few 1e-2 in log-prob at most.
    assert (logp.float() - want.detach()).abs().max().item() < 0.1
    assert _rel(logp.detach(), want.detach()) < 2e-3
    assert _rel(h.grad, h_ref.grad) < 2e-2 and _rel(w.grad, w_ref.grad) < 2e-2
    for start in range(0, tokens, 2048):  # every chunk, not only on average
        assert _rel(h.grad[start : start + 2048], h_ref.grad[start : start + 2048]) < 2e-2, start


def test_varlen_flash_attention_on_long_uneven_sequences():
    """Four sequences (8,192 + 3,001 + 5,000 + 190 tokens) packed in one row, 14 query / 2 KV heads of
    64, bf16: the varlen kernel against causal SDPA of each sequence alone in float32. Attention that
    crossed a sequence boundary would differ by far more."""
    from tidal.models.packed_attention import _varlen

    gen = torch.Generator(device="cuda").manual_seed(0)
    lens = [8192, 3001, 5000, 190]
    total, heads, kv_heads, dim = sum(lens), 14, 2, 64
    q = torch.randn(total, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(total, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(total, kv_heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    out = _varlen(q, k, v, cu, max(lens), None)

    def sdpa(start: int, end: int, window_start: int) -> torch.Tensor:
        qs = q[start:end].float().transpose(0, 1)[None]
        ks, vs = (t[window_start:end].float().transpose(0, 1)[None] for t in (k, v))
        mask = torch.ones(end - start, end - window_start, dtype=torch.bool, device="cuda").tril(
            start - window_start
        )
        return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[
            0
        ]

    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        want = sdpa(start, end, start).transpose(0, 1)
        err = _rel(out[start:end], want)
        assert err < 1e-2, (i, err)
        if start > 0:  # the same queries also attending to the previous sequences
            assert _rel(sdpa(start, end, 0).transpose(0, 1), want) > 10 * err
