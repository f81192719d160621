"""A critic on devices of its own (``--critic_num_nodes/--critic_num_gpus_per_node``): a GAE run with the
critic in a process of its own, trained while the policy updates, takes the colocated run's steps,
resumes exactly and exports the value network; impossible layouts fail in one line before any model
loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidal.checkpoint import CheckpointError
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.distributed import World
from tidal.placement.build import log_placement
from tidal.placement.workers import ExtraDevices
from tidal.testing.tolerance import assert_same_steps as same_steps
from tidal.testing.tolerance import tiny_parameter_count
from tidal.trainers.ppo import run_ppo
from tidal.trainers.ppo.entry import check_tensor_parallel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEPARATE = ("--critic_num_nodes", "1", "--critic_num_gpus_per_node", "1")
KEYS = ("reward", "critic/loss", "policy/loss", "grad_norm", "values/mean", "advantages/abs_mean",
        "returns/mean", "kl", "nonfinite_steps")  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(16):  # 2 rollouts of 8
            f.write(json.dumps({"prompt": f"{i % 10}>", "label": str(i % 10)}) + "\n")
    return path


def flags(policy, prompts, out, *extra) -> list[str]:
    return [
        "--pretrain", str(policy), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(EXAMPLES / "reward_func.py"), "--advantage_estimator", "gae",
        "--init_kl_coef", "0.01", "--n_samples_per_prompt", "2", "--rollout_batch_size", "8",
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_epochs", "2",
        "--generate_max_len", "4", "--prompt_max_len", "8", "--actor_learning_rate", "5e-3",
        "--critic_learning_rate", "5e-3", "--lr_warmup_ratio", "0", "--seed", "5", "--save_steps", "1",
        "--save_value_network", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def assert_same_steps(expected: list[dict], got: list[dict]) -> None:
    assert [h["step"] for h in got] == [h["step"] for h in expected]
    same_steps(expected, got, KEYS, tiny_parameter_count("qwen2"))


def test_separate_critic_matches_colocated_resumes_and_exports(tiny_qwen2, prompts, tmp_path):
    colocated = run_ppo(parse_run(flags(tiny_qwen2, prompts, tmp_path / "here")))
    separate = run_ppo(parse_run(flags(tiny_qwen2, prompts, tmp_path / "own", *SEPARATE)))
    assert len(colocated) == 2 and all("critic/loss" in h for h in colocated)
    assert_same_steps(colocated, separate)
    assert colocated[-1]["critic/loss"] != colocated[0]["critic/loss"]  # the critic trained

    # the value network the critic's worker exports is the colocated critic's
    here = load_file(tmp_path / "here" / "final_critic" / "model.safetensors")
    own = load_file(tmp_path / "own" / "final_critic" / "model.safetensors")
    assert here.keys() == own.keys()
    for name, weight in here.items():
        torch.testing.assert_close(own[name], weight, atol=1e-5, rtol=1e-5, msg=name)

    # resume from the step-1 checkpoint (as if the run stopped there): the worker gets its critic state
    # (weights, AdamW moments after 2 epochs x 2 minibatches, scheduler) back, step 2 is the same
    shutil.copytree(tmp_path / "own" / "ckpt", tmp_path / "resumed" / "ckpt")
    (tmp_path / "resumed" / "ckpt" / "latest").write_text("global_step_1")
    resumed = run_ppo(
        parse_run(flags(tiny_qwen2, prompts, tmp_path / "resumed", *SEPARATE, "--load_checkpoint"))
    )
    assert [h["step"] for h in resumed] == [2]
    for key in KEYS:
        assert resumed[0][key] == separate[1][key], key

    # the colocated run's checkpoint has no critic worker state: a one-line refusal, not a traceback
    with pytest.raises(CheckpointError, match="no state of a critic on devices of its own"):
        run_ppo(parse_run(flags(tiny_qwen2, prompts, tmp_path / "here", *SEPARATE, "--load_checkpoint")))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # one critic worker per policy worker (torchrun with 2 processes: sizes from the flags)
        (("--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "1"), "must be 2"),
        (("--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "4"), "= 4: a critic on devices"),
    ],
)
def test_impossible_critic_layouts_fail_in_one_line(tiny_qwen2, prompts, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_run(flags(tiny_qwen2, prompts, tmp_path, *extra))
    assert "\n" not in str(err.value)


def test_critic_placements_refused_before_any_model_loads(tiny_qwen2, prompts, tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before the refusal")

    monkeypatch.setattr("tidal.trainers.ppo.entry.load_causal_lm", no_loading)
    # Ray mode (2 policy workers, no torchrun) has no critic workers of its own
    run = parse_run(flags(tiny_qwen2, prompts, tmp_path, "--actor_num_gpus_per_node", "2",
                          "--critic_num_gpus_per_node", "2"))  # fmt: skip
    with pytest.raises(ConfigError, match="not in Ray mode"):
        run_ppo(run)
    # tensor-parallel training: the critic's workers are data-parallel only
    run = parse_run(flags(tiny_qwen2, prompts, tmp_path, *SEPARATE, "--ds_tensor_parallel_size", "2"))
    with pytest.raises(ConfigError, match="critic on devices of its own"):
        check_tensor_parallel(run, World(world_size=2, tp_size=2))
    # torchrun: as many critic workers as processes, whatever the flags say
    run = parse_run(flags(tiny_qwen2, prompts, tmp_path, *SEPARATE))
    with pytest.raises(
        ConfigError, match="= 1: a critic on devices of its own runs one worker per policy worker"
    ):
        log_placement(run, World(world_size=2))
    # colocated with the reward model (so with the policy): no separate critic, nothing refused
    run = parse_run(flags(tiny_qwen2, prompts, tmp_path, *SEPARATE, "--colocate_critic_reward",
                          "--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "2"))  # fmt: skip
    assert run.placement.critic_num_gpus_per_node == 2


def test_critic_devices_come_after_every_trainers_other_workers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    extra = ExtraDevices({"engine": 1, "reference": 1, "reward model": 0})
    assert extra.devices("engine") == ["cuda:4"]  # trainers on 0-1, trainer 0's workers on 2-3
    assert extra.after("critic", 1) == ["cuda:7"]  # after both trainers' engines and references
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 7)
    with pytest.raises(ConfigError, match="need 8 GPUs on this node, found 7"):
        extra.after("critic", 1)


REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": torch.tensor([sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)])}
"""


