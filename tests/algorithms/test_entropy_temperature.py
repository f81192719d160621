"""The RL entropy bonus is the entropy of the sampling distribution softmax(logits / T), not of the raw
logits (OpenRLHF's choice): the same distribution the policy loss's log-probs and ratios use."""

from __future__ import annotations

import pytest
import torch

from tidal.algorithms import entropy_from_logits, masked_mean
from tidal.config import ModelConfig
from tidal.config.rl import AlgorithmConfig
from tidal.distributed import World
from tidal.experience.experience import Experience
from tidal.models import Precision, load_causal_lm
from tidal.trainers.ppo.update import Normaliser, PolicyLoss

TEMPERATURE = 0.5


def _experience(n: int = 4, width: int = 10) -> Experience:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([10, 8, 7, 9])[:n]
    attn = (torch.arange(width)[None] < lengths[:, None]).long()
    action = attn.clone()
    action[:, :3] = 0  # three prompt tokens
    seq = torch.randint(5, 500, (n, width), generator=g) * attn
    zeros = torch.zeros(n, width)
    return Experience(seq, attn, action, zeros, rewards=torch.zeros(n), scores=torch.zeros(n),
                      old_logprobs=zeros.clone(), advantages=zeros.clone())  # fmt: skip


@pytest.mark.parametrize("packing", [False, True])
def test_entropy_bonus_is_of_the_tempered_distribution(tiny_llama, packing):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), torch.device("cpu"))
    precision = Precision.create("fp32", torch.device("cpu"))
    exp = _experience()
    loss_fn = PolicyLoss(AlgorithmConfig(entropy_loss_coef=0.01), precision, TEMPERATURE, packing)
    _, metrics = loss_fn(model, exp, Normaliser.of(exp, World()))

    with torch.no_grad():
        logits = model(input_ids=exp.sequences, attention_mask=exp.attention_mask).logits[:, :-1]
    mask = exp.action_mask[:, 1:]  # logits at t − 1 score token t
    tempered = masked_mean(entropy_from_logits(logits, TEMPERATURE), mask)
    raw = masked_mean(entropy_from_logits(logits), mask)
    assert abs(float(tempered) - float(raw)) > 1e-2  # the two choices are distinguishable here
    torch.testing.assert_close(
        torch.as_tensor(float(metrics["policy/entropy"])), tempered, rtol=1e-4, atol=1e-5
    )
