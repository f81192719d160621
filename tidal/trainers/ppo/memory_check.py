"""``tidal ppo``'s memory check before anything loads: the run's ``memory_plan`` on this rank's device.

On CUDA the device's capacity is ``torch.cuda.get_device_properties(device).total_memory``; the
environment variable ``TIDAL_DEVICE_MEMORY_GB`` (GiB) overrides it, on any device: to plan for a GPU
that is shared with another job, and so that tests exercise the refusal on the CPU. The host's is the
memory available now (``MemAvailable``), or ``TIDAL_HOST_MEMORY_GB``. Without either
(training on the CPU) there is nothing to check. A run that cannot fit fails in one line naming the
flag(s) that would make it fit; one that fits logs its peak phase.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tidal.config import ConfigError
from tidal.config.engine import rollout_max_num_seqs
from tidal.config.placement import separate_critic, separate_engines, separate_reference
from tidal.config.ppo import PPORun
from tidal.logging import get_logger
from tidal.trainers.ppo.memory_plan import (
    GIB,
    HOST_FRACTION,
    MemoryPlan,
    MemorySettings,
    ModelShape,
    fix_for,
    plan_memory,
    size,
)

log = get_logger(__name__)

CAPACITY_ENV = "TIDAL_DEVICE_MEMORY_GB"
HOST_CAPACITY_ENV = "TIDAL_HOST_MEMORY_GB"


def model_shape(config) -> ModelShape:
    """A decoder's ``ModelShape`` from its HF config; the parameter count from the model built on the meta
    device (exact for any family, no memory used)."""
    from transformers import AutoModelForCausalLM

    from tidal.models.logprob_head import CHUNKABLE_MODEL_TYPES

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()),
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        vocab=text.vocab_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        chunkable_head=getattr(config, "model_type", None) in CHUNKABLE_MODEL_TYPES,
    )


def settings_of(run: PPORun, dp_size: int) -> MemorySettings:
    """The flags of ``run`` that move memory on a policy rank's device."""
    r, p, a, t = run.rollout, run.placement, run.algorithm, run.train
    return MemorySettings(
        micro_train_batch_size=run.train.micro_train_batch_size,
        micro_rollout_batch_size=r.micro_rollout_batch_size,
        total_len=r.total_len,
        max_num_seqs=rollout_max_num_seqs(r),
        gradient_checkpointing=run.actor.gradient_checkpointing,
        adam_offload=run.dist.adam_offload,
        lora_rank=run.actor.lora_rank,
        load_in_4bit=run.actor.load_in_4bit,
        compute_bytes=4 if run.actor.param_dtype == "fp32" else 2,
        master_bytes=2 if run.actor.master_dtype == "bf16" else 4,
        zero_stage=run.dist.zero_stage,
        dp_size=dp_size,
        engine_on_device=not separate_engines(p, r.vllm_num_engines),
        vllm_enable_sleep=r.vllm_enable_sleep,
        deepspeed_enable_sleep=p.deepspeed_enable_sleep,
        vllm_gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        fp8_kv_cache=r.rollout_kv_cache_dtype == "fp8",
        fp8_weights=r.rollout_quantization != "none",
        reference=a.needs_reference and not separate_reference(p),
        ref_offload=run.frozen.offload,
        critic=a.needs_critic and not separate_critic(p),
        ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        tp_size=run.dist.ds_tensor_parallel_size,
        ring_size=run.dist.ring_attn_size,
        train_tokens=t.train_max_tokens_per_gpu if t.use_dynamic_batch else None,
        score_tokens=(t.rollout_max_tokens_per_gpu or t.train_max_tokens_per_gpu)
        if t.use_dynamic_batch
        else None,
    )


def gib_from_env(name: str) -> float | None:
    """The bytes of a ``<name>=<GiB>`` environment variable, None when unset; one line when malformed."""
    if not (value := os.environ.get(name)):
        return None
    try:
        gb = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a number of GiB, e.g. 140") from None
    if gb <= 0:
        raise ConfigError(f"{name}={value!r}: expected a positive number of GiB")
    return gb * GIB


def host_capacity() -> float | None:
    """Bytes of host memory available now (``TIDAL_HOST_MEMORY_GB`` first; Linux's ``MemAvailable``)."""
    if (forced := gib_from_env(HOST_CAPACITY_ENV)) is not None:
        return forced
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_capacity(device: torch.device) -> float | None:
    """Bytes of memory on ``device`` (``TIDAL_DEVICE_MEMORY_GB`` first); None on the CPU without it."""
    if (forced := gib_from_env(CAPACITY_ENV)) is not None:
        return forced
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


def refusal(run: PPORun, plan: MemoryPlan, fix: list[str]) -> str:
    """The one-line error of a run that does not fit."""
    where = f"--pretrain {run.actor.pretrain}: the {plan.peak_phase} phase needs {plan.breakdown()}"
    room = f"{size(plan.usable)} usable of the device's {size(plan.capacity)}"
    if plan.fits_device:  # the host is short
        parts = " + ".join(f"{name} {size(b)}" for name, b in plan.host.items())
        where = f"--pretrain {run.actor.pretrain}: host memory needs {parts} = {size(plan.host_total)}"
        room = f"{HOST_FRACTION:.0%} of the {size(plan.host_capacity)} the host has available"
    if fix:
        return f"{where}, more than the {room}; add {' '.join(fix)} (docs/distributed.md, memory plan)"
    return (
        f"{where}, more than the {room}, even with --adam_offload, --master_dtype bf16 and LoRA: use more GPUs, a smaller model, or "
        "smaller --micro_train_batch_size / --micro_rollout_batch_size"
    )


def check_memory(run: PPORun, config, device: torch.device, dp_size: int) -> MemoryPlan | None:
    """Refuse, in one line naming the flag that would make it fit, a run whose policy device cannot hold
    it (``memory_plan``); None where there is no capacity to check against (the CPU)."""
    capacity = device_capacity(device)
    if capacity is None:
        return None
    try:
        shape = model_shape(config)
    except Exception as err:  # noqa: BLE001 - the plan is advisory: a model it cannot size still trains
        log.warning(
            "memory plan skipped: %s cannot be sized on the meta device (%s)", run.actor.pretrain, err
        )
        return None
    settings, host = settings_of(run, dp_size), host_capacity()
    plan = plan_memory(shape, settings, capacity, host)
    if not plan.fits:
        raise ConfigError(refusal(run, plan, fix_for(shape, settings, capacity, host)))
    log.info("memory plan: peak in the %s phase, %s of %s usable", plan.peak_phase, plan.breakdown(),
             size(plan.usable))  # fmt: skip
    if plan.kv_cache < plan.kv_needed:
        log.info(
            "memory plan: the engine's KV cache (%s) holds fewer than --vllm_generate_batch_size full-length "
            "sequences (%s): generation runs fewer at once",
            size(plan.kv_cache),
            size(plan.kv_needed),
        )
    return plan
