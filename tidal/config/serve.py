"""``tidal serve``'s own flags (the model flags come from ``tidal.config.ModelConfig``).

A light module (no torch): ``tidal serve --help`` builds its parser from it without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.config.args import AT_LEAST_ONE, ConfigError, Range, arg
from tidal.config.engine import engine_config, engine_knobs
from tidal.config.model import ModelConfig
from tidal.config.rollout import ROLLOUT_QUANTIZATIONS, kv_cache_dtype_arg

if TYPE_CHECKING:
    from tidal.rollout import EngineConfig

# ModelConfig's flags that mean nothing to a server (training options); hidden from ``tidal serve``.
UNUSED_MODEL_FLAGS = (
    "attn_implementation",
    "gradient_checkpointing",
    "torch_compile",
    "gradient_checkpointing_use_reentrant",
    "aux_loss_coef",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "load_in_4bit",
)


def quantization_arg() -> str:
    """``--rollout_quantization`` (alias ``--quantization``, vLLM's name) of the commands that only sample:
    ``tidal serve``, ``tidal generate`` and ``tidal chat``. The values and the engine field are ``tidal ppo``'s
    (``RolloutConfig.rollout_quantization``); the engine refuses what it cannot quantize (exact mode, tensor
    parallelism, the families of ``tidal.rollout.quant`` that it lacks, the transformers fallback)."""
    return arg(
        "none",
        help="FP8 engine (tidal; vLLM's --quantization): the linear layers and MoE experts are quantized to "
        "FP8 e4m3 at load, with per-output-channel scales (fp8) or 128x128 block scales (fp8_block); "
        "embeddings, norms, routers, the LM head and the KV cache keep the model dtype (families native to "
        "tidal's engine; not with tensor parallelism)",
        choices=ROLLOUT_QUANTIZATIONS,
        aliases=["--quantization"],
        engine="quantization",  # tidal.rollout.quant
    )


@dataclass
class ServeConfig:
    """Server: where to listen, the model's public name, and the engine's capacity."""

    host: str = arg("127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    port: int = arg(8000, help="port to listen on (0: any free port)", check=Range(0, 65535))
    served_model_name: str | None = arg(
        None, help="model id in /v1/models and the requests' 'model' field (default: --pretrain)"
    )
    max_num_seqs: int = arg(
        256,
        help="samples the engine decodes together (continuous batching across clients)",
        check=AT_LEAST_ONE,
    )
    max_model_len: int | None = arg(
        None, help="context length: prompt + completion tokens (default: the model's max_position_embeddings)"
    )
    gpu_memory_utilization: float = arg(
        0.5,
        help="CUDA: share of free memory (after weights) for the KV cache",
        check=Range(0, 1, low_open=True),
    )
    default_max_tokens: int | None = arg(
        None,
        help="completion length when a request sets no max_tokens (default: the rest of the context, as vLLM)",
        check=AT_LEAST_ONE,
    )
    seed: int = arg(0, help="seed of the samples of requests that give no 'seed'")
    max_request_bytes: int = arg(
        16 * 1024 * 1024,
        help="largest request body in bytes; larger ones get HTTP 413 before they are read",
        check=AT_LEAST_ONE,
    )
    max_request_samples: int = arg(
        256, help="most samples (prompts × n) one request may ask for; more get HTTP 400", check=AT_LEAST_ONE
    )
    request_timeout: float = arg(
        30.0,
        help="seconds a client may take to send a request's headers, and again its body (HTTP 408)",
        check=Range(0, low_open=True),
    )
    max_images_per_request: int = arg(
        8,
        help="vision models: most image_url parts one chat request may hold; more get HTTP 400",
        check=AT_LEAST_ONE,
    )
    max_image_pixels: int = arg(
        4096 * 4096,
        help="vision models: most pixels (width × height, read before decoding) of one image; larger get HTTP 400",
        check=AT_LEAST_ONE,
    )
    rollout_quantization: str = quantization_arg()  # --quantization too
    rollout_kv_cache_dtype: str = kv_cache_dtype_arg()  # --kv_cache_dtype too

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max_model_len must be >= 2, got {self.max_model_len}")

    def engine_config(self, model: ModelConfig) -> EngineConfig:
        return engine_config(
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            seed=self.seed,
            param_dtype=model.param_dtype,
            **engine_knobs(self),  # --rollout_quantization
        )

    def model_name(self, model: ModelConfig) -> str:
        return self.served_model_name or model.pretrain

    @property
    def limits(self) -> ServeLimits:
        return ServeLimits(
            self.max_request_bytes,
            self.max_request_samples,
            self.request_timeout,
            self.max_images_per_request,
            self.max_image_pixels,
        )


@dataclass(frozen=True)
class ServeLimits:
    """What one request to ``tidal serve`` may be: its body size (413 beyond), its samples (prompts × n;
    400 beyond), the seconds its client may take to send its headers, and again its body (408), and
    (vision models) its images and each image's pixels (400 beyond)."""

    max_request_bytes: int = 16 * 1024 * 1024
    max_request_samples: int = 256
    request_timeout: float = 30.0
    max_images: int = 8
    max_image_pixels: int = 4096 * 4096
