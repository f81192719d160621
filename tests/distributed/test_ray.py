"""Ray mode: ``tidal ppo`` with 2 policy workers on a 2-node Ray cluster (one CPU each, on this
machine) places one worker per node, runs the data-parallel loop there and returns rank 0's metrics;
separate rollout engines run as Ray actors of their own."""

from __future__ import annotations

import json
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from tidal.cli.train_ppo import main as ppo_main  # noqa: E402
from tidal.distributed import ray_group  # noqa: E402

REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": torch.tensor([sum(map(ord, q[len(p):])) % 5 / 5 for q, p in zip(queries, prompts)])}
"""


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each; the test process is the driver."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    c.add_node(num_cpus=1, num_gpus=0)
    ray.init(address=c.address)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


def grpo_flags(policy, folder) -> list[str]:
    with (folder / "prompts.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n")
    (folder / "reward.py").write_text(REWARD)
    return [
        "--actor_num_nodes", "2", "--actor_num_gpus_per_node", "1", "--pretrain", str(policy),
        "--prompt_data", str(folder / "prompts.jsonl"), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(folder / "reward.py"), "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--generate_max_len", "4", "--prompt_max_len", "8", "--init_kl_coef", "0",
        "--zero_stage", "3", "--save_path", str(folder / "final"), "--ckpt_path", str(folder / "ckpt"),
    ]  # fmt: skip


def wait_released(cpus: int) -> None:
    deadline = time.monotonic() + 30  # workers and placement groups are released (asynchronously)
    while ray.available_resources().get("CPU") != cpus and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU") == cpus


def test_two_workers_on_two_nodes_run_grpo(cluster, tiny_qwen2, tmp_path, monkeypatch):
    placed = []
    original = ray_group.RayWorkerGroup.rank_env

    def record(self):
        placed.extend(node for node, _ in self.nodes)
        return original(self)

    monkeypatch.setattr(ray_group.RayWorkerGroup, "rank_env", record)
    history = ppo_main(
        grpo_flags(tiny_qwen2, tmp_path) + ["--vllm_num_engines", "2", "--colocate_all_models"]
    )
    assert len(placed) == 2 and len(set(placed)) == 2  # one worker on each node
    assert [h["step"] for h in history] == [1, 2]
    assert all("policy/loss" in h for h in history)
    assert (tmp_path / "final" / "model.safetensors").exists()
    wait_released(2)


def test_separate_engines_and_reference_are_actors_of_their_own(cluster, tiny_qwen2, tmp_path):
    """2 policy workers, 2 engine actors and 2 reference actors (bundles of their own, on a third node):
    weights reach the engines by broadcast over each worker's sync group (gloo), reference log-probs
    come from the reference actors, and training completes."""
    cluster.add_node(num_cpus=4, num_gpus=0)
    cluster.wait_for_nodes()
    extra = ["--vllm_num_engines", "2", "--ref_num_gpus_per_node", "2", "--init_kl_coef", "0.01"]
    history = ppo_main(grpo_flags(tiny_qwen2, tmp_path) + extra)
    assert [h["step"] for h in history] == [1, 2]
    assert all("policy/loss" in h and "kl" in h and h["time/sync_weights"] > 0 for h in history)
    wait_released(6)
