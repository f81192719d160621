"""Where exact mode runs: the model families (``exact_problem``) and the devices and dtypes
(``exact_device_problem``), as one-line reasons, None where it can.
"""

from __future__ import annotations

import torch

from tidal.rollout.models.registry import FAMILIES

# The families exact mode runs, on any device, and those it runs on CUDA: derived from each family's
# record (``registry.Family.exact``), so that a new family is one registry entry.
EXACT_MODEL_TYPES = tuple(name for name, family in FAMILIES.items() if "cpu" in family.exact)


def exact_problem(config, lora_dropout: float = 0.0, load_in_4bit: bool = False) -> str | None:
    """Why a model of this HF config (or ``DecoderArgs``) cannot run in exact mode (None: it can). LoRA
    adapters run merged (``tidal.models.exact_lora``), which dropout on their input would break."""
    model_type = getattr(config, "model_type", None)
    if model_type not in EXACT_MODEL_TYPES:
        return f"--exact_logprobs supports the {', '.join(EXACT_MODEL_TYPES)} families, not {model_type!r}"
    if getattr(config, "router_jitter_noise", 0):  # Mixtral's training-time noise on the router's input
        return "--exact_logprobs needs router_jitter_noise 0 (the engine's router has no noise)"
    if lora_dropout:
        return "--exact_logprobs runs LoRA adapters merged, which needs --lora_dropout 0"
    if load_in_4bit:  # the engine holds dequantized weights; the 4-bit matmul is not batch-invariant
        return "--exact_logprobs does not support a 4-bit base (--load_in_4bit)"
    return None


# The families measured exact on CUDA (an H200, bf16): the dense ones, and the MoE ones since their routing
# sums by halving and picks by a stable sort (``moe_route``; tests/rollout/test_exact_logprobs.py, gpu).
EXACT_CUDA_MODEL_TYPES = tuple(name for name, family in FAMILIES.items() if "cuda" in family.exact)


def exact_device_problem(
    device: torch.device, dtype: torch.dtype, model_type: str | None = None
) -> str | None:
    """Why exact mode cannot run a ``model_type`` model on ``device`` in ``dtype`` (None: it can): CPU
    float32 or bfloat16 (the torch ops: bfloat16 measured invariant as float32 is), CUDA bfloat16 or
    float32 with Triton, the ``EXACT_CUDA_MODEL_TYPES`` families."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return None
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float32):
        from tidal.accel import triton_available

        if model_type is not None and model_type not in EXACT_CUDA_MODEL_TYPES:
            return f"exact_logprobs on CUDA supports the {', '.join(EXACT_CUDA_MODEL_TYPES)} families, not {model_type!r}"
        return None if triton_available() else "exact_logprobs on CUDA needs Triton installed"
    return f"exact_logprobs runs in float32 or bfloat16 on the CPU or CUDA, not {device.type} {dtype}"
