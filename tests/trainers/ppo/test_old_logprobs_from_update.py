"""On-policy updates take the old log-probs from their own forward (``old_logprobs_from_update``).

When a rollout is one optimizer step of one epoch and no reference model needs the old log-probs first,
the trainer skips the scoring pass: the loss, its gradient and the logged mismatch must be what the pass
would have given, and the pass must still run whenever a later optimizer step or a KL needs it.
"""

from __future__ import annotations

import pytest
import torch

from tests.spies import count_calls
from tidal.config.model import ModelConfig
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.world import World
from tidal.experience.experience import Experience
from tidal.experience.maker import forward_logprobs
from tidal.models import load_causal_lm
from tidal.models.precision import Precision
from tidal.trainers.ppo.update import MISMATCH, Normaliser, PolicyLoss, old_logprobs_from_update

CPU = torch.device("cpu")


def test_the_rule():
    assert old_logprobs_from_update(epochs=1, rollout_size=128, step_size=128, has_reference=False)
    assert old_logprobs_from_update(epochs=1, rollout_size=64, step_size=128, has_reference=False)
    assert not old_logprobs_from_update(epochs=1, rollout_size=128, step_size=64, has_reference=False)
    assert not old_logprobs_from_update(epochs=2, rollout_size=128, step_size=128, has_reference=False)
    assert not old_logprobs_from_update(epochs=1, rollout_size=128, step_size=128, has_reference=True)


def on_policy_experience(n: int = 5, width: int = 12) -> Experience:
    """Rows of 12 tokens (two shorter), 4 prompt tokens each, random rollout log-probs, no old ones."""
    g = torch.Generator().manual_seed(1)
    attn = torch.ones(n, width, dtype=torch.long)
    attn[1, 8:] = 0
    attn[3, 6:] = 0
    action = attn.clone()
    action[:, :4] = 0
    seq = torch.randint(5, 500, (n, width), generator=g) * attn
    rollout = -torch.rand(n, width, generator=g) * action
    return Experience(seq, attn, action, rollout, rewards=torch.zeros(n), scores=torch.zeros(n),
                      advantages=torch.randn(n, width, generator=g) * action)  # fmt: skip


@pytest.mark.parametrize("packing", [False, True])
def test_loss_gradient_and_mismatch_equal_those_of_a_scoring_pass(tiny_llama, packing):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    precision = Precision.create("fp32", CPU)
    # TIS correction on: its weights read the old log-probs too
    cfg = AlgorithmConfig(enable_vllm_is_correction=True)
    loss_fn = PolicyLoss(cfg, precision, 1.0, packing)

    def loss_and_grad(exp):
        model.zero_grad()
        loss, metrics = loss_fn(model, exp, Normaliser.of(exp, World()))
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), metrics

    exp = on_policy_experience()
    skipped_loss, skipped_grad, skipped_metrics = loss_and_grad(exp)
    exp.old_logprobs = forward_logprobs(model, exp, 8, packing, 1.0, precision)
    loss, grad, metrics = loss_and_grad(exp)
    torch.testing.assert_close(skipped_loss, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(skipped_grad, grad, rtol=1e-5, atol=1e-7)
    assert float(skipped_metrics["policy/clip_ratio"]) == 0.0
    mask = exp.action_mask.bool()
    mismatch = (exp.old_logprobs - exp.rollout_logprobs).abs()[mask].mean()
    torch.testing.assert_close(skipped_metrics[MISMATCH], mismatch, rtol=1e-5, atol=1e-7)
    assert MISMATCH not in metrics  # with the scoring pass the trainer logs it from the experience


def _run(policy, tmp_path, monkeypatch, *extra):
    from tests.trainers.test_ppo import rl_flags, write_echo_data
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo
    from tidal.trainers.ppo import trainer as trainer_module

    calls = count_calls(monkeypatch, trainer_module, "forward_logprobs")
    data = write_echo_data(tmp_path / "data")
    flags = rl_flags(policy, data, tmp_path, "--advantage_estimator", "group_norm",
                     "--max_samples", "32", *extra)  # fmt: skip
    return run_ppo(parse_run(flags)), calls


def test_an_on_policy_grpo_run_skips_the_scoring_pass(tiny_qwen2, tmp_path, monkeypatch):
    # 16 prompts x 8 samples = the train batch of 128: one optimizer step per rollout
    history, calls = _run(tiny_qwen2, tmp_path, monkeypatch)
    assert len(history) == 2 and not calls
    assert all(0.0 <= h[MISMATCH] < 1.0 for h in history)
    assert all(h["policy/clip_ratio"] == 0.0 for h in history)


def test_the_scoring_pass_runs_when_a_later_step_needs_it(tiny_qwen2, tmp_path, monkeypatch):
    history, calls = _run(tiny_qwen2, tmp_path, monkeypatch, "--train_batch_size", "64")
    assert len(history) == 2 and len(calls) == 2  # one scoring pass per rollout
    assert all(MISMATCH in h for h in history)