@pytest.mark.slow  # about a minute on a loaded 2-core machine (2 ranks, 2 critic processes)
def test_two_critic_workers_under_torchrun_match_colocated(tiny_qwen2, prompts, tmp_path, ranks):
    """2 ranks (torchrun's variables): the critic on 2 worker processes of its own (their own FSDP2
    group, meeting at a free port, not the ranks' store) takes the colocated critic's steps."""
    (tmp_path / "reward.py").write_text(REWARD)  # a dense reward: the critic has returns to fit
    base = (
        "--remote_rm_url",
        str(tmp_path / "reward.py"),
        "--actor_num_gpus_per_node",
        "2",
        "--zero_stage",
        "3",
    )
    specs = [{"kind": "ppo", "out": str(tmp_path / f"{name}.json"), "argv": flags(tiny_qwen2, prompts, tmp_path / name,
                                                                               *base, *extra)}
             for name, extra in (("here", ()), ("own", ("--critic_num_gpus_per_node", "2")))]  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps(specs))
    runner = Path(__file__).resolve().parents[1] / "distributed" / "dist_runner.py"
    # 2 ranks with the variables torchrun gives them, forked by tests/trainers/conftest.py's launcher
    ranks.launch(runner, tmp_path / "runs.json")
    here, own = (json.loads((tmp_path / f"{n}.json").read_text())["history"] for n in ("here", "own"))
    assert len(here) == 2 and here[-1]["critic/loss"] != here[0]["critic/loss"]
    assert_same_steps(here, own)
