"""The reference and reward models on devices of their own: which roles get separate workers, and a
run with a separate reference, reward model and engine takes the same steps as the colocated run."""

from __future__ import annotations

import json

import pytest
import torch

from tidal.checkpoint import save_hf_model
from tidal.cli.train_ppo import parse_run
from tidal.config import ConfigError, ModelConfig
from tidal.distributed import World
from tidal.models import load_tokenizer
from tidal.models.value_model import load_value_model, reward_config
from tidal.placement.roles import worker_counts
from tidal.trainers.ppo import run_ppo


@pytest.fixture(scope="module")
def rm_path(tiny_qwen2, tmp_path_factory):
    """An (untrained) reward model with the policy's tokenizer, as tidal rm writes it."""
    torch.manual_seed(0)
    model = load_value_model(ModelConfig(pretrain=str(tiny_qwen2)), torch.device("cpu"))
    tokenizer, out = load_tokenizer(str(tiny_qwen2)), tmp_path_factory.mktemp("rm")
    return save_hf_model(model, tokenizer, out, World(), reward_config(model, tokenizer, 0.0, 1.0))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with path.open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}="}) + "\n")
    return path


def flags(policy, rm, prompts, out, *extra) -> list[str]:
    return [
        "--pretrain", str(policy), "--reward_pretrain", str(rm), "--prompt_data", str(prompts),
        "--input_key", "prompt", "--advantage_estimator", "reinforce_baseline", "--init_kl_coef", "0.05",
        "--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "16",
        "--micro_train_batch_size", "8", "--generate_max_len", "4", "--prompt_max_len", "8",
        "--actor_learning_rate", "5e-3", "--lr_warmup_ratio", "0", "--seed", "2",
        "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
    ]  # fmt: skip


SEPARATE = ["--ref_num_gpus_per_node", "1", "--reward_num_gpus_per_node", "1", "--vllm_num_engines", "1"]


def test_which_roles_get_workers_of_their_own(tiny_qwen2, rm_path, prompts, tmp_path):
    def counts(*extra, world=1):
        return worker_counts(parse_run(flags(tiny_qwen2, rm_path, prompts, tmp_path, *extra)), world)

    assert counts() == {"engine": 0, "reference": 0, "reward model": 0}  # local mode: all on one device
    assert counts(*SEPARATE) == {"engine": 1, "reference": 1, "reward model": 1}
    assert counts(*SEPARATE, "--colocate_all_models", "--vllm_num_engines", "1") == {
        "engine": 0, "reference": 0, "reward model": 0}  # fmt: skip
    assert counts(*SEPARATE, "--colocate_actor_ref", "--colocate_critic_reward") == {
        "engine": 1, "reference": 0, "reward model": 0}  # fmt: skip
    assert counts("--ref_num_gpus_per_node", "4", "--actor_num_gpus_per_node", "2", world=2)["reference"] == 2
    with pytest.raises(ConfigError, match="multiple of 2"):
        counts("--ref_num_gpus_per_node", "3", "--actor_num_gpus_per_node", "2")
    with pytest.raises(ConfigError, match="--ref_reward_offload"):
        counts(*SEPARATE, "--ref_reward_offload")  # nothing left to offload
    with pytest.raises(ConfigError, match="--ref_num_nodes x --ref_num_gpus_per_node = 3"):
        counts("--ref_num_gpus_per_node", "3", world=2)  # torchrun: 2 processes, sizes from the flags


def test_separate_reference_reward_model_and_engine_match_colocated(tiny_qwen2, rm_path, prompts, tmp_path):
    # the colocated run also keeps its reference and reward model in host memory between uses
    local = run_ppo(
        parse_run(flags(tiny_qwen2, rm_path, prompts, tmp_path / "local", "--ref_reward_offload"))
    )
    separate = run_ppo(parse_run(flags(tiny_qwen2, rm_path, prompts, tmp_path / "separate", *SEPARATE)))
    assert len(local) == len(separate) == 2
    for a, b in zip(local, separate, strict=True):
        for key in ("reward", "kl", "policy/loss", "grad_norm", "advantages/abs_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (key, a[key], b[key])
    assert separate[-1]["kl"] != 0.0  # the reference took part


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_reference_worker_on_the_second_gpu_matches_the_colocated_reference(
    tiny_qwen2, rm_path, prompts, tmp_path
):
    """Policy on cuda:0, reference worker process on cuda:1 (float32): the same KL and losses as with the
    reference on cuda:0."""
    extra = ("--param_dtype", "fp32")
    local = run_ppo(parse_run(flags(tiny_qwen2, rm_path, prompts, tmp_path / "local", *extra)))
    separate = run_ppo(parse_run(flags(tiny_qwen2, rm_path, prompts, tmp_path / "sep", *extra,
                                       "--ref_num_gpus_per_node", "1")))  # fmt: skip
    for a, b in zip(local, separate, strict=True):
        for key in ("reward", "kl", "policy/loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a[key], b[key])
