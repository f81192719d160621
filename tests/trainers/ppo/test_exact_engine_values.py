"""``--exact_logprobs`` on an on-policy step: the policy loss takes the engine's log-probs as the exact values
(``PolicyLoss.engine_exact``), running the exact forward once a step, on the first micro-batch's first
``EXACT_CHECK_SAMPLES`` samples, to check.

The engine's log-probs are the trainer's exact forward's bit for bit, so taking them must change nothing:
the same loss and gradient bits per micro-batch, the same run history, with one exact forward a step
instead of one a micro-batch; and when the premise fails (the engine's values are not the trainer's) the
checked micro-batch says so in its metric and a warning.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.spies import count_calls
from tests.trainers.ppo.test_old_logprobs_from_update import on_policy_experience
from tidal.config.model import ModelConfig
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.world import World
from tidal.experience.experience import Experience
from tidal.experience.maker import forward_logprobs
from tidal.models import forward as forward_module
from tidal.models import load_causal_lm
from tidal.models.precision import Precision
from tidal.rollout.batch_invariant import make_exact
from tidal.trainers.ppo.update import MISMATCH, Normaliser, PolicyLoss

CPU = torch.device("cpu")


@pytest.fixture
def exact_forwards(monkeypatch):
    """Counts the exact forwards (``forward._exact_values``) run."""
    return count_calls(monkeypatch, forward_module, "_exact_values")


def _step(model, packing: bool) -> Experience:
    """An on-policy step (no old log-probs) whose rollout log-probs are the exact forward's."""
    exp = on_policy_experience(n=6)
    with torch.no_grad():
        exact = forward_logprobs(model, exp, 8, packing, 1.0, Precision.create("fp32", CPU))
    exp.rollout_logprobs = exact * exp.action_mask
    return exp


def _losses(model, loss_fn, step: Experience) -> list[tuple]:
    """Each micro-batch (3 rows) of ``step``: (loss, gradient, metrics), as the update loop runs them."""
    norm, out = Normaliser.of(step, World()), []
    for rows in ([0, 1, 2], [3, 4, 5]):
        model.zero_grad()
        loss, metrics = loss_fn(model, step.select(torch.tensor(rows)), norm)
        loss.backward()
        out.append((loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]), metrics))
    return out


@pytest.mark.parametrize("packing", [False, True])
def test_engine_values_give_the_exact_forwards_loss_and_gradient_bits(tiny_qwen2, packing, exact_forwards):
    model = make_exact(load_causal_lm(ModelConfig(pretrain=str(tiny_qwen2)), CPU))
    precision = Precision.create("fp32", CPU)
    cfg = AlgorithmConfig(enable_vllm_is_correction=True, entropy_loss_coef=0.01)
    step = _step(model, packing)
    exact_forwards.clear()
    checked = _losses(model, PolicyLoss(cfg, precision, 1.0, packing, engine_exact=True), step)
    assert len(exact_forwards) == 1  # the first micro-batch's check only
    exact_forwards.clear()
    plain = _losses(model, PolicyLoss(cfg, precision, 1.0, packing), step)
    assert len(exact_forwards) == 2
    for (loss_a, grad_a, _), (loss_b, grad_b, _) in zip(checked, plain, strict=True):
        assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
        assert grad_a.abs().sum() > 0
    # the check measured the gap (0.0) on its micro-batch; the other logs none (it would only assume it)
    assert float(checked[0][2][MISMATCH]) == 0.0 and MISMATCH not in checked[1][2]
    assert all(float(m["policy/approx_kl"]) == 0.0 for _, _, m in checked)


def test_the_check_runs_the_exact_forward_on_the_first_samples_only(tiny_qwen2, monkeypatch, exact_forwards):
    """``EXACT_CHECK_SAMPLES`` (2 here) of the step's first micro-batch (3 rows) go through the exact
    forward, and their mismatch is the step's metric."""
    from tidal.trainers.ppo import update

    monkeypatch.setattr(update, "EXACT_CHECK_SAMPLES", 2)
    model = make_exact(load_causal_lm(ModelConfig(pretrain=str(tiny_qwen2)), CPU))
    step = _step(model, packing=False)
    step.rollout_logprobs[2] += 0.5 * step.action_mask[2]  # off in the third row only: beyond the check
    exact_forwards.clear()
    loss_fn = PolicyLoss(AlgorithmConfig(), Precision.create("fp32", CPU), 1.0, False, engine_exact=True)
    first, _ = _losses(model, loss_fn, step)
    (batch,) = [call[1] for call in exact_forwards]
    assert batch["input_ids"].shape[0] == 2 and float(first[2][MISMATCH]) == 0.0


def test_a_broken_premise_shows_in_the_checked_micro_batch_and_warns(tiny_qwen2, caplog):
    model = make_exact(load_causal_lm(ModelConfig(pretrain=str(tiny_qwen2)), CPU))
    precision = Precision.create("fp32", CPU)
    step = _step(model, packing=True)
    step.rollout_logprobs = step.rollout_logprobs - 1e-3 * step.action_mask  # not the trainer's values
    loss_fn = PolicyLoss(AlgorithmConfig(), precision, 1.0, True, engine_exact=True)
    with caplog.at_level(logging.WARNING, logger="tidal.trainers.ppo.update"):
        first, second = _losses(model, loss_fn, step)
        _losses(model, loss_fn, step)  # another step (a new Normaliser): checked again, not warned again
    assert float(first[2][MISMATCH]) == pytest.approx(1e-3, rel=1e-3) and MISMATCH not in second[2]
    warnings = [r for r in caplog.records if "--exact_logprobs" in r.getMessage()]
    assert len(warnings) == 1 and "differ from the engine's" in warnings[0].getMessage()


def test_an_exact_grpo_run_checks_one_micro_batch_a_step_and_keeps_its_history(
    tiny_qwen2, tmp_path, monkeypatch, exact_forwards
):
    from tests.trainers.test_ppo import rl_flags, write_echo_data
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    data = write_echo_data(tmp_path / "data")

    def run(name: str):
        flags = rl_flags(tiny_qwen2, data, tmp_path / name, "--advantage_estimator", "group_norm",
                         "--max_samples", "32", "--micro_train_batch_size", "32", "--exact_logprobs",
                         "--packing_samples")  # fmt: skip
        exact_forwards.clear()
        history = run_ppo(parse_run(flags))
        return [{k: v for k, v in h.items() if not k.startswith("time")} for h in history], len(
            exact_forwards
        )

    history, forwards = run("engine_values")
    monkeypatch.setattr(PolicyLoss, "_takes_engine_values", lambda self, mb, norm: False)
    plain, plain_forwards = run("plain")
    # 2 steps of 128 samples in 4 micro-batches: one checking exact forward a step instead of four
    assert len(history) == 2 and forwards == 2 and plain_forwards == 8
    keys = ("policy/loss", "grad_norm", "reward", MISMATCH, "policy/approx_kl", "response_length")
    assert [[h[k] for k in keys] for h in history] == [[h[k] for k in keys] for h in plain]
    assert all(h[MISMATCH] == 0.0 for h in history)
