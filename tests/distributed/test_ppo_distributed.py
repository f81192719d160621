"""RL over 2 CPU processes (data-parallel rollouts, FSDP2 policy/critic, gloo) matches 1 process per
rollout: the same samples (seeds follow the global prompt index), rewards, losses; the batch-wide
steps (advantage whitening, reward normalisation, adaptive KL) are reduced over processes; after
every weight sync each rank's engine (or its separate engine processes, fed by bucketed broadcast)
holds exactly the policy's full weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError
from tidal.trainers.ppo import run_ppo

REWARD = '''
import torch


def reward_func(queries, prompts, labels, **kwargs):
    """A dense, deterministic reward of the response text, so every group has a signal."""
    values = [sum(ord(c) for c in q[len(p):]) % 7 / 7 for q, p in zip(queries, prompts)]
    return {"rewards": torch.tensor(values), "extra_logs": {"reward_sq": torch.tensor(values).pow(2).mean()}}
'''


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    with (d / "prompts.jsonl").open("w") as f:
        for i in range(8):  # 2 rollouts: the second runs on synced weights, adapted KL, running stats
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}=", "label": str(i % 10 + i % 3)}) + "\n")
    (d / "reward.py").write_text(REWARD)
    with (d / "pretrain.jsonl").open("w") as f:  # --pretrain_data: each rank reads its own micro-batches
        for i in range(40):
            f.write(json.dumps({"prompt": f"{i} fox"}) + "\n")
    return d


def rl_flags(policy, data: Path, out: Path, *extra) -> list[str]:
    """2 rollouts of 4 prompts x 4 samples; one optimizer step per rollout (train batch = rollout)."""
    return [
        "--pretrain", str(policy), "--prompt_data", str(data / "prompts.jsonl"), "--input_key", "prompt",
        "--label_key", "label", "--remote_rm_url", str(data / "reward.py"), "--n_samples_per_prompt", "4",
        "--rollout_batch_size", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
        "--micro_rollout_batch_size", "4", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "2e-3", "--lr_warmup_ratio", "0", "--zero_stage", "3", "--seed", "3",
        "--temperature", "1.0", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


# fmt: off
CONFIGS = {
    "grpo": ["--advantage_estimator", "group_norm", "--init_kl_coef", "0"],
    # generation on a background thread, one rollout ahead of training, on every rank
    "grpo_async": ["--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--async_train",
                   "--enable_vllm_is_correction"],
    # whitened advantages, running reward normalisation, reference + adaptive KL in the reward
    "rpp_baseline": ["--advantage_estimator", "reinforce_baseline", "--init_kl_coef", "0.05", "--kl_target",
                     "0.01", "--normalize_reward", "--colocate_actor_ref"],
    # a sharded critic, dynamic micro-batches (equalised across ranks)
    # DAPO dynamic sampling without refill: 1 process drops the filtered groups, 2 processes mask them out
    "grpo_filter": ["--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--dynamic_filtering",
                    "--dynamic_filtering_reward_range", "0.3", "0.6", "--dynamic_filtering_no_refill"],
    # separate engines: 1 process drives 2 engine processes, 2 processes drive one each
    "grpo_engines": ["--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--vllm_num_engines", "2"],
    "gae": ["--advantage_estimator", "gae", "--init_kl_coef", "0", "--critic_learning_rate", "2e-3",
            "--n_samples_per_prompt", "2", "--train_batch_size", "8", "--use_dynamic_batch",
            "--train_max_tokens_per_gpu", "24"],
    # OpenRLHF's PPO flags: an EMA of the sharded policy (the saved model), the ptx loss, centred advantages
    # (a sequence-mean loss, since the token mean of centred advantages is 0 on the first pass)
    "ema_ptx": ["--advantage_estimator", "reinforce", "--init_kl_coef", "0", "--no_advantage_std_norm",
                "--loss_agg_mode", "sequence", "--enable_ema", "--ema_beta", "0.5", "--ptx_coef", "0.5",
                "--stop_properly_penalty_coef", "0.5"],
}
# fmt: on
# Token-weighted logged means (advantages/*, kl) are averaged per rank, so they are not compared.
KEYS = ("reward", "score", "policy/loss", "response_length", "reward_sq", "kl_coef")


def test_two_processes_match_one(tiny_qwen2, rl_data, tmp_path, dist):
    configs = {
        **CONFIGS,
        "ema_ptx": [*CONFIGS["ema_ptx"], "--pretrain_data", str(rl_data / "pretrain.jsonl")],
    }
    one = {name: run_ppo(parse_run(rl_flags(tiny_qwen2, rl_data, tmp_path / f"{name}1", *extra)))
           for name, extra in configs.items()}  # fmt: skip
    specs = [
        {"kind": "ppo", "out": str(tmp_path / f"{name}2.json"), "check_sync": True,
         "argv": rl_flags(tiny_qwen2, rl_data, tmp_path / f"{name}2", *extra)}
        for name, extra in configs.items()
    ]  # fmt: skip
    dist.torchrun(specs, tmp_path, fork=True)
    for name in CONFIGS:
        two = dist.result(tmp_path / f"{name}2.json")
        assert len(two["history"]) == 2
        assert any(h["policy/loss"] != 0.0 for h in one[name])
        keys = KEYS + {
            "gae": ("critic/loss",),
            "grpo_filter": ("grad_norm", "dynamic_filter/kept"),
            "ema_ptx": ("policy/ptx_loss", "grad_norm"),
        }.get(name, ())
        dist.assert_steps_match(one[name], two["history"], keys)
        assert len(two["syncs"]) == 2 and all(s == [] for s in two["syncs"]), two["syncs"]
    # the EMA of the FSDP2-sharded policy (each rank averages its shards) saves as one process's does
    saved = [load_file(tmp_path / f"ema_ptx{n}" / "final" / "model.safetensors") for n in (1, 2)]
    for name, weight in saved[0].items():
        torch.testing.assert_close(saved[1][name], weight, atol=2e-5, rtol=1e-4, msg=name)


def test_placement_flags_fail_clearly(tiny_qwen2, rl_data, tmp_path):
    base = rl_flags(tiny_qwen2, rl_data, tmp_path, "--advantage_estimator", "group_norm")
    cases = [
        (["--actor_num_gpus_per_node", "2", "--vllm_tensor_parallel_size", "4"], "--vllm_tensor_parallel_size"),
        (["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1"], "--vllm_num_engines"),
        (["--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "4", "--advantage_estimator", "gae"],
         "--critic_num_nodes"),
        # a colocated role is 1x1 or the actor's size; separate ones come in multiples of the workers
        (["--actor_num_gpus_per_node", "2", "--init_kl_coef", "0.1", "--ref_num_gpus_per_node", "3",
          "--colocate_actor_ref"], "--ref_num_nodes"),
        (["--actor_num_gpus_per_node", "2", "--init_kl_coef", "0.1", "--ref_num_gpus_per_node", "3"],
         "multiple of 2"),
        # separate engines: the same number per policy worker, and nothing to sleep for
        (["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "3"], "multiple of 2"),
        (["--vllm_num_engines", "1", "--vllm_enable_sleep"], "--vllm_enable_sleep"),
        (["--vllm_num_engines", "1", "--deepspeed_enable_sleep"], "--deepspeed_enable_sleep"),
        (["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--colocate_all_models"],
         "--colocate_all_models"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            parse_run(base + extra)
    with pytest.raises(ConfigError, match="--vllm_num_engines 2 with --colocate_all_models"):
        run_ppo(parse_run(base + ["--vllm_num_engines", "2", "--colocate_all_models"]))
