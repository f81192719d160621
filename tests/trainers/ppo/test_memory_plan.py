"""The RL memory plan (``tidal.trainers.ppo.memory_plan``) against hand-computed bytes for Qwen2.5-7B on one
H200, the flag it names when a run does not fit, and ``tidal ppo``'s one-line refusal on a make-believe
device (``TIDAL_DEVICE_MEMORY_GB``)."""

from __future__ import annotations

import dataclasses

import pytest

from tidal.trainers.ppo.memory_plan import GIB, MemorySettings, ModelShape, fix_for, plan_memory

# Qwen2.5-7B: per layer q/o 3584², k/v 3584x512 with q/k/v biases, MLP 3 x 3584 x 18944, two norms;
# untied 152064 x 3584 embedding and head; the final norm: 7,615,616,512 parameters.
LAYER = 2 * 3584 * 3584 + 2 * 3584 * 512 + (3584 + 2 * 512) + 3 * 3584 * 18944 + 2 * 3584
P = 28 * LAYER + 2 * 152064 * 3584 + 3584
QWEN_7B = ModelShape(
    params=P, layers=28, hidden=3584, vocab=152064, heads=28, kv_heads=4, head_dim=128, intermediate=18944
)
H200 = 143771 * 2**20  # what nvidia-smi reports for an H200 (141 GB, 140.4 GiB)

# The issue's run: 64-token prompts + 256 new tokens, micro-batches of 8 (train) and 256 (scoring), the
# hybrid engine sleeping, gradient checkpointing, GRPO without a reference (--init_kl_coef 0).
ISSUE = MemorySettings(
    micro_train_batch_size=8,
    micro_rollout_batch_size=256,
    total_len=320,
    max_num_seqs=256,
    gradient_checkpointing=True,
    vllm_enable_sleep=True,
    deepspeed_enable_sleep=True,
)


def test_qwen_7b_parameter_count():
    assert P == 7_615_616_512


def test_train_phase_of_the_issue_run_by_hand():
    plan = plan_memory(QWEN_7B, ISSUE, H200)
    train = plan.phases["train"]
    assert train["fp32 weights"] == 4 * P and train["fp32 grads"] == 4 * P and train["AdamW states"] == 8 * P
    assert train["engine bf16 weights"] == 2 * P  # the sleeping engine keeps its weights
    assert train["compute copy"] == 2 * (P - 152064 * 3584)  # autocast's bf16 casts; not the embedding
    tokens = 8 * 320
    # checkpointed layer inputs (float32) + one layer recomputed: 2(4h + 2q + 2kv + 5i) + 4h bytes a token
    assert train["activations"] == tokens * 4 * 3584 * 28 + tokens * (
        2 * (4 * 3584 + 2 * 3584 + 2 * 512 + 5 * 18944) + 4 * 3584
    )
    assert train["logits"] == 2048 * 152064 * 4 * 3  # one chunk of the LM head, float32, with gradients
    assert "KV cache" not in train  # --vllm_enable_sleep freed it
    assert plan.total("train") == pytest.approx(156_624_074_752)  # 145.9 GiB, the peak
    assert plan.peak_phase == "train"
    assert plan.usable == H200 - 3 * GIB
    assert not plan.fits


def test_kv_cache_is_what_the_sequences_fill():
    plan = plan_memory(QWEN_7B, ISSUE, H200)
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16
    assert plan.kv_needed == 256 * 320 * per_token  # 320 tokens are 20 whole blocks of 16
    assert plan.kv_cache == plan.kv_needed  # far below half the free memory
    generate = plan.phases["generate"]
    assert generate == {"engine bf16 weights": 2 * P, "KV cache": plan.kv_needed}  # the trainer sleeps
    fp8 = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, fp8_kv_cache=True), H200)
    assert fp8.kv_needed == 256 * 320 * 2 * 28 * 4 * (128 + 4)  # e4m3 elements, a float32 scale a row


def test_fp8_rollouts_count_a_byte_a_linear_weight_and_free_that_for_the_kv_cache():
    """--rollout_quantization fp8: every weight but the (untied) embedding and LM head in e4m3, as the CUDA
    engine holds them (bench/fp8_rollout.py measured 8.712 GB at Qwen2.5-7B), and the KV cache, a share of
    what is free when the engine starts, grows by half the bytes saved."""
    kept = 2 * 152064 * 3584
    fp8 = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, fp8_weights=True), H200, None)
    engine = fp8.phases["generate"]["engine FP8 weights"]
    assert engine == (P - kept) * 1 + kept * 2 and abs(engine / 1e9 - 8.712) < 0.01
    assert "engine bf16 weights" not in fp8.phases["generate"]
    saved = 2 * P - engine
    big = dataclasses.replace(ISSUE, max_num_seqs=4096)  # the cache bounded by free memory, not by sequences
    grown = plan_memory(QWEN_7B, dataclasses.replace(big, fp8_weights=True), H200).kv_cache
    assert grown - plan_memory(QWEN_7B, big, H200).kv_cache == pytest.approx(saved * 0.5)


def test_the_issue_flags_need_adam_offload_and_fit_with_it():
    assert fix_for(QWEN_7B, ISSUE, H200) == ["--adam_offload"]
    offloaded = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, adam_offload=True), H200)
    assert offloaded.fits
    assert "fp32 weights" not in offloaded.phases["train"]  # in host memory, AdamW steps there
    assert fix_for(QWEN_7B, dataclasses.replace(ISSUE, adam_offload=True), H200) == []


