"""Flags → ``EngineConfig``: the one mapping from a command's settings to tidal's rollout engine.

``tidal ppo`` (its local and separate engines), ``tidal generate`` and ``tidal chat`` all build
their engine settings with ``engine_config``; each command only names which of its flags give the
batch size, context length and memory share (``rollout_engine_config`` for RL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.config.args import ConfigError

if TYPE_CHECKING:  # annotations only: the parsers of tidal generate/chat import this module for --help,
    # and tidal.rollout (torch) and tidal.config.rl (tidal.algorithms, torch) load only when a command runs
    from tidal.config.rl import RolloutConfig
    from tidal.rollout import EngineConfig

# --param_dtype values → the engine's dtype names ("auto": bfloat16 on CUDA, float32 on CPU)
ENGINE_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# RL's rollout engine runs "auto" whatever the trainer's --param_dtype (see ``rollout_engine_config``).
ROLLOUT_PARAM_DTYPE = "auto"

# OpenRLHF's vLLM default batch when --vllm_generate_batch_size is unset
DEFAULT_MAX_NUM_SEQS = 256


def engine_config(
    *,
    max_num_seqs: int,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    seed: int,
    param_dtype: str = "auto",
    device: str = "auto",
    enforce_eager: bool = False,
    tp_size: int = 1,
    record_routing: bool = False,
    enable_prefix_caching: bool = False,
    exact_logprobs: bool = False,
) -> EngineConfig:
    """The engine's settings; ``param_dtype`` is a ``--param_dtype`` value (``ENGINE_DTYPES``).

    Engine-side rejections (``EngineConfig``'s ``ValueError``) become one-line ``ConfigError``s."""
    from tidal.rollout import EngineConfig  # torch: only when an engine is configured, not for --help

    try:
        return EngineConfig(
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=ENGINE_DTYPES[param_dtype],
            device=str(device),
            seed=seed,
            enforce_eager=enforce_eager,
            record_routing=record_routing,
            tp_size=tp_size,
            enable_prefix_caching=enable_prefix_caching,
            exact_logprobs=exact_logprobs,
        )
    except ValueError as err:
        raise ConfigError(str(err).replace("EngineConfig: ", "")) from err


def rollout_engine_config(cfg: RolloutConfig, device: str, seed: int) -> EngineConfig:
    """RL's engine (local and separate engines alike) from the seed's ``--vllm_*`` flags.

    The dtype rule: the rollout engine always runs ``auto`` — bfloat16 on CUDA, float32 on CPU —
    whatever the trainer's ``--param_dtype``. On CUDA this is what OpenRLHF does (its vLLM engines run
    bf16 whatever the trainer's dtype; importance-sampling correction covers the mismatch). On CPU the
    engine stays float32 so rollout log-probs match the float32 trainer's. ``tidal generate``/``chat``
    have no trainer, so their ``--param_dtype`` sets the engine's dtype directly.
    """
    return engine_config(
        max_num_seqs=cfg.vllm_generate_batch_size or DEFAULT_MAX_NUM_SEQS,
        max_model_len=cfg.total_len,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        seed=seed,
        param_dtype=ROLLOUT_PARAM_DTYPE,
        device=device,
        enforce_eager=cfg.enforce_eager,
        record_routing=cfg.moe_router_replay,  # the experts the trainer replays
        tp_size=cfg.vllm_tensor_parallel_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        exact_logprobs=cfg.exact_logprobs,  # the policy's forward runs the same ops (PPOTrainer)
    )
