"""The memory plan under ``--master_dtype bf16`` (issue #39): Qwen2.5-7B GRPO full-parameter on one H200
(140.4 GiB) with a 128 GiB host (125 GiB available) fits with bf16 master weights, gradients and moments,
and the refusal of the float32 run names the flag."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from tests.trainers.ppo.test_memory_plan import H200, ISSUE, QWEN_7B, P
from tidal.trainers.ppo.memory_check import refusal
from tidal.trainers.ppo.memory_plan import GIB, fix_for, plan_memory

HOST = 125 * GIB  # what the H200 machine's 128 GiB host has available
BF16 = dataclasses.replace(ISSUE, master_bytes=2)


def test_full_parameters_fit_with_bf16_master_by_hand():
    plan = plan_memory(QWEN_7B, BF16, H200, HOST)
    train = plan.phases["train"]
    assert train["bf16 weights"] == 2 * P and train["bf16 grads"] == 2 * P and train["AdamW states"] == 4 * P
    assert train["compute copy"] == 0  # bf16 already: autocast casts nothing
    assert plan.peak_phase == "train" and plan.total("train") < 77 * GIB  # 76.0 GiB of 137.4 usable
    # --deepspeed_enable_sleep parks weights and moments in host memory while the engine generates: 6 P
    assert plan.host == {"host bf16 weights (asleep)": 2 * P, "host AdamW states (asleep)": 4 * P}
    assert plan.fits and fix_for(QWEN_7B, BF16, H200, HOST) == []


def test_the_float32_refusal_names_bf16_master_before_lora():
    for settings in (ISSUE, dataclasses.replace(ISSUE, adam_offload=True)):  # device short, host short
        plan = plan_memory(QWEN_7B, settings, H200, HOST)
        assert not plan.fits
        fix = fix_for(QWEN_7B, settings, H200, HOST)
        assert fix == ["--master_dtype bf16"]
        line = refusal(SimpleNamespace(actor=SimpleNamespace(pretrain="qwen7b")), plan, fix)
        assert line.endswith("add --master_dtype bf16 (docs/distributed.md, memory plan)")
    # bf16 master with --adam_offload: 8 bytes a parameter in host memory, 56.7 GiB, fits the host too
    offloaded = plan_memory(QWEN_7B, dataclasses.replace(BF16, adam_offload=True), H200, HOST)
    assert offloaded.fits and offloaded.host_total == 8 * P
