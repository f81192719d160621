"""``EngineConfig``: the rollout engine's capacity, placement and features, checked when it is made; and
``family_problem``, the first feature asked for that a model family refuses (``Family.refuses``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.rollout.models.registry import FAMILIES, VISION_FAMILIES, feature_refusal

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineConfig:
    """Engine capacity and placement. ``num_kv_blocks`` unset: sized from memory (see ``kv_blocks``)."""

    max_num_seqs: int = 256  # sequences decoded together
    max_num_batched_tokens: int = 16384  # prompt tokens per prefill step (a longer prompt runs alone)
    max_model_len: int | None = None  # prompt + output; default: the model's max_position_embeddings
    block_size: int = 16  # token slots per KV block
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.5  # CUDA: fraction of the free memory (after weights) for KV
    cpu_kv_cache_gb: float = 4.0  # CPU: KV cache budget
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available
    seed: int = 0  # seeds for requests without SamplingParams.seed
    enforce_eager: bool = False  # CUDA: run decode op by op instead of replaying CUDA graphs
    attention_backend: str = "auto"  # decode and context prefill: auto (triton on CUDA), triton, torch
    # Router replay: record each token's MoE experts into ``CompletionOutput.routed_experts`` (no CUDA graphs)
    record_routing: bool = False
    # Reuse the KV blocks of cached prompt prefixes (scheduling/prefix_cache.py); vLLM's and OpenRLHF's name.
    enable_prefix_caching: bool = False
    # Prefill long prompts in chunks of at most max_num_batched_tokens, alternating with decode steps.
    enable_chunked_prefill: bool = False
    # Tensor parallelism: processes (devices) the engine spans; on CUDA the GPUs from ``device`` on.
    tp_size: int = 1
    # Sampled-token log-probs bit-identical to the trainer's exact-mode forward (tidal.rollout.batch_invariant);
    # float32 or bf16, CPU or CUDA (batch_invariant.exact_device_problem; the families: exact_problem).
    exact_logprobs: bool = False
    # Launch decode step t+1 while the device runs step t (module docstring); exact, so only speed changes.
    # Some settings keep the synchronous loop (``async_fallback``). None: on for CUDA, where the host's share
    # of a step can overlap the device's (0.5B, B=256: decode step 2.73 -> 1.86 ms, docs/benchmarks.md);
    # off on the CPU, where the host computes the step itself and there is nothing to overlap.
    async_scheduling: bool | None = None
    # FP8 rollouts (tidal.rollout.quant): "fp8" (per-output-channel scales) or "fp8_block" (128x128 block
    # scales) quantizes the linear layers and MoE experts at load and at every weight sync; "none": off.
    quantization: str = "none"
    # "fp8": the KV cache holds e4m3 rows, each with its float32 scale (runner/kv_cache.py; vLLM's name and
    # value); "auto": the model dtype.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        self._check_quantization()
        self._check_kv_cache_dtype()
        if self.exact_logprobs and self.tp_size > 1:
            raise ValueError("EngineConfig: exact_logprobs needs tp_size 1")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("EngineConfig: max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.tp_size < 1:
            raise ValueError(f"EngineConfig: tp_size must be >= 1, got {self.tp_size}")
        if (self.enable_prefix_caching or self.enable_chunked_prefill) and (
            self.record_routing or self.tp_size > 1
        ):
            raise ValueError(
                "EngineConfig: enable_prefix_caching and enable_chunked_prefill need tp_size 1 and "
                "record_routing (MoE router replay) off"
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"EngineConfig: dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(
                f"EngineConfig: attention_backend must be auto, triton or torch, got {self.attention_backend!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"EngineConfig: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    def _check_quantization(self) -> None:
        from tidal.rollout.quant.fp8 import quantization_problem

        problem = quantization_problem(self.quantization)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        if self.quantization != "none" and self.exact_logprobs:
            raise ValueError(
                "EngineConfig: exact_logprobs cannot run with FP8 rollouts: the engine's log-probs are then "
                "the FP8 policy's, never bit-equal to the trainer's"
            )
        if self.quantization != "none" and self.tp_size > 1:
            raise ValueError("EngineConfig: FP8 rollouts (quantization) need tp_size 1")

    def _check_kv_cache_dtype(self) -> None:
        from tidal.rollout.runner.kv_cache import kv_cache_dtype_problem

        problem = kv_cache_dtype_problem(self.kv_cache_dtype)
        if problem:
            raise ValueError(f"EngineConfig: {problem}")
        if self.kv_cache_dtype == "fp8" and self.exact_logprobs:
            raise ValueError(
                "EngineConfig: exact_logprobs cannot run with an FP8 KV cache: the engine's attention then "
                "reads rounded keys and values, never the trainer's"
            )
        if self.kv_cache_dtype == "fp8" and self.tp_size > 1:
            raise ValueError("EngineConfig: an FP8 KV cache (kv_cache_dtype) needs tp_size 1")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def family_problem(config: EngineConfig, model_type: str | None) -> str | None:
    """The refusal (``Family.refuses``) of the first feature ``config`` asks for that the family of
    ``model_type`` does not support (None: it supports them all)."""
    asked = {
        "tensor_parallel": config.tp_size > 1,
        "prefix_caching": config.enable_prefix_caching,
        "chunked_prefill": config.enable_chunked_prefill,
        "record_routing": config.record_routing,
        "fp8_kv_cache": config.kv_cache_dtype == "fp8",
    }
    refusals = (feature_refusal(model_type, feature) for feature, on in asked.items() if on)
    problem = next((problem for problem in refusals if problem), None)
    if (
        problem is None
        and config.quantization != "none"
        and (model_type in FAMILIES or model_type in VISION_FAMILIES)
    ):
        from tidal.rollout.quant.linear import registry_family_problem  # FP8 rollouts: before loading

        problem = registry_family_problem(model_type, config.torch_device())
    return problem
