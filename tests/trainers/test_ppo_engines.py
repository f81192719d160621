"""Separate rollout engines: weights travel by bucketed broadcast and arrive exactly; an engine
process that fails says so; a run with separate engines matches one with the colocated engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.config import ModelConfig
from tidal.config.engine import rollout_engine_config as engine_config
from tidal.config.rl import AgentConfig, RolloutConfig
from tidal.distributed.weight_sync import plan_buckets
from tidal.models import load_tokenizer
from tidal.placement import remote_rollout
from tidal.placement.engines import EngineSpec, start_process_engines
from tidal.placement.remote_rollout import RemoteRollout
from tidal.rollout import EngineConfig, LLMEngine
from tidal.testing.tolerance import assert_same_steps, tiny_parameter_count

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REWARD, AGENT = EXAMPLES / "reward_func.py", EXAMPLES / "agent_func.py"


def test_plan_buckets_keeps_order_and_size():
    meta = [("a", (4, 4)), ("b", (8,)), ("c", (40,)), ("d", (2, 3))]
    plan = plan_buckets(meta, torch.float32, bucket_bytes=80)  # 64 + 32 > 80: b starts a new bucket
    assert [b.names for b in plan.buckets] == [("a",), ("b",), ("c",), ("d",)]
    plan = plan_buckets(meta, torch.bfloat16, bucket_bytes=80)  # half the bytes: a and b share one
    assert [b.names for b in plan.buckets] == [("a", "b"), ("c",), ("d",)]
    assert [b.numel for b in plan.buckets] == [24, 40, 6]


def _rollout(model_path, count: int) -> RemoteRollout:
    cfg = RolloutConfig(generate_max_len=4, prompt_max_len=8)
    spec = EngineSpec(str(model_path), ModelConfig(pretrain=str(model_path)), engine_config(cfg, "cpu", 0),
                      AgentConfig(), False, 1)  # fmt: skip
    tokenizer = load_tokenizer(str(model_path))
    engines = start_process_engines(spec, count, devices=["cpu"] * count)  # CPU processes, also with GPUs
    try:
        return RemoteRollout(engines, tokenizer, cfg, torch.device("cpu"), tokenizer.pad_token_id)
    except BaseException:
        for e in engines:
            e.close()
        raise


def test_sync_makes_every_engine_equal_the_policy(tiny_qwen2, monkeypatch):
    monkeypatch.setattr(remote_rollout, "BUCKET_BYTES", 64 << 10)  # many buckets for a 1.7M model
    policy = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rollout = _rollout(tiny_qwen2, count=2)
    try:
        assert rollout.sync_weights(policy) == len(list(policy.named_parameters()))
        expected = LLMEngine(tiny_qwen2, EngineConfig(device="cpu", num_kv_blocks=4))
        expected.update_weights(policy.named_parameters())
        for actual in rollout.engine_parameters():
            for name, p in expected.model.named_parameters():
                assert torch.equal(actual[name], p), name
    finally:
        rollout.close()
    assert all(not e.process.is_alive() for e in rollout.engines)


def test_an_engine_that_cannot_start_says_why(tmp_path):
    spec = EngineSpec(str(tmp_path / "missing"), ModelConfig(pretrain="x"), EngineConfig(device="cpu"),
                      AgentConfig(), False, 1)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"engine process \d+ \(cpu\) failed:(.|\n)*missing"):
        start_process_engines(spec, 1, devices=["cpu"])


def test_separate_engine_run_matches_the_colocated_run(tiny_qwen2, tmp_path):
    """A multi-turn agent (run in the engine process), a LoRA policy (adapters merged for each sync) and
    evaluation: the run with a separate engine process takes the same steps as with the local engine."""
    from tidal.cli.train_ppo import parse_run
    from tidal.trainers.ppo import run_ppo

    with (tmp_path / "prompts.jsonl").open("w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"{i % 10}+{i % 3}=", "label": str(i % 10 + i % 3)}) + "\n")
    histories = {}
    for name, extra in (("local", []), ("separate", ["--vllm_num_engines", "1"])):
        out = tmp_path / name
        histories[name] = run_ppo(parse_run([
            "--pretrain", str(tiny_qwen2), "--prompt_data", str(tmp_path / "prompts.jsonl"), "--input_key", "prompt",
            "--label_key", "label", "--agent_func_path", str(AGENT), "--eval_dataset", str(tmp_path / "prompts.jsonl"),
            "--eval_steps", "2", "--eval_n_samples_per_prompt", "2", "--advantage_estimator", "rloo",
            "--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "16",
            "--micro_train_batch_size", "8", "--generate_max_len", "4", "--prompt_max_len", "8", "--lora_rank", "4",
            "--lora_alpha", "8", "--actor_learning_rate", "5e-3", "--lr_warmup_ratio", "0", "--init_kl_coef", "0",
            "--seed", "5", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"), *extra,
        ]))  # fmt: skip
    local, separate = histories["local"], histories["separate"]
    assert len(local) == len(separate) == 2
    # a step's wall time covers its phases (generation is synchronous here)
    phases = ("generate", "make_experience", "train", "sync_weights")
    assert all(h["time/step"] >= sum(h[f"time/{p}"] for p in phases) for h in separate)
    keys = ("reward", "score", "response_length", "policy/loss", "grad_norm")
    assert_same_steps(local, separate, keys, tiny_parameter_count("qwen2"))
    metrics = [
        json.loads(line) for line in (tmp_path / "separate/final/run/metrics.jsonl").read_text().splitlines()
    ]
    assert any("eval/reward" in m for m in metrics)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_sync_from_gpu0_to_an_engine_on_gpu1(tiny_qwen2):
    """The policy on cuda:0 broadcasts (NCCL, bf16 buckets) to a bf16 engine process on cuda:1; the engine
    then holds exactly what a local bf16 engine loads from the same policy."""
    cfg = RolloutConfig(generate_max_len=4, prompt_max_len=8)
    spec = EngineSpec(str(tiny_qwen2), ModelConfig(pretrain=str(tiny_qwen2)), engine_config(cfg, "auto", 0),
                      AgentConfig(), False, 1)  # fmt: skip
    tokenizer = load_tokenizer(str(tiny_qwen2))
    engines = start_process_engines(spec, 1)  # the GPU after this process's: cuda:1
    rollout = RemoteRollout(engines, tokenizer, cfg, torch.device("cuda:0"), tokenizer.pad_token_id)
    try:
        policy = AutoModelForCausalLM.from_pretrained(tiny_qwen2).cuda()
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        rollout.sync_weights(policy)
        expected = LLMEngine(tiny_qwen2, EngineConfig(device="cuda:0", num_kv_blocks=4))
        expected.update_weights(policy.named_parameters())
        (actual,) = rollout.engine_parameters()
        for name, p in expected.model.named_parameters():
            assert torch.equal(actual[name], p.cpu()), name
    finally:
        rollout.close()
