"""``--optim muon``: torch.optim.Muon for the hidden matrices, AdamW for the rest (``tidal.trainers.optim``),
and the optimizer flags (shared, OpenRLHF HEAD's dotted and per-role ones) reaching the optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tidal.cli import train_ppo, train_sft
from tidal.config.training import OptimConfig
from tidal.testing.tiny import tiny_config
from tidal.trainers.optim import MuonWithAdamW, build_optimizer, build_scheduler, muon_split


@pytest.fixture
def tiny_lm():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=64, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _names(model: nn.Module, params) -> set[str]:
    ids = {id(p) for p in params}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_muon_takes_the_hidden_linear_weights_and_adamw_the_rest(tiny_lm):
    hidden, rest = muon_split(tiny_lm)
    names = dict(tiny_lm.named_parameters())
    expected_hidden = {n for n, p in names.items() if ".layers." in n and "proj.weight" in n}
    assert _names(tiny_lm, hidden) == expected_hidden and expected_hidden
    assert _names(tiny_lm, rest) == set(names) - expected_hidden
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= _names(tiny_lm, rest)


def test_a_value_head_goes_to_adamw():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8))
    model.score = nn.Linear(8, 1)
    model.value_head_prefix = "score"
    hidden, rest = muon_split(model)
    assert _names(model, hidden) == {"0.weight", "1.weight"}
    assert _names(model, rest) == {"0.bias", "1.bias", "score.weight", "score.bias"}


def _grads(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


def test_a_muon_step_equals_hand_rolled_muon_and_adamw(tiny_lm):
    cfg = OptimConfig(optim="muon", learning_rate=1e-3, muon_lr=0.05, muon_momentum=0.9, muon_ns_steps=3,
                      muon_nesterov=False, adam_betas=(0.8, 0.9), adam_eps=1e-6, l2=0.01)  # fmt: skip
    reference = copy.deepcopy(tiny_lm)
    ours = build_optimizer(tiny_lm, cfg)
    assert isinstance(ours, MuonWithAdamW)
    by_name = dict(reference.named_parameters())
    hidden = [by_name[n] for n in _names(tiny_lm, muon_split(tiny_lm)[0])]
    rest = [p for p in reference.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.05, weight_decay=0.01, momentum=0.9, nesterov=False, ns_steps=3)
    adam = torch.optim.AdamW(rest, lr=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01)
    for seed in range(3):  # momentum and Adam moments carry over steps
        _grads(tiny_lm, seed)
        _grads(reference, seed)
        ours.step()
        muon.step()
        adam.step()
    for name, p in tiny_lm.named_parameters():
        torch.testing.assert_close(p, by_name[name], rtol=0, atol=0, msg=name)


def test_the_schedule_scales_each_groups_own_rate_and_state_round_trips(tiny_lm):
    cfg = OptimConfig(optim="muon", learning_rate=1e-3, muon_lr=0.02, lr_scheduler="constant_with_warmup",
                      lr_warmup_ratio=0.5)  # fmt: skip
    optimizer = build_optimizer(tiny_lm, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps=4)  # 2 warmup steps: rates at 0, 1/2, 1
    _grads(tiny_lm, 0)
    optimizer.step()
    scheduler.step()
    rates = {group["muon"]: group["lr"] for group in optimizer.param_groups}
    assert rates == {True: pytest.approx(0.01), False: pytest.approx(5e-4)}
    state = copy.deepcopy(optimizer.state_dict())
    again = build_optimizer(copy.deepcopy(tiny_lm), cfg)
    again.load_state_dict(state)
    assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in optimizer.param_groups]
    _grads(tiny_lm, 1)
    optimizer.step()  # the inner optimizers follow the loaded groups and state
    assert len(optimizer.state) == sum(1 for p in tiny_lm.parameters())


def test_sft_flags_reach_the_optimizer(tiny_lm):
    argv = ["--pretrain", "m", "--dataset", "d", "--optim", "muon", "--muon.lr", "0.01", "--muon.momentum", "0.8",
            "--muon.ns_steps", "4", "--muon.no_nesterov", "--adam.lr", "3e-4", "--adam.betas", "0.7", "0.8",
            "--adam.eps", "1e-7", "--adam.weight_decay", "0.05"]  # fmt: skip
    cfg = train_sft.parse_run(argv).optim
    optimizer = build_optimizer(tiny_lm, cfg)
    muon = next(g for g in optimizer.param_groups if g["muon"])
    adam = next(g for g in optimizer.param_groups if not g["muon"])
    assert (muon["lr"], muon["momentum"], muon["ns_steps"], muon["nesterov"], muon["weight_decay"]) == (
        0.01, 0.8, 4, False, 0.05)  # fmt: skip
    assert (adam["lr"], adam["betas"], adam["eps"], adam["weight_decay"]) == (3e-4, (0.7, 0.8), 1e-7, 0.05)


def test_adam_is_the_default_with_the_adam_flags(tiny_lm):
    cfg = train_sft.parse_run(["--pretrain", "m", "--dataset", "d", "--adam_betas", "0.5", "0.6"]).optim
    optimizer = build_optimizer(tiny_lm, cfg)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["betas"] == (0.5, 0.6) and optimizer.param_groups[0]["eps"] == 1e-8


PPO = ["--pretrain", "m", "--prompt_data", "d", "--remote_rm_url", "r.py"]


def test_per_role_flags_set_one_role_and_shared_flags_both():
    """OpenRLHF HEAD's --actor.* / --critic.* optimizer flags beside v0.9.2's shared ones."""
    run = train_ppo.parse_run([*PPO, "--adam_betas", "0.5", "0.6", "--max_norm", "2", "--actor.optim", "muon",
                               "--actor.muon.lr", "0.03", "--actor.adam.lr", "2e-6", "--critic.adam.betas", "0.7",
                               "0.8", "--critic.adam.eps", "1e-5", "--critic.adam.weight_decay", "0.1",
                               "--critic.lr_scheduler", "constant", "--actor.max_norm", "0.5",
                               "--critic.muon.no_nesterov"])  # fmt: skip
    actor, critic = run.actor_optim, run.critic_optim
    assert (actor.optim, actor.muon_lr, actor.learning_rate) == ("muon", 0.03, 2e-6)
    assert actor.adam_betas == (0.5, 0.6)
    assert (actor.max_norm, critic.max_norm, actor.lr_scheduler) == (0.5, 2.0, "cosine_with_min_lr")
    assert (critic.optim, critic.adam_betas, critic.adam_eps, critic.l2) == ("adam", (0.7, 0.8), 1e-5, 0.1)
    assert (critic.lr_scheduler, critic.learning_rate, critic.muon_nesterov, actor.muon_nesterov) == (
        "constant", 9e-6, False, True)  # fmt: skip


def test_a_bad_per_role_value_names_the_flag(capsys):
    with pytest.raises(Exception, match="--actor_adam_eps must be > 0"):
        train_ppo.parse_run([*PPO, "--actor.adam.eps", "0"])


def test_sft_trains_with_muon_and_resumes(tiny_llama, tmp_path, crash_after):
    """``tidal sft --optim muon`` end to end on the CPU (FSDP2 on one process): the loss falls, and a run
    stopped after step 5 and resumed from its step-4 checkpoint (the Muon momentum and AdamW moments in
    it) continues with the uninterrupted run's losses."""
    from tidal.testing import AdditionTask
    from tidal.trainers import loop as loop_module
    from tidal.trainers.sft import run_sft

    data = AdditionTask(digits=1).write_jsonl(tmp_path / "train.jsonl", 64)

    def flags(out, *extra):
        return ["--pretrain", str(tiny_llama), "--dataset", str(data), "--input_key", "prompt", "--output_key",
                "answer", "--max_len", "32", "--train_batch_size", "16", "--micro_train_batch_size", "16",
                "--optim", "muon", "--muon.lr", "0.02", "--learning_rate", "3e-3", "--lr_warmup_ratio", "0",
                "--max_epochs", "2", "--seed", "7", "--save_path", str(out / "final"), "--ckpt_path",
                str(out / "ckpt"), "--save_steps", "4", "--logging_steps", "1", *extra]  # fmt: skip

    full = run_sft(train_sft.parse_run(flags(tmp_path / "full")))
    assert len(full) == 8 and full[-1]["loss"] < 0.7 * full[0]["loss"]
    restore = crash_after(loop_module.SupervisedTrainer, "train_step", 5)
    with pytest.raises(KeyboardInterrupt):
        run_sft(train_sft.parse_run(flags(tmp_path / "cut")))
    restore()
    resumed = run_sft(train_sft.parse_run(flags(tmp_path / "cut", "--load_checkpoint")))
    assert [h["step"] for h in resumed] == list(range(5, 9))
    for a, b in zip(full[4:], resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), a["step"]


def test_muon_refuses_matrices_sharded_over_ranks():
    """FSDP2 shards a weight over its mesh; Muon orthogonalises whole matrices, so a mesh of 2 is refused."""
    from types import SimpleNamespace

    from tidal.config.args import ConfigError

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.device_mesh = SimpleNamespace(size=lambda: 2)  # what a DTensor sharded on 2 ranks reports
    with pytest.raises(ConfigError, match="tidal runs Muon on one rank"):
        build_optimizer(model, OptimConfig(optim="muon"))
