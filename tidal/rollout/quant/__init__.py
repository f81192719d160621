"""FP8 rollouts (``--rollout_quantization``): the engine generates with FP8 (e4m3) weights while the trainer
stays in its dtype; the importance-sampling corrections absorb the gap.

``fp8.py``: the pure quantize / dequantize functions and the scale granularities (per output channel,
128 x 128 blocks). ``linear.py``: ``quantize_model``, which quantizes an engine model's linear layers and
MoE experts in place, re-quantizes them after every weight load, and gives the linear layers their FP8
forward (W8A8 FP8 GEMMs on CUDA, the FP8-rounded weights emulated elsewhere); ``gemm.py`` is that
forward's product (``fp8_linear``). ``triton_fp8.py`` quantizes the activations (where the norm or SiLU·up
kernel before a layer has not already: ``RMSNorm.feeds_fp8``); ``triton_fp8_gemm.py`` is the decode GEMM,
``fp8_gemm_config.py`` picks it or ``torch._scaled_mm`` and its launch (from ``fp8_gemm_tuned.py``,
measured on a GPU).
"""

from tidal.rollout.quant.fp8 import GRANULARITIES, QUANTIZATIONS, quantization_problem
from tidal.rollout.quant.linear import Fp8State, quantize_model

__all__ = ["GRANULARITIES", "QUANTIZATIONS", "Fp8State", "quantization_problem", "quantize_model"]
