"""On-policy distillation with the teacher on a worker process of its own (``--teacher_num_nodes /
--teacher_num_gpus_per_node``, in the reference's place): the same steps as with the colocated teacher,
and the flags' layout errors."""

from __future__ import annotations

import json

import pytest

from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.placement.roles import worker_counts
from tidal.testing import build_tiny_model
from tidal.testing.tolerance import assert_same_steps, tiny_parameter_count
from tidal.trainers.ppo import run_ppo


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny student, a teacher with its tokenizer and peaked logits (its weights, scaled), and prompts."""
    d = tmp_path_factory.mktemp("teacher_placement")
    student = build_tiny_model(d / "student", "qwen2", seed=0)
    teacher = build_tiny_model(d / "teacher", "qwen2", seed=0, logit_scale=4.0)  # same tokenizer
    with (d / "prompts.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}="}) + "\n")
    return student, teacher, d / "prompts.jsonl"


def flags(setup, out, *extra) -> list[str]:
    student, teacher, prompts = setup
    return [
        "--pretrain", str(student), "--teacher_model", str(teacher), "--prompt_data", str(prompts),
        "--input_key", "prompt", "--advantage_estimator", "group_norm", "--init_kl_coef", "1",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "5e-3", "--lr_warmup_ratio", "0", "--seed", "2",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


def test_teacher_on_its_own_process_matches_the_colocated_teacher(setup, tmp_path):
    local = run_ppo(parse_run(flags(setup, tmp_path / "local")))
    own = ["--teacher_num_nodes", "1", "--teacher_num_gpus_per_node", "1"]
    separate = run_ppo(parse_run(flags(setup, tmp_path / "separate", *own)))
    assert len(local) == len(separate) == 2
    keys = ("reward", "kl", "policy/loss", "grad_norm", "advantages/abs_mean")
    assert_same_steps(local, separate, keys, tiny_parameter_count("qwen2"))
    # the teacher (not a copy of the student, whose KL would start at 0) took part, and moved the policy
    assert separate[0]["kl"] > 0.01 and separate[0]["grad_norm"] > 0


def test_teacher_flags_size_the_reference_role(setup, tmp_path):
    def counts(*extra, world=1):
        return worker_counts(parse_run(flags(setup, tmp_path, *extra)), world)

    assert counts()["reference"] == 0  # colocated by default
    assert counts("--teacher_num_gpus_per_node", "1")["reference"] == 1
    assert counts("--teacher_num_gpus_per_node", "1", "--colocate_actor_ref")["reference"] == 0
    assert counts("--ref_num_gpus_per_node", "1")["reference"] == 1  # the reference's flags place it too
    assert (
        counts("--teacher_num_gpus_per_node", "4", "--actor_num_gpus_per_node", "2", world=2)["reference"]
        == 2
    )
    with pytest.raises(ConfigError, match="--teacher_num_nodes x --teacher_num_gpus_per_node = 3"):
        counts("--teacher_num_gpus_per_node", "3", world=2)  # torchrun: 2 processes, sizes from the flags


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--teacher_num_gpus_per_node", "3", "--actor_num_gpus_per_node", "2"],
         "--teacher_num_nodes x --teacher_num_gpus_per_node = 3: .* multiple of 2"),
        (["--teacher_num_gpus_per_node", "3", "--actor_num_gpus_per_node", "2", "--colocate_actor_ref"],
         "--teacher_num_nodes/--teacher_num_gpus_per_node \\(1, 3\\): the teacher model is colocated"),
        (["--teacher_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1"], "one pair of flags"),
        (["--teacher_num_nodes", "0"], "must be >= 1"),
        (["--teacher_num_gpus_per_node", "1", "--ref_reward_offload"], "--ref_reward_offload"),
    ],
)  # fmt: skip
def test_bad_teacher_layouts(setup, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_run(flags(setup, tmp_path, *extra))


def test_teacher_flags_need_a_teacher(setup, tmp_path):
    no_teacher = flags(setup, tmp_path, "--teacher_num_gpus_per_node", "1")
    at = no_teacher.index("--teacher_model")
    del no_teacher[at : at + 2]
    with pytest.raises(ConfigError, match="--teacher_num_nodes/--teacher_num_gpus_per_node place the"):
        parse_run(no_teacher)
