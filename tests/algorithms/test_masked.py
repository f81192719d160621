"""Masked reductions and loss aggregation (token vs sequence level, gradient accumulation)."""

import math

import pytest
import torch
from torch.testing import assert_close

from tidal.algorithms.masked import (
    aggregate_loss,
    aggregate_policy_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from tidal.distributed.collectives import world_masked_whiten
from tidal.distributed.world import World

X = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def test_masked_sum_and_mean_ignore_garbage_under_the_mask():
    assert masked_sum(X, MASK).item() == 7.0
    assert_close(masked_mean(X, MASK), torch.tensor(7.0 / 3.0))
    assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 4.0]))
    assert_close(masked_sum(X, MASK.long(), dim=0), torch.tensor([5.0, 2.0, 0.0]))


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    """A documented difference (docs/algorithms.md): OpenRLHF's sum(x·m)/sum(m) is 0/0 = nan there."""
    assert masked_mean(X, torch.zeros_like(MASK)).item() == 0.0
    rows = torch.tensor([[0, 0, 0], [1, 0, 0]])
    assert_close(masked_mean(X, rows, dim=-1), torch.tensor([0.0, 4.0]))
    finite = torch.nan_to_num(X, nan=0.0, posinf=0.0)
    reference = (finite * rows).sum(-1) / rows.sum(-1)  # OpenRLHF's masked_mean (on finite values)
    assert reference[0].isnan() and reference[1].item() == 4.0


def test_masked_var_population_and_unbiased():
    # values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3
    assert_close(masked_var(X, MASK), torch.tensor(14.0 / 9.0))
    assert_close(masked_var(X, MASK, unbiased=True), torch.tensor(14.0 / 6.0))


def test_masked_whiten_hand_values_and_moments():
    white = masked_whiten(X, MASK)
    s = math.sqrt(14.0)
    assert_close(white, torch.tensor([[-4 / s, -1 / s, 0.0], [5 / s, 0.0, 0.0]]), atol=1e-5, rtol=1e-5)
    assert abs(masked_mean(white, MASK).item()) < 1e-6
    assert_close(masked_var(white, MASK), torch.tensor(1.0), atol=1e-5, rtol=1e-5)
    unshifted = masked_whiten(X, MASK, shift_mean=False)
    assert_close(unshifted[0, 0], torch.tensor(-4 / s + 7 / 3), atol=1e-5, rtol=1e-5)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])


def test_token_sequence_and_sequence_sum_on_unequal_lengths():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert_close(aggregate_loss(LOSS, mask, "token"), torch.tensor(10.0 / 4.0))  # (1+2+3+4)/4
    assert_close(aggregate_loss(LOSS, mask, "sequence"), torch.tensor(3.0))  # (2 + 4)/2
    assert_close(aggregate_loss(LOSS, mask, "sequence_sum"), torch.tensor(5.0))  # (6 + 4)/2


def test_token_and_sequence_agree_on_equal_lengths():
    mask = torch.ones(2, 3)
    assert_close(aggregate_loss(LOSS, mask, "token"), torch.tensor(3.5))
    assert_close(aggregate_loss(LOSS, mask, "sequence"), torch.tensor(3.5))


def test_sequence_default_normaliser_skips_empty_rows_and_explicit_normalisers_apply():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert_close(aggregate_loss(LOSS, mask, "sequence"), torch.tensor(1.5))
    assert_close(aggregate_loss(LOSS, mask, "sequence", num_sequences=3), torch.tensor(0.5))
    assert_close(aggregate_loss(LOSS, mask, "token", num_tokens=6), torch.tensor(0.5))
    assert aggregate_loss(LOSS, torch.zeros(2, 3), "token").item() == 0.0


def test_unknown_mode_fails_clearly():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate_loss(LOSS, torch.ones(2, 3), "tokens")


@pytest.mark.parametrize("mode", ["token", "sequence", "sequence_sum"])
def test_micro_batches_with_global_normaliser_equal_one_big_batch(mode):
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(6, 5, generator=gen, requires_grad=True)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5])
    mask = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    data = torch.randn(6, 5, generator=gen)

    big = aggregate_loss((weights * data) ** 2, mask, mode)
    (big_grad,) = torch.autograd.grad(big, weights)

    num_tokens, num_sequences = int(mask.sum()), mask.shape[0]
    total = 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        per_token = (weights[rows] * data[rows]) ** 2
        total = total + aggregate_loss(per_token, mask[rows], mode, num_tokens, num_sequences)
    (micro_grad,) = torch.autograd.grad(total, weights)
    assert_close(total, big)
    assert_close(micro_grad, big_grad)

    # and the local normaliser would NOT give the big-batch loss (the test above is meaningful)
    local = sum(
        aggregate_loss((weights[r] * data[r]) ** 2, mask[r], mode) for r in (slice(0, 2), slice(2, 6))
    )
    assert not torch.allclose(local, big)


