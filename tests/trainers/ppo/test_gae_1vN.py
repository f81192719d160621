"""A GAE run whose reward is always 0 takes the same steps with 1 and 2 processes.

Found: such a run with 2 processes stopped with "3 optimizer steps in a row had a zero gradient" where
one process went on. The guard was not the 1-vs-N part (its loss and gradient norm are global): the
critic's clipped value loss is flat once every value of a minibatch has left ``--value_clip`` around
its rollout value, so its gradient is exactly 0 at a non-zero loss, which the guard took for an
overflow. Two processes met that first only because, with several minibatches per rollout, each rank
shuffles its own share (docs/distributed.md). Now PPO's losses tell the guard when they are flat in
every model output they read (``tidal.trainers.ppo.update.OutputGradients``) and such steps are applied.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tidal.algorithms import aggregate_loss
from tidal.cli.train_ppo import parse_run
from tidal.distributed import World
from tidal.experience.experience import Experience
from tidal.experience.maker import shift_values
from tidal.models.precision import Precision
from tidal.testing.tolerance import assert_same_steps, tiny_parameter_count
from tidal.trainers.optim import NonFiniteGuard, bad_step
from tidal.trainers.optimization import Optimization
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.update import StepShape, ValueLoss, train_on_experience

RUNNER = Path(__file__).resolve().parents[2] / "distributed" / "dist_runner.py"
CPU = torch.device("cpu")

ZERO_REWARD = '''
import torch


def reward_func(queries, prompts, labels, **kwargs):
    """Every response scores 0: the returns are 0 and only the critic's values shape the advantages."""
    return {"rewards": torch.zeros(len(queries))}
'''


def test_a_flat_loss_expects_a_zero_gradient():
    assert bad_step(0.15, 0.0, scaled=False) is not None  # zero gradient at a real loss: overflow
    assert bad_step(0.15, 0.0, scaled=False, flat=True) is None  # every token clipped: nothing to follow
    assert bad_step(float("nan"), 0.0, scaled=False, flat=True) is not None  # non-finite all the same
    guard = NonFiniteGuard(limit=3)
    guard.observe_loss(0.15, flat=True)
    assert guard.allow(guard.take_loss(), 0.0)
    guard.observe_loss(0.15)  # the flag is for one step only
    assert not guard.allow(guard.take_loss(), 0.0) and guard.skipped == 1


class TokenCritic(nn.Module):
    """A value per token id: ``values(batch)`` as ``tidal.models.value_model`` gives them."""

    def __init__(self, vocab: int = 8):
        super().__init__()
        self.value = nn.Embedding(vocab, 1)

    def values(self, batch: dict) -> torch.Tensor:
        return self.value(batch["input_ids"]).squeeze(-1)


def clipped_experience(critic: TokenCritic, n: int = 4, width: int = 5) -> Experience:
    """Rollout values 3 above the critic's and returns at them: with ``--value_clip 0.2`` every
    token's clipped error is the larger one and saturated, so the value loss is flat."""
    sequences = torch.arange(n * width).reshape(n, width) % 8
    attn = torch.ones(n, width, dtype=torch.long)
    action = attn.clone()
    action[:, :2] = 0
    with torch.no_grad():
        now = shift_values(critic.values({"input_ids": sequences}))
    zeros = torch.zeros(n, width)
    return Experience(sequences, attn, action, zeros, torch.zeros(n), torch.zeros(n), values=now + 3.0,
                      returns=now.clone())  # fmt: skip


def critic_optimization(critic: nn.Module) -> Optimization:
    optimizer = torch.optim.AdamW(critic.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Optimization(
        critic, optimizer, scheduler, Precision.create("fp32", CPU), 1.0, NonFiniteGuard(limit=2)
    )


def test_fully_clipped_critic_steps_are_applied_not_counted():
    torch.manual_seed(0)
    critic = TokenCritic()
    opt = critic_optimization(critic)
    exp = clipped_experience(critic)
    loss = ValueLoss(value_clip=0.2, precision=opt.precision, packing=False)
    before = critic.value.weight.detach().clone()
    stats = train_on_experience(opt, exp, loss, StepShape(step_size=2, micro_size=1, epochs=2), World(),
                                torch.Generator().manual_seed(0))  # fmt: skip
    assert stats["critic/value_clip_ratio"] == 1.0 and stats["critic/loss"] > 1.0
    assert stats["grad_norm"] == 0.0
    assert opt.guard.skipped == 0  # 4 flat steps, none taken for an overflow
    assert not torch.equal(before, critic.value.weight)  # applied: AdamW's decoupled weight decay moved it

    # the same zero gradient from a loss that does not say what it reads: the plain rule still counts it
    def opaque(model, mb, norm):
        values = model.values({"input_ids": mb.sequences}).detach()
        per_token = (values - mb.values).pow(2) + 0.0 * model.value.weight.sum()
        return aggregate_loss(per_token, mb.action_mask, "token", num_tokens=norm.tokens), {}

    opt = critic_optimization(critic)
    train_on_experience(opt, exp, opaque, StepShape(step_size=4, micro_size=2), World(),
                        torch.Generator().manual_seed(0))  # fmt: skip
    assert opt.guard.skipped == 1


def flags(policy, data: Path, out: Path) -> list[str]:
    """2 rollouts of 2 prompts x 2 samples (one prompt per process), each trained 5 epochs with the whole
    rollout per optimizer step (the same minibatches for 1 and 2 processes). A fast critic and a small
    value clip: after a rollout's first step every value is out of the clip range, so its later critic
    steps are flat."""
    return [
        "--pretrain", str(policy), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(data / "reward.py"), "--advantage_estimator", "gae",
        "--init_kl_coef", "0", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
        "--train_batch_size", "4", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2",
        "--max_epochs", "5", "--value_clip", "0.01", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "2e-3", "--critic_learning_rate", "5e-3", "--lr_warmup_ratio", "0",
        "--zero_stage", "3", "--seed", "5", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
    ]  # fmt: skip


KEYS = ("reward", "critic/loss", "critic/value_clip_ratio",
        "policy/loss", "grad_norm", "nonfinite_steps")  # fmt: skip


@pytest.mark.slow  # about 30 s on a loaded 2-core machine (a launch of 2 ranks)
def test_zero_reward_gae_one_and_two_processes_take_the_same_steps(tiny_qwen2, tmp_path, ranks):
    data = tmp_path / "data"
    data.mkdir()
    with (data / "prompts.jsonl").open("w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n")
    (data / "reward.py").write_text(ZERO_REWARD)
    one = run_ppo(parse_run(flags(tiny_qwen2, data, tmp_path / "one")))
    spec = [
        {"kind": "ppo", "out": str(tmp_path / "two.json"), "argv": flags(tiny_qwen2, data, tmp_path / "two")}
    ]
    (tmp_path / "runs.json").write_text(json.dumps(spec))
    ranks.launch(RUNNER, tmp_path / "runs.json", timeout=300)  # 2 processes (tests/trainers/conftest.py)
    two = json.loads((tmp_path / "two.json").read_text())["history"]
    assert [h["step"] for h in one] == [h["step"] for h in two] == [1, 2]
    assert all(h["reward"] == 0.0 for h in one) and one[-1]["critic/value_clip_ratio"] > 0.5
    assert one[-1]["nonfinite_steps"] == 0.0  # the flat critic steps were applied, none counted
    # The two processes add each rank's share: the same sums in another order (tidal.testing.tolerance).
    assert_same_steps(one, two, KEYS, tiny_parameter_count("qwen2"))
