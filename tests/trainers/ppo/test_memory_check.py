"""``tidal ppo`` refuses, before anything loads, a run its device cannot hold: one line naming the flag that
makes it fit, on a make-believe device (``TIDAL_DEVICE_MEMORY_GB``) sized between the run's peak with and
without that flag."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import AutoConfig

from tidal.cli.train_ppo import main as ppo_main
from tidal.cli.train_ppo import parse_run
from tidal.trainers.ppo.memory_check import (
    CAPACITY_ENV,
    HOST_CAPACITY_ENV,
    device_capacity,
    model_shape,
    settings_of,
)
from tidal.trainers.ppo.memory_plan import GIB, plan_memory


@pytest.fixture
def flags(tiny_qwen2, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}>", "label": str(i)}) + "\n" for i in range(8)))
    reward = tmp_path / "reward.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                      "    return {'rewards': torch.zeros(len(queries))}\n")  # fmt: skip
    return [
        "--pretrain", str(tiny_qwen2), "--prompt_data", str(prompts), "--input_key", "prompt",
        "--remote_rm_url", str(reward), "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
        "--train_batch_size", "8", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8",
        "--generate_max_len", "4", "--prompt_max_len", "8", "--init_kl_coef", "0",
        "--save_path", str(tmp_path / "out"), "--gradient_checkpointing",
    ]  # fmt: skip


def test_tiny_qwen2_shape_counts_its_parameters(tiny_qwen2):
    from transformers import AutoModelForCausalLM

    shape = model_shape(AutoConfig.from_pretrained(tiny_qwen2))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.tied_embeddings and shape.compute_params == shape.params  # the tied head is cast too


def test_the_rollout_fp8_flags_reach_the_plan(flags):
    """--rollout_quantization and --rollout_kv_cache_dtype set the plan's engine weights and KV bytes."""
    assert not settings_of(parse_run(flags), dp_size=1).fp8_weights
    for quantization in ("fp8", "fp8_block"):
        run = parse_run([*flags, "--rollout_quantization", quantization, "--rollout_kv_cache_dtype", "fp8"])
        settings = settings_of(run, dp_size=1)
        assert settings.fp8_weights and settings.fp8_kv_cache


def test_a_run_that_does_not_fit_names_the_flag(flags, tiny_qwen2, monkeypatch, capsys):
    shape = model_shape(AutoConfig.from_pretrained(tiny_qwen2))
    settings = settings_of(parse_run(flags), dp_size=1)
    without = plan_memory(shape, settings, 2 * GIB).peak
    offloaded = plan_memory(shape, dataclasses.replace(settings, adam_offload=True), 2 * GIB).peak
    assert offloaded < without
    # a device whose 95% holds the run with --adam_offload and not without it
    capacity = (without + offloaded) / 2 / 0.95
    monkeypatch.setenv(CAPACITY_ENV, str(capacity / GIB))
    monkeypatch.setenv(HOST_CAPACITY_ENV, "1000")  # the host is not what this test is about
    with pytest.raises(SystemExit) as exc:
        ppo_main(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the train phase needs fp32 weights" in err[0], err
    assert err[0].endswith("add --adam_offload (docs/distributed.md, memory plan)"), err


def test_the_capacity_variable_is_checked(monkeypatch):
    import torch

    monkeypatch.setenv(CAPACITY_ENV, "lots")
    with pytest.raises(ValueError, match=f"{CAPACITY_ENV}='lots': expected a number of GiB"):
        device_capacity(torch.device("cpu"))
    monkeypatch.delenv(CAPACITY_ENV)
    assert device_capacity(torch.device("cpu")) is None  # on the CPU there is nothing to check


def test_a_short_host_is_named_in_the_refusal():
    from types import SimpleNamespace

    from tidal.trainers.ppo.memory_check import refusal
    from tidal.trainers.ppo.memory_plan import MemorySettings, ModelShape, fix_for

    # Qwen2.5-7B on an H200 with the flags and --adam_offload (tests/trainers/ppo/test_memory_plan.py)
    QWEN_7B = ModelShape(7_615_616_512, 28, 3584, 152064, 28, 4, 128, 18944)
    H200 = 143771 * 2**20
    offloaded = MemorySettings(8, 256, 320, 256, gradient_checkpointing=True, adam_offload=True,
                               vllm_enable_sleep=True, deepspeed_enable_sleep=True)  # fmt: skip
    plan = plan_memory(QWEN_7B, offloaded, H200, 125 * GIB)
    run = SimpleNamespace(actor=SimpleNamespace(pretrain="qwen7b"))
    line = refusal(run, plan, fix_for(QWEN_7B, offloaded, H200, 125 * GIB))
    assert line == (
        "--pretrain qwen7b: host memory needs host fp32 weights 28.4 GiB + host fp32 grads 28.4 GiB + host AdamW "
        "states 56.7 GiB = 113.5 GiB, more than the 90% of the 125.0 GiB the host has available; add "
        "--master_dtype bf16 (docs/distributed.md, memory plan)"
    )


def test_a_model_the_plan_cannot_size_still_trains(flags, monkeypatch, caplog):
    import logging

    import torch

    from tidal.trainers.ppo import memory_check

    def unsized(config):
        raise ValueError("unrecognized configuration class")

    monkeypatch.setattr(memory_check, "model_shape", unsized)
    monkeypatch.setenv(CAPACITY_ENV, "1")
    caplog.set_level(logging.WARNING)
    assert memory_check.check_memory(parse_run(flags), None, torch.device("cpu"), 1) is None
    assert "memory plan skipped: " in caplog.text and "unrecognized configuration class" in caplog.text
