"""``--policy_loss_type cispo|sapo`` in the PPO update: the update's loss is the paper's objective under
each loss's own aggregation, a few steps move the policy the way the advantages say, and a one-step
``tidal ppo`` GRPO run with each flag trains (its weights move, its loss statistics are logged)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from tidal.cli.train_ppo import main as ppo_main
from tidal.cli.train_ppo import parse_run
from tidal.config.model import ModelConfig
from tidal.config.rl import AlgorithmConfig
from tidal.distributed.world import World
from tidal.experience.experience import Experience, model_batch
from tidal.models import load_causal_lm
from tidal.models.forward import token_logprobs
from tidal.models.precision import Precision
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.update import Normaliser, PolicyLoss

CPU = torch.device("cpu")


def _forward(model, exp: Experience) -> torch.Tensor:
    logp, _ = token_logprobs(model, model_batch(exp, False), 1.0)
    return logp


def _experience(model) -> Experience:
    """Four rows of unequal action lengths (2 to 8 tokens), advantages ±1 per sequence, ratios ≠ 1."""
    g = torch.Generator().manual_seed(5)
    width = 12
    attn = (torch.arange(width) < torch.tensor([12, 6, 10, 8])[:, None]).long()
    action = attn.clone()
    action[:, :4] = 0
    seq = torch.randint(5, 500, (4, width), generator=g) * attn
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]]).expand(4, width) * action
    exp = Experience(seq, attn, action, torch.zeros(4, width), rewards=torch.zeros(4), scores=torch.zeros(4),
                     advantages=adv.contiguous())  # fmt: skip
    exp.old_logprobs = (_forward(model, exp) - 0.4 * torch.randn(4, width, generator=g)).detach() * action
    return exp


def _reference(loss_type: str, logp, exp: Experience, cfg: AlgorithmConfig) -> torch.Tensor:
    """The papers' objectives written out: CISPO a token mean, SAPO a mean of sequence means."""
    mask = exp.action_mask.float()
    ratio = torch.exp(logp - exp.old_logprobs)
    adv = exp.advantages
    if loss_type == "cispo":
        low, high = cfg.clip_bounds
        weight = ratio.clamp(1 - low, 1 + high).detach()
        return (-weight * adv * logp * mask).sum() / mask.sum()
    tau = torch.where(adv > 0, 1.0, 1.05)
    per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    return ((per_token * mask).sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_update_loss_is_the_papers_objective_and_follows_the_advantages(tiny_llama, loss_type):
    model = load_causal_lm(ModelConfig(pretrain=str(tiny_llama)), CPU)
    clip = {"eps_clip_low_high": (1.0, 0.28)} if loss_type == "cispo" else {}
    cfg = AlgorithmConfig(policy_loss_type=loss_type, **clip)
    loss_fn = PolicyLoss(cfg, Precision.create("fp32", CPU), 1.0, False)
    exp = _experience(model)
    norm = Normaliser.of(exp, World())
    loss, metrics = loss_fn(model, exp, norm)
    (grad,) = torch.autograd.grad(loss, model.lm_head.weight)
    logp = _forward(model, exp)
    reference = _reference(loss_type, logp, exp, cfg)
    (ref_grad,) = torch.autograd.grad(reference, model.lm_head.weight)
    assert_close(loss, reference)
    assert_close(grad, ref_grad, atol=1e-7, rtol=1e-4)
    assert ("policy/clip_ratio" if loss_type == "cispo" else "policy/gate_weight") in metrics

    mask = exp.action_mask.bool()
    before = _forward(model, exp).detach()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        loss_fn(model, exp, norm)[0].backward()
        opt.step()
    moved = ((_forward(model, exp).detach() - before) * mask).sum(-1) / mask.sum(-1)
    assert (moved[[0, 2]] > 0).all() and (moved[[1, 3]] < 0).all(), moved  # A > 0 up, A < 0 down


REWARD = """import torch

def reward_func(queries, prompts, labels, **kwargs):
    # a deterministic reward that differs between a prompt's samples: the parity of the text's bytes
    values = [float(sum(q.encode()) % 2) for q in queries]
    return {"rewards": torch.tensor(values), "scores": torch.tensor(values)}
"""


def _grpo_flags(model, tmp_path, *extra) -> list[str]:
    (tmp_path / "reward.py").write_text(REWARD)
    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": f"{i} +"}) + "\n")
    return [
        "--pretrain", str(model), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
        "--remote_rm_url", str(tmp_path / "reward.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
        "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16", "--generate_max_len", "4",
        "--prompt_max_len", "8", "--actor_learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
        "--max_samples", "4", "--seed", "1", "--save_path", str(tmp_path / "final"), *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "stat"),
    [
        (["--policy_loss_type", "cispo", "--eps_clip_low_high", "1.0", "0.28"], "policy/clip_ratio"),
        (["--policy_loss_type", "sapo", "--tau_neg", "1.2"], "policy/gate_weight"),
    ],
)
def test_one_grpo_step_with_the_flag_trains(tiny_llama, tmp_path, extra, stat):
    history = run_ppo(parse_run(_grpo_flags(tiny_llama, tmp_path, *extra)))
    assert len(history) == 1
    assert stat in history[0] and torch.isfinite(torch.tensor(history[0]["policy/loss"]))
    assert history[0]["advantages/abs_mean"] > 0.1  # the group's rewards differ: a learning signal
    # --l2 is 0: only the policy gradient can move the weights
    before = load_file(str(tiny_llama / "model.safetensors"))
    after = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)


def test_the_command_refuses_dual_clip_with_cispo(tiny_llama, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        ppo_main(_grpo_flags(tiny_llama, tmp_path, "--policy_loss_type", "cispo", "--dual_clip", "3"))
    assert exc.value.code == 2
    assert "--dual_clip with --policy_loss_type cispo" in capsys.readouterr().err
