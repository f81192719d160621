"""Runs own their defaults (a run built in Python is the run its command parses), configs are grouped
by consumer with OpenRLHF's flag names, and one check pass reports every problem at once."""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import pytest

from tidal.algorithms import ADVANTAGE_ESTIMATORS
from tidal.cli import train_dpo, train_kd, train_kto, train_ppo, train_prm, train_rm, train_sft
from tidal.config import ConfigError, ModelConfig, PromptDataConfig
from tidal.config.args import deferred_checks
from tidal.config.rl import AlgorithmConfig, RewardConfig, RolloutConfig
from tidal.config.training import OptimConfig
from tidal.trainers.dpo import DPORun
from tidal.trainers.kd import KDConfig, KDRun
from tidal.trainers.kto import KTORun
from tidal.trainers.ppo import PPORun
from tidal.trainers.prm import PRMRun
from tidal.trainers.rm import RMRun
from tidal.trainers.sft import SFTRun

SUPERVISED = ["--pretrain", "m", "--dataset", "d.jsonl"]
PPO = ["--pretrain", "m", "--prompt_data", "p.jsonl"]


def _supervised(cls, **extra):
    """The run with its required values; ``datasets`` is of the run's own class (DPO, KTO, KD and PRM read
    the eval split ``test`` by default, as OpenRLHF: ``HeldOutDatasetConfig``)."""
    datasets = typing.get_type_hints(cls)["datasets"](dataset="d.jsonl")
    return cls(model=ModelConfig(pretrain="m"), datasets=datasets, **extra)


@pytest.mark.parametrize(
    ("command", "argv", "built"),
    [
        (train_sft, SUPERVISED, lambda: _supervised(SFTRun)),
        (train_dpo, SUPERVISED, lambda: _supervised(DPORun)),
        (train_kto, SUPERVISED, lambda: _supervised(KTORun)),
        (train_rm, SUPERVISED, lambda: _supervised(RMRun)),
        (train_prm, SUPERVISED, lambda: _supervised(PRMRun)),
        (
            train_kd,
            [*SUPERVISED, "--teacher_model", "t"],
            lambda: _supervised(KDRun, kd=KDConfig(teacher_model="t")),
        ),
        (
            train_ppo,
            PPO,
            lambda: PPORun(actor=ModelConfig(pretrain="m"), data=PromptDataConfig(prompt_data="p.jsonl")),
        ),
    ],
    ids=["sft", "dpo", "kto", "rm", "prm", "kd", "ppo"],
)
def test_the_command_parses_the_run_python_builds_from_the_same_required_values(command, argv, built):
    assert command.parse_run(argv) == built()


def test_per_trainer_defaults_live_in_the_runs():
    ppo = PPORun(actor=ModelConfig(pretrain="m"), data=PromptDataConfig(prompt_data="p"))
    assert (ppo.train.train_batch_size, ppo.train.micro_train_batch_size) == (128, 4)
    assert (ppo.actor_optim.learning_rate, ppo.critic_optim.learning_rate) == (1e-6, 9e-6)
    assert ppo.ckpt.ckpt_path == "./ckpt/checkpoints_ppo"
    assert _supervised(DPORun).ckpt.ckpt_path == "./ckpt/checkpoints_dpo"
    assert _supervised(SFTRun).train.micro_train_batch_size == 8


def test_shared_optimizer_flags_set_both_roles_learning_rates_stay_apart():
    run = train_ppo.parse_run([*PPO, "--adam_betas", "0.8", "0.9", "--l2", "0.1", "--lr_warmup_ratio", "0.5",
                               "--actor_learning_rate", "2e-6", "--critic_learning_rate", "3e-6"])  # fmt: skip
    for optim, lr in ((run.actor_optim, 2e-6), (run.critic_optim, 3e-6)):
        assert (optim.learning_rate, optim.adam_betas, optim.l2, optim.lr_warmup_ratio) == (
            lr,
            (0.8, 0.9),
            0.1,
            0.5,
        )


def test_fields_named_by_component_keep_openrlhf_flags():
    run = train_ppo.parse_run([*PPO, "--reward_pretrain", "rm", "--critic_pretrain", "c", "--save_value_network",
                               "--normalize_reward", "--agent_func_path", "a.py", "--num_episodes", "2"])  # fmt: skip
    assert (run.reward.pretrain, run.reward.normalize, run.critic.pretrain, run.critic.save) == (
        "rm",
        True,
        "c",
        True,
    )
    assert (run.agent.func_path, run.train.num_episodes, run.critic_source) == ("a.py", 2, "c")


