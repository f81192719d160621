"""Log-probs of given tokens and the token cross-entropy (SFT) loss."""

import math

import torch
from torch.testing import assert_close

from tidal.algorithms.logprobs import gather_logprobs
from tidal.algorithms.masked import aggregate_loss
from tidal.algorithms.sft import loss_mask_from_labels, token_cross_entropy

LOGITS = torch.tensor([[[0.0, math.log(3.0), 0.0], [math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]]])
# probabilities per position: [.2, .6, .2], [.5, .25, .25], [1/3, 1/3, 1/3]


def test_gather_logprobs_by_hand_and_temperature():
    tokens = torch.tensor([[1, 0, 2]])
    assert_close(
        gather_logprobs(LOGITS, tokens), torch.tensor([[math.log(0.6), math.log(0.5), -math.log(3.0)]])
    )
    # temperature 2 on doubled logits is the same distribution
    assert_close(gather_logprobs(2 * LOGITS, tokens, temperature=2.0), gather_logprobs(LOGITS, tokens))


def test_gather_logprobs_chunked_matches_whole():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 5, 9, generator=gen) * 3
    tokens = torch.randint(0, 9, (2, 5), generator=gen)
    whole = gather_logprobs(logits, tokens)
    assert_close(gather_logprobs(logits, tokens, chunk_size=2), whole)
    assert_close(whole, torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1))


def test_gather_logprobs_upcasts_bf16():
    out = gather_logprobs(LOGITS.bfloat16(), torch.tensor([[1, 0, 2]]))
    assert out.dtype == torch.float32


def test_token_cross_entropy_with_ignore_index_and_loss_mask():
    labels = torch.tensor([[1, -100, 2]])
    nll = token_cross_entropy(LOGITS, labels)
    assert_close(nll, torch.tensor([[-math.log(0.6), 0.0, math.log(3.0)]]))
    masked = token_cross_entropy(LOGITS, labels, loss_mask=torch.tensor([[0, 1, 1]]))
    assert_close(masked, torch.tensor([[0.0, 0.0, math.log(3.0)]]))
    mask = loss_mask_from_labels(labels)
    assert mask.tolist() == [[True, False, True]]
    assert_close(aggregate_loss(nll, mask), torch.tensor((-math.log(0.6) + math.log(3.0)) / 2))


def test_token_cross_entropy_gradient_is_softmax_minus_onehot():
    logits = LOGITS.clone().requires_grad_()
    nll = token_cross_entropy(logits, torch.tensor([[1, -100, -100]]))
    (grad,) = torch.autograd.grad(nll.sum(), logits)
    assert_close(grad[0, 0], torch.tensor([0.2, 0.6 - 1.0, 0.2]))
    assert grad[0, 1:].abs().sum().item() == 0.0