# ---- the KL-loss and entropy terms are token means in every mode (issue #38) ---------------------


def test_policy_loss_terms_are_token_means_whatever_the_mode_by_hand():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.6, 9.0, 9.0]])  # 9.0: masked garbage
    entropy = torch.tensor([[1.0, 1.0, 1.0], [5.0, 9.0, 9.0]])
    terms = [0.5 * kl, -0.1 * entropy]
    # policy: sequence means (2 + 4)/2 = 3; KL token mean 1.2/4 = 0.3; entropy token mean 8/4 = 2
    sequence = aggregate_policy_loss(LOSS, terms, mask, "sequence")
    assert_close(sequence, torch.tensor(3.0 + 0.5 * 0.3 - 0.1 * 2.0))
    # OpenRLHF's reference: actor loss per its mode, masked_mean(kl) and masked_mean(entropy) per token
    assert_close(sequence, aggregate_loss(LOSS, mask, "sequence") + 0.5 * masked_mean(kl, mask)
                 - 0.1 * masked_mean(entropy, mask))  # fmt: skip
    # per-sequence means of the terms (tidal before) would give 3 + 0.5·0.4 − 0.1·3: a different loss
    assert abs(sequence.item() - (3.0 + 0.5 * 0.4 - 0.1 * 3.0)) > 0.04
    summed = aggregate_policy_loss(LOSS, terms, mask, "sequence_sum")  # (6 + 4)/2 + the token means
    assert_close(summed, torch.tensor(5.0 + 0.5 * 0.3 - 0.1 * 2.0))
    normalised = aggregate_policy_loss(LOSS, terms, mask, "sequence", num_tokens=8, num_sequences=4)
    assert_close(normalised, torch.tensor(6.0 / 4 + 0.5 * 1.2 / 8 - 0.1 * 8.0 / 8))


def test_token_mode_with_terms_is_bit_identical_to_summing_them_into_the_loss():
    gen = torch.Generator().manual_seed(1)
    loss, kl, entropy = (torch.randn(5, 7, generator=gen) for _ in range(3))
    mask = torch.rand(5, 7, generator=gen) > 0.3
    combined = aggregate_loss(loss + 0.05 * kl - 0.01 * entropy, mask, "token", num_tokens=40)
    ours = aggregate_policy_loss(loss, [0.05 * kl, -0.01 * entropy], mask, "token", num_tokens=40)
    assert torch.equal(ours, combined)
    assert torch.equal(
        aggregate_policy_loss(loss, [], mask, "sequence"), aggregate_loss(loss, mask, "sequence")
    )


# ---- whitening floors the variance at eps, as OpenRLHF (issue #38) -------------------------------


def test_whitening_floors_the_variance_by_hand():
    # std 1e-3 (var 1e-6 > eps): exactly ±1, where sqrt(var + 1e-8) gave ±0.995
    assert_close(masked_whiten(torch.tensor([[0.0, 2e-3]]), torch.ones(1, 2)), torch.tensor([[-1.0, 1.0]]))
    # std 1e-5 (var 1e-10 < eps): divided by sqrt(1e-8) = 1e-4, so ±1e-5 / 1e-4 = ±0.1
    tiny = masked_whiten(torch.tensor([[0.0, 2e-5, 7.0]]), torch.tensor([[1, 1, 0]]))
    assert_close(tiny, torch.tensor([[-0.1, 0.1, 0.0]]))


def test_whitening_equals_openrlhf_at_small_std():
    gen = torch.Generator().manual_seed(2)
    x = 5.0 + 1e-3 * torch.randn(4, 6, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.25
    # OpenRLHF's normalisation: population mean/var over the action tokens, var.clamp(min=1e-8).rsqrt()
    m = mask.float()
    mean = (x * m).sum() / m.sum()
    var = ((x - mean).pow(2) * m).sum() / m.sum()
    reference = (x - mean) * var.clamp(min=1e-8).rsqrt()
    ours = masked_whiten(x, mask)
    assert_close(ours, torch.where(mask, reference, 0.0), atol=1e-4, rtol=1e-4)
    assert_close(world_masked_whiten(x, mask, World()), ours, atol=1e-4, rtol=1e-4)  # one process
    shifted = torch.where(mask, (x - mean) * (var + 1e-8).rsqrt(), 0.0)  # the former eps inside the root
    assert (ours - shifted).abs().max() > 1e-3
