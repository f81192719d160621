"""Separate rollout engines: weights travel by bucketed broadcast and arrive exactly; an engine
process that fails says so; a run with separate engines matches one with the colocated engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tidal.config import ModelConfig
from tidal.config.rl import RLModelsConfig, RolloutConfig
from tidal.distributed.weight_sync import plan_buckets
from tidal.models import load_tokenizer
from tidal.rollout import EngineConfig, LLMEngine
from tidal.trainers.ppo import remote_rollout
from tidal.trainers.ppo.engines import EngineSpec, engine_config, start_process_engines
from tidal.trainers.ppo.remote_rollout import RemoteRollout

REWARD = Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"


def test_plan_buckets_keeps_order_and_size():
    meta = [("a", (4, 4)), ("b", (8,)), ("c", (40,)), ("d", (2, 3))]
    plan = plan_buckets(meta, torch.float32, bucket_bytes=80)  # 64 + 32 > 80: b starts a new bucket
    assert [b.names for b in plan.buckets] == [("a",), ("b",), ("c",), ("d",)]
    plan = plan_buckets(meta, torch.bfloat16, bucket_bytes=80)  # half the bytes: a and b share one
    assert [b.names for b in plan.buckets] == [("a", "b"), ("c",), ("d",)]
    assert [b.numel for b in plan.buckets] == [24, 40, 6]


def _rollout(model_path, count: int) -> RemoteRollout:
    cfg = RolloutConfig(generate_max_len=4, prompt_max_len=8)
    models = RLModelsConfig(remote_rm_url=str(REWARD))
    spec = EngineSpec(str(model_path), ModelConfig(pretrain=str(model_path)), engine_config(cfg, "cpu", 0),
                      models, False, 1)  # fmt: skip
    tokenizer = load_tokenizer(str(model_path))
    engines = start_process_engines(spec, count, devices=["cpu"] * count)  # CPU processes, also with GPUs
    try:
        return RemoteRollout(engines, tokenizer, cfg, models, torch.device("cpu"), tokenizer.pad_token_id)
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
                      RLModelsConfig(), False, 1)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"engine process \d+ \(cpu\) failed:(.|\n)*missing"):
        start_process_engines(spec, 1, devices=["cpu"])