def test_lora_fits_without_offload():
    lora = dataclasses.replace(ISSUE, lora_rank=64)
    plan = plan_memory(QWEN_7B, lora, H200)
    assert plan.fits
    adapters = (
        64 * 28 * ((3584 + 3584) + 2 * (3584 + 512) + (3584 + 3584) + 2 * (3584 + 18944) + (18944 + 3584))
    )
    assert plan.phases["train"]["fp32 grads"] == 4 * adapters
    # the frozen base: the input embedding float32, every linear weight (the LM head too) bf16
    assert plan.phases["train"]["base weights"] == 4 * 152064 * 3584 + 2 * (P - 152064 * 3584)
    assert plan.phases["train"]["compute copy"] == 0  # stored in bf16: autocast caches no casts


def test_a_reference_needs_offload_too():
    with_ref = dataclasses.replace(ISSUE, reference=True)
    plan = plan_memory(QWEN_7B, with_ref, H200)
    assert plan.phases["train"]["reference fp32 weights"] == 4 * P
    assert fix_for(QWEN_7B, with_ref, H200) == ["--adam_offload"]  # --ref_reward_offload alone is not enough
    assert plan_memory(QWEN_7B, dataclasses.replace(with_ref, adam_offload=True), H200).fits


def test_without_gradient_checkpointing_a_long_batch_names_it():
    long = dataclasses.replace(
        ISSUE, adam_offload=True, gradient_checkpointing=False, micro_train_batch_size=16, total_len=2048
    )
    # 16 x 2048 tokens keep every layer's activations: 32768 x 248832 x 28 bytes, 212.6 GiB
    assert plan_memory(QWEN_7B, long, H200).phases["train"]["activations"] == 32768 * 248832 * 28
    assert fix_for(QWEN_7B, long, H200) == ["--gradient_checkpointing"]


def test_a_kv_cache_kept_while_training_names_vllm_enable_sleep():
    awake = dataclasses.replace(
        ISSUE, adam_offload=True, vllm_enable_sleep=False, total_len=16384, vllm_gpu_memory_utilization=0.9,
        micro_train_batch_size=1, micro_rollout_batch_size=4,
    )  # fmt: skip
    plan = plan_memory(QWEN_7B, awake, H200)
    assert plan.kv_cache < plan.kv_needed  # 0.9 of the free memory, less than 256 sequences of 16384
    assert not plan.fits and fix_for(QWEN_7B, awake, H200) == ["--vllm_enable_sleep"]


def test_nothing_fits_a_tiny_device():
    assert fix_for(QWEN_7B, ISSUE, 16 * GIB) == []


def test_zero_stages_shard_over_ranks():
    ranks = dataclasses.replace(ISSUE, dp_size=8, zero_stage=3)
    train = plan_memory(QWEN_7B, ranks, H200).phases["train"]
    assert train["fp32 weights"] == 4 * P / 8 and train["AdamW states"] == 8 * P / 8
    assert train["compute copy"] == 2 * 2 * (P - 152064 * 3584) / 28  # FSDP2 gathers a block at a time


def test_host_memory_of_offload_and_sleep():
    offloaded = dataclasses.replace(ISSUE, adam_offload=True)
    host = plan_memory(QWEN_7B, offloaded, H200, 512 * GIB).host
    assert host == {"host fp32 weights": 4 * P, "host fp32 grads": 4 * P, "host AdamW states": 8 * P}
    asleep = plan_memory(QWEN_7B, ISSUE, H200, 512 * GIB).host  # --deepspeed_enable_sleep: no grads then
    assert asleep == {"host fp32 weights (asleep)": 4 * P, "host AdamW states (asleep)": 8 * P}


def test_a_128_gib_host_cannot_take_adam_offload_so_bf16_master_is_named():
    host = 125 * GIB  # what a 128 GiB machine has available
    offloaded = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, adam_offload=True), H200, host)
    assert offloaded.fits_device and not offloaded.fits_host  # 16 P = 113.5 GiB > 90% of 125 GiB
    assert fix_for(QWEN_7B, ISSUE, H200, host) == ["--master_dtype bf16"]  # before LoRA
    fp32_compute = dataclasses.replace(ISSUE, compute_bytes=4)  # bf16 master needs bf16 compute
    assert "--master_dtype bf16" not in fix_for(QWEN_7B, fp32_compute, H200, host)
    assert fix_for(QWEN_7B, ISSUE, H200, 256 * GIB) == ["--adam_offload"]


def test_tensor_parallel_ring_and_token_budgets_shrink_what_a_rank_holds():
    base = plan_memory(QWEN_7B, ISSUE, H200).phases["train"]
    tp = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, tp_size=4), H200).phases["train"]
    assert tp["fp32 weights"] == 4 * P / 4 and tp["AdamW states"] == 8 * P / 4
    assert tp["compute copy"] == base["compute copy"] / 4
    ring = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, ring_size=2), H200).phases["train"]
    tokens = 8 * 320 // 2  # each rank holds half of every packed row
    assert ring["activations"] == tokens * 4 * 3584 * 28 + tokens * 248832
    budget = plan_memory(QWEN_7B, dataclasses.replace(ISSUE, train_tokens=1024), H200).phases["train"]
    assert budget["activations"] == 1024 * 4 * 3584 * 28 + 1024 * 248832  # --train_max_tokens_per_gpu
