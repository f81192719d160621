"""Ray mode with tensor-parallel engines on CUDA (NCCL, bf16 engines): what the CPU tests in
``test_ray_tp.py`` cannot show — Ray hands an engine actor its 2 GPUs (``CUDA_VISIBLE_DEVICES``) and
the rank process it starts finds the second, and a TP=2 engine colocated over two policy actors (one GPU
each) forms its NCCL groups. Both runs must complete with finite losses (bf16 engines: their numbers
are not compared; the CPU tests compare them in float32)."""

from __future__ import annotations

import json
import math

import pytest
import torch

ray = pytest.importorskip("ray")

from tidal.cli.train_ppo import main as ppo_main  # noqa: E402
from tidal.placement import ray_launch  # noqa: E402

REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)])
"""


@pytest.fixture(scope="module")
def gpu_cluster():
    """One Ray node with this machine's GPUs; the test process is the driver."""
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False)
    yield
    ray.shutdown()


def flags(model, folder, *extra) -> list[str]:
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}=", "label": str(i % 10 + i % 3)}) + "\n")
    (folder / "reward.py").write_text(REWARD)
    return [
        "--pretrain", str(model), "--prompt_data", str(folder / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(folder / "reward.py"), "--advantage_estimator",
        "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4", "--generate_max_len", "4",
        "--prompt_max_len", "8", "--init_kl_coef", "0", "--max_samples", "8", "--zero_stage", "3",
        "--actor_num_gpus_per_node", "2", "--vllm_tensor_parallel_size", "2", "--save_path",
        str(folder / "final"), "--ckpt_path", str(folder / "ckpt"), *extra,
    ]  # fmt: skip


def check_history(history: list[dict]) -> None:
    assert [h["step"] for h in history] == [1, 2]
    assert all(math.isfinite(h["policy/loss"]) and 0 <= h["reward"] <= 1 for h in history), history


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 6, reason="needs 6 CUDA GPUs (2 policy + 2 engines x 2)")
def test_separate_tp2_engine_actors_hold_two_gpus_each(gpu_cluster, tiny_llama, tmp_path, monkeypatch):
    groups = []
    original = ray_launch._role_group

    def record(run, role, count):
        group = original(run, role, count)
        groups.append((role, count, group.resources))
        return group

    monkeypatch.setattr(ray_launch, "_role_group", record)
    history = ppo_main(flags(tiny_llama, tmp_path, "--vllm_num_engines", "2"))
    assert groups == [("engine", 2, {"GPU": 2.0})]
    check_history(history)
    assert all(h["time/sync_weights"] > 0 for h in history)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_engine_colocated_over_two_policy_actors(gpu_cluster, tiny_llama, tmp_path):
    check_history(ppo_main(flags(tiny_llama, tmp_path, "--colocate_all_models")))
