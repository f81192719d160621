"""The PPO update's policy objective as OpenRLHF aggregates it (issue #38).

GSPO is a mean over sequences of token means by default (``--loss_agg_mode`` unset), and the KL-loss and
entropy terms are token means whatever the policy loss's mode. The reference below is OpenRLHF's actor
loss written out on the update's own log-probs and entropies; the default PPO path must not move a bit.
"""

from __future__ import annotations

import torch
from torch.testing import assert_close

from tidal.algorithms import aggregate_loss, compute_kl, masked_mean, ppo_policy_loss
from tidal.config.model import ModelConfig
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.world import World
from tidal.experience.experience import Experience, model_batch
from tidal.models import load_causal_lm
from tidal.models.forward import token_logprobs
from tidal.models.precision import Precision
from tidal.trainers.ppo.update import Normaliser, PolicyLoss

CPU = torch.device("cpu")
KL_COEF, ENTROPY_COEF = 0.05, 0.01


def _experience(model, n: int = 5, width: int = 12) -> Experience:
    """Rows of unequal action lengths (2 to 8 tokens), one advantage per sequence, ratios ≠ 1."""
    g = torch.Generator().manual_seed(3)
    attn = (torch.arange(width) < torch.tensor([12, 6, 10, 8, 12])[:n, None]).long()
    action = attn.clone()
    action[:, :4] = 0
    seq = torch.randint(5, 500, (n, width), generator=g) * attn
    adv = torch.randn(n, 1, generator=g).expand(n, width) * action
    exp = Experience(seq, attn, action, torch.zeros(n, width), rewards=torch.zeros(n), scores=torch.zeros(n),
                     advantages=adv.contiguous())  # fmt: skip
    logp, _ = _forward(model, exp)
    exp.old_logprobs = (logp - 0.1 * torch.randn(n, width, generator=g)).detach() * action
    exp.ref_logprobs = (logp + 0.3 * torch.randn(n, width, generator=g)).detach() * action
    return exp


def _forward(model, exp: Experience):
    logp, out = token_logprobs(model, model_batch(exp, False), 1.0, with_entropy=True)
    return logp, out.entropy


def _setup(tiny_llama, **algorithm):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    cfg = AlgorithmConfig(use_kl_loss=True, kl_estimator="k3", entropy_loss_coef=ENTROPY_COEF, **algorithm)
    loss_fn = PolicyLoss(cfg, Precision.create("fp32", CPU), 1.0, False, kl_coef=KL_COEF)
    return model, loss_fn


def _kl_and_entropy_terms(logp, entropy, exp: Experience):
    """OpenRLHF: masked_mean(kl, action_mask) and masked_mean(entropy, action_mask), per token."""
    mask = exp.action_mask
    kl = compute_kl(logp, exp.ref_logprobs, mask, "k3")
    return KL_COEF * masked_mean(kl, mask) - ENTROPY_COEF * masked_mean(entropy, mask)


def test_gspo_with_kl_loss_and_entropy_equals_openrlhf(tiny_llama):
    model, loss_fn = _setup(tiny_llama, policy_loss_type="gspo")
    exp = _experience(model)
    loss, _ = loss_fn(model, exp, Normaliser.of(exp, World()))
    (grad,) = torch.autograd.grad(loss, model.lm_head.weight)

    logp, entropy = _forward(model, exp)
    mask = exp.action_mask.float()
    lengths = mask.sum(-1)
    s = torch.exp(((logp - exp.old_logprobs) * mask).sum(-1) / lengths).unsqueeze(-1)
    eps = 0.2  # --eps_clip
    per_token = -torch.min(s * exp.advantages, s.clamp(1 - eps, 1 + eps) * exp.advantages)
    actor = ((per_token * mask).sum(-1) / lengths).mean()  # GSPO: always the per-sequence mean
    reference = actor + _kl_and_entropy_terms(logp, entropy, exp)
    (ref_grad,) = torch.autograd.grad(reference, model.lm_head.weight)
    assert_close(loss, reference)
    assert_close(grad, ref_grad, atol=1e-7, rtol=1e-4)
    # the token mean (the former default) would train on another loss here
    token = aggregate_loss(per_token, mask, "token") + _kl_and_entropy_terms(logp, entropy, exp)
    assert abs(float((token - reference).detach())) > 1e-3


def test_explicit_sequence_mode_keeps_kl_and_entropy_token_means(tiny_llama):
    model, loss_fn = _setup(tiny_llama, loss_agg_mode="sequence")
    exp = _experience(model)
    loss, _ = loss_fn(model, exp, Normaliser.of(exp, World()))
    logp, entropy = _forward(model, exp)
    mask = exp.action_mask
    per_token, _ = ppo_policy_loss(logp, exp.old_logprobs, exp.advantages, mask)
    reference = aggregate_loss(per_token, mask, "sequence") + _kl_and_entropy_terms(logp, entropy, exp)
    assert_close(loss, reference)
    # per-sequence means of the terms (tidal before) differ by ~6.6e-4 on these rows
    kl = compute_kl(logp, exp.ref_logprobs, mask, "k3")
    per_sequence = aggregate_loss(KL_COEF * kl - ENTROPY_COEF * entropy, mask, "sequence")
    assert abs(float((per_sequence - _kl_and_entropy_terms(logp, entropy, exp)).detach())) > 1e-4


def test_default_ppo_loss_is_bit_identical_to_one_token_sum(tiny_llama):
    """The default path (ppo, token mean) sums KL and entropy into the per-token loss, as before."""
    model, loss_fn = _setup(tiny_llama)
    exp = _experience(model)
    norm = Normaliser.of(exp, World())
    loss, _ = loss_fn(model, exp, norm)
    logp, entropy = _forward(model, exp)
    mask = exp.action_mask
    per_token, _ = ppo_policy_loss(logp, exp.old_logprobs, exp.advantages, mask)
    per_token = per_token + KL_COEF * compute_kl(logp, exp.ref_logprobs, mask, "k3")
    per_token = per_token - ENTROPY_COEF * entropy
    assert torch.equal(loss, aggregate_loss(per_token, mask, "token", num_tokens=norm.tokens))
