"""``tidal ppo --vllm_tensor_parallel_size 2`` on the CPU: a local-mode engine of two processes, and a
separate engine process that itself spans two, take the steps of the one-process engine (weights synced
to every rank between steps); layouts the config refuses fail in one line before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tidal.cli.train_ppo import main as ppo_main
from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo import run_ppo

COMPARED = ("reward", "score", "response_length", "policy/loss", "grad_norm")


DENSE_REWARD = """
import torch


def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)])
"""


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Prompts, and next to them ``reward.py``: a dense reward of the response text (every group learns)."""
    path = tmp_path_factory.mktemp("tp_rl") / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}=", "label": str(i % 10 + i % 3)}) + "\n")
    (path.parent / "reward.py").write_text(DENSE_REWARD)
    return path


def flags(model, prompts, out, *extra) -> list[str]:
    return [
        "--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "label",
        "--remote_rm_url", str(prompts.parent / "reward.py"), "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
        "--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "8",
        "--generate_max_len", "4", "--prompt_max_len", "8", "--actor_learning_rate", "5e-3", "--lr_warmup_ratio",
        "0", "--init_kl_coef", "0", "--seed", "5", "--max_samples", "8", "--save_path", str(out / "final"),
        "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tiny_model, prompts, tmp_path_factory):
    return run_ppo(parse_run(flags(tiny_model("llama"), prompts, tmp_path_factory.mktemp("tp1"))))


@pytest.mark.parametrize("extra", [[], ["--vllm_num_engines", "1"]], ids=["local-engine", "separate-engine"])
def test_tp2_engine_takes_the_steps_of_one_process(tiny_model, prompts, one_process, tmp_path, extra):
    tp2 = run_ppo(
        parse_run(flags(tiny_model("llama"), prompts, tmp_path, "--vllm_tensor_parallel_size", "2", *extra))
    )
    assert len(tp2) == len(one_process) == 2
    for a, b in zip(one_process, tp2, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--vllm_tensor_parallel_size", "4"],
            "--vllm_tensor_parallel_size 4: tensor-parallel size 4 does not divide num_attention_heads=6",
        ),  # fmt: skip
        (
            ["--vllm_tensor_parallel_size", "2", "--actor_num_gpus_per_node", "3"],
            "--vllm_tensor_parallel_size 2 with engines colocated with the 3 policy workers: each engine spans 2 "
            "consecutive workers' devices, so 2 must divide 3",
        ),
        (
            ["--vllm_tensor_parallel_size", "2", "--actor_num_gpus_per_node", "2", "--async_train"],
            "--vllm_tensor_parallel_size 2 with --async_train",
        ),
    ],
)
def test_impossible_tp_layouts_exit_2(tiny_model, prompts, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        ppo_main(flags(tiny_model("llama"), prompts, tmp_path, *extra))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "final").exists()


def test_local_tp_engine_with_too_few_gpus_exits_2(tiny_model, prompts, tmp_path, capsys, monkeypatch):
    """On CUDA the local engine spans the trainer's GPU and the next ones: too few fail before loading."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        ppo_main(flags(tiny_model("llama"), prompts, tmp_path, "--vllm_tensor_parallel_size", "2"))
    assert exc.value.code == 2
    message = (
        "--vllm_tensor_parallel_size 2: the local engine spans 2 GPUs from the trainer's (cuda:0..cuda:1)"
    )
    assert f"{message} but 1 are visible" in capsys.readouterr().err


def test_local_tp_engine_over_separate_workers_gpus_exits_2(
    tiny_model, prompts, tmp_path, capsys, monkeypatch
):
    """A local TP=2 engine takes cuda:1, where a reference on a device of its own would start: refused."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    extra = ("--vllm_tensor_parallel_size", "2", "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1",
             "--init_kl_coef", "0.01")  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        ppo_main(flags(tiny_model("llama"), prompts, tmp_path, *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--vllm_tensor_parallel_size 2: the local engine spans cuda:0..cuda:1, the GPUs where the ref" in err
    )


RUNNER = Path(__file__).resolve().parents[1] / "distributed" / "dist_runner.py"


@pytest.mark.slow  # about a minute on a loaded 2-core machine (torchrun start-up, FSDP2)
def test_engine_spanning_two_training_processes_takes_the_steps_of_one(tiny_model, prompts, tmp_path):
    """torchrun, 2 CPU processes (FSDP2 policy, gloo) with one TP=2 engine colocated over both (the
    hybrid engine): the per-step metrics of one process with a one-process engine, and after every sync
    each rank's shard holds the policy's weights."""
    common = ["--zero_stage", "3", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4",
              "--n_samples_per_prompt", "4", "--train_batch_size", "16", "--colocate_all_models"]  # fmt: skip
    model = tiny_model("llama")
    one = run_ppo(parse_run(flags(model, prompts, tmp_path / "one", *common)))
    argv = flags(model, prompts, tmp_path / "two", *common, "--vllm_tensor_parallel_size", "2")
    (tmp_path / "runs.json").write_text(json.dumps([{"kind": "ppo", "out": str(tmp_path / "two.json"),
                                                     "check_sync": True, "argv": argv}]))  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(RUNNER), str(tmp_path / "runs.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    two = json.loads((tmp_path / "two.json").read_text())
    assert len(two["history"]) == len(one) == 2
    for a, b in zip(one, two["history"], strict=True):
        for key in ("reward", "score", "response_length", "policy/loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (key, a[key], b[key])
    assert all(s == [] for s in two["syncs"]), two["syncs"]