def test_three_bad_flags_in_three_configs_and_a_cross_config_problem_in_one_error():
    argv = [
        *PPO,
        "--top_p",
        "0",
        "--gamma",
        "2",
        "--critic_learning_rate",
        "-1",
        "--advantage_estimator",
        "rloo",
    ]
    with pytest.raises(ConfigError) as info:
        train_ppo.parse_run(argv)
    assert str(info.value).splitlines() == [
        "--top_p must be in (0, 1], got 0.0",
        "--gamma must be in [0, 1], got 2.0",
        "--gamma 2.0: --advantage_estimator rloo is undiscounted",
        "--critic_learning_rate must be > 0, got -1.0",
        "--advantage_estimator rloo compares samples of a prompt: set --n_samples_per_prompt >= 2",
    ]


def test_run_check_collects_problems_of_configs_built_without_checks():
    with deferred_checks():
        run = PPORun(
            actor=ModelConfig(pretrain="m", lora_rank=-1),
            data=PromptDataConfig(prompt_data="p"),
            rollout=RolloutConfig(prompt_max_len=8, max_len=4),
            reward=RewardConfig(pretrain="rm", remote_url="r.py"),
            actor_optim=OptimConfig(learning_rate=float("nan")),
        )
    with pytest.raises(ConfigError) as info:
        run.check()
    assert str(info.value).splitlines() == [
        "--lora_rank must be >= 0, got -1",
        "--max_len 4 leaves no room for a response after --prompt_max_len 8",
        "use either --remote_rm_url or --reward_pretrain, not both",
        "--actor_learning_rate must be a finite number, got nan",
    ]
    with pytest.raises(ConfigError, match="not both"):  # outside deferred_checks, building raises
        dataclasses.replace(run.reward)


def test_supervised_check_with_a_world_covers_the_batch_split():
    run = _supervised(SFTRun)
    run.check()  # no world: nothing depends on the process count
    with pytest.raises(
        ConfigError, match="--train_batch_size 128 must be divisible by --micro_train_batch_size 8 x 3"
    ):
        run.check(SimpleNamespace(world_size=3))


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_group_requirement_comes_from_the_estimator_registry(name):
    assert AlgorithmConfig(advantage_estimator=name).needs_groups == ADVANTAGE_ESTIMATORS[name].grouped
    argv = [*PPO, "--advantage_estimator", name, "--n_samples_per_prompt", "1", "--init_kl_coef", "0"]
    if ADVANTAGE_ESTIMATORS[name].grouped:
        with pytest.raises(ConfigError, match="compares samples of a prompt"):
            train_ppo.parse_run(argv)
    else:
        assert train_ppo.parse_run(argv).algorithm.advantage_estimator == name


def test_supervised_trainer_checks_join_the_same_pass():
    argv = [
        *SUPERVISED,
        "--aux_loss_coef",
        "0.1",
        "--lora_rank",
        "4",
        "--normalize_reward",
        "--max_epochs",
        "0",
    ]
    with pytest.raises(ConfigError) as info:
        train_rm.parse_run(argv)
    assert str(info.value).splitlines() == [
        "--max_epochs must be >= 1, got 0",
        "--aux_loss_coef: the MoE load-balancing loss is not supported for reward models",
        "--normalize_reward with --lora_rank: LoRA runs save adapters only, which cannot carry the "
        "reward mean/std; merge the adapters (tidal lora_combiner) and train without LoRA, or drop one",
    ]
    with pytest.raises(ConfigError) as info:
        train_dpo.parse_run([*SUPERVISED, "--beta", "0", "--ipo", "--label_smoothing", "0.1", "--l2", "-1"])
    assert str(info.value).splitlines() == [
        "--l2 must be >= 0, got -1.0",
        "--beta must be positive, got 0.0",
        "--label_smoothing (cDPO) applies to the sigmoid DPO loss, not to --ipo",
    ]
    kto = train_kto.parse_run([*SUPERVISED, "--train_batch_size", "2", "--micro_train_batch_size", "1"])
    with pytest.raises(ConfigError, match="KTO needs --train_batch_size of at least 2 per device"):
        kto.check(SimpleNamespace(world_size=2))
