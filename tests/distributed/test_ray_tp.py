"""Ray mode with tensor-parallel rollout engines (``--vllm_tensor_parallel_size 2``) on a one-node CPU
Ray cluster (gloo, tiny fp32 Llama): two policy workers driving an engine each in a bundle of 2 CPUs
(the engine actor starts its second rank), and two policy workers sharing one engine colocated over
both, take the steps of one process with a one-process engine (the same samples, rewards and losses
within 1e-5; that a local TP=2 engine takes those steps too is checked by
``tests/rollout/test_tp_rl.py::test_tp2_engine_takes_the_steps_of_one_process``); layouts the cluster
can never hold fail in one line before anything is placed or loaded."""

from __future__ import annotations

import json

import pytest

ray = pytest.importorskip("ray")

from tidal.cli.train_ppo import main as ppo_main  # noqa: E402
from tidal.cli.train_ppo import parse_run  # noqa: E402
from tidal.placement.ray_launch import ray_layout_problem  # noqa: E402
from tidal.testing.tolerance import assert_same_steps, tiny_parameter_count  # noqa: E402
from tidal.trainers.ppo import run_ppo  # noqa: E402

CPUS = 6  # 2 policy workers + 2 engines x 2 ranks
COMPARED = ("reward", "score", "response_length", "policy/loss")  # rank 0's token means: not grad_norm

REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)])
"""


@pytest.fixture(scope="module")
def cluster():
    """One Ray node of ``CPUS`` CPUs; the test process is the driver. Workers' logs are not forwarded to it:
    Ray prints them when they arrive, which may be during a later test that reads its own stderr."""
    ray.init(num_cpus=CPUS, num_gpus=0, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray_tp") / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}=", "label": str(i % 10 + i % 3)}) + "\n")
    (path.parent / "reward.py").write_text(REWARD)
    return path


def flags(model, prompts, out, *extra) -> list[str]:
    """2 rollouts of 4 prompts x 2 samples, one optimizer step each."""
    return [
        "--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(prompts.parent / "reward.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4", "--generate_max_len", "4",
        "--prompt_max_len", "8", "--actor_learning_rate", "5e-3", "--lr_warmup_ratio", "0", "--init_kl_coef",
        "0", "--seed", "5", "--max_samples", "8", "--zero_stage", "3", "--save_path", str(out / "final"),
        "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def local_run(tiny_llama, prompts, tmp_path_factory):
    """One process with a one-process engine."""
    return run_ppo(parse_run(flags(tiny_llama, prompts, tmp_path_factory.mktemp("tp1"))))


def wait_released() -> None:
    """Actors and placement groups are released asynchronously: every CPU is free again."""
    import time

    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != CPUS and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == CPUS


@pytest.mark.parametrize(
    "placement",
    [["--vllm_num_engines", "2"], ["--colocate_all_models"]],
    ids=["separate-engines", "colocated-engine"],
)
def test_ray_tp2_engines_take_the_steps_of_one_process(
    cluster, tiny_llama, prompts, local_run, tmp_path, placement
):
    argv = flags(tiny_llama, prompts, tmp_path, "--actor_num_gpus_per_node", "2",
                 "--vllm_tensor_parallel_size", "2", *placement)  # fmt: skip
    history = ppo_main(argv)
    assert len(history) == len(local_run) == 2
    assert any(h["policy/loss"] != 0.0 for h in history)
    assert_same_steps(local_run, history, COMPARED, tiny_parameter_count("llama"))
    wait_released()


def test_too_few_devices_exit_2_before_placing(cluster, tiny_llama, prompts, tmp_path, capsys):
    """4 TP=2 engines and 2 policy workers need 10 CPUs; the cluster has 6: refused in one line, nothing
    placed (the per-node case is in ``test_layout_problem_counts_every_role_on_gpus``)."""
    extra = ["--vllm_num_engines", "4", "--vllm_tensor_parallel_size", "2"]
    argv = flags(tiny_llama, prompts, tmp_path, "--actor_num_gpus_per_node", "2", *extra)
    with pytest.raises(SystemExit) as exc:
        ppo_main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "tidal ppo: error: Ray mode needs 10 CPUs for 2 policy workers (--actor_num_nodes x "
        "--actor_num_gpus_per_node) + 4 engine workers (--vllm_num_engines) x 2 (--vllm_tensor_parallel_size); "
        "the cluster has 6\n"
    )
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
    )


def test_layout_problem_counts_every_role_on_gpus(tiny_llama, prompts, tmp_path):
    """GPU clusters: N GPUs per engine on one node, one per policy, reference and reward worker."""
    extra = ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "2",
             "--ref_num_gpus_per_node", "2", "--init_kl_coef", "0.01"]  # fmt: skip
    run = parse_run(flags(tiny_llama, prompts, tmp_path, *extra))
    assert ray_layout_problem(run, "GPU", [8.0]) is None  # 2 + 2 x 2 + 2 = 8
    assert ray_layout_problem(run, "GPU", [4.0, 4.0]) is None
    assert ray_layout_problem(run, "GPU", [1.0] * 8).startswith(
        "--vllm_tensor_parallel_size 2 in Ray mode: each engine is one placement-group bundle of 2 GPUs"
    )
    assert ray_layout_problem(run, "GPU", [4.0, 3.0]) == (
        "Ray mode needs 8 GPUs for 2 policy workers (--actor_num_nodes x --actor_num_gpus_per_node) + 2 engine "
        "workers (--vllm_num_engines) x 2 (--vllm_tensor_parallel_size) + 2 reference workers (--ref_num_nodes "
        "x --ref_num_gpus_per_node); the cluster has 7"
    )
