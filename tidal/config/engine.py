"""Flags → ``EngineConfig``: the one mapping from a command's settings to tidal's rollout engine.

``tidal ppo`` (its local and separate engines), ``tidal generate``, ``tidal chat`` and ``tidal serve``
all build their engine settings with ``engine_config``; each command only names which of its flags give
the batch size, context length and memory share (``rollout_engine_config`` for RL).

Every other engine knob is declared once, on the flag's field: ``arg(..., engine="<EngineConfig
field>")`` (``RolloutConfig.enforce_eager``, ``moe_router_replay`` → ``record_routing``, ...).
``engine_knobs`` reads those fields and ``engine_config`` passes them through to ``EngineConfig``
unlisted, so a new knob is that one field (and the engine's own ``EngineConfig`` field).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from tidal.config.args import ConfigError

if TYPE_CHECKING:  # annotations only: the parsers of tidal generate/chat import this module for --help,
    # and tidal.rollout (torch) and tidal.config.rl (tidal.algorithms, torch) load only when a command runs
    from tidal.config.rl import RolloutConfig
    from tidal.rollout import EngineConfig

# --param_dtype values → the engine's dtype names ("auto": bfloat16 on CUDA, float32 on CPU)
ENGINE_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# RL's rollout engine runs "auto" whatever the trainer's --param_dtype (see ``rollout_engine_config``).
ROLLOUT_PARAM_DTYPE = "auto"

# The most sequences RL's engine decodes together. OpenRLHF passes no max_num_seqs to its vLLM engines (vLLM's
# own default applies) and its --vllm_generate_batch_size is only the prompts of a generation call, so no
# rollout flag sets this (before issue #35 --vllm_generate_batch_size did).
DEFAULT_MAX_NUM_SEQS = 256


def engine_config(
    *,
    max_num_seqs: int,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    seed: int,
    param_dtype: str = "auto",
    device: str = "auto",
    **knobs: Any,
) -> EngineConfig:
    """The engine's settings; ``param_dtype`` is a ``--param_dtype`` value (``ENGINE_DTYPES``);
    ``knobs``: other ``EngineConfig`` fields by name (``engine_knobs`` of a config, or a command's own).

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
            **knobs,
        )
    except ValueError as err:
        raise ConfigError(str(err).replace("EngineConfig: ", "")) from err


def engine_knobs(cfg: Any) -> dict[str, Any]:
    """``{EngineConfig field: value}`` of the config's fields declared with ``arg(..., engine=<field>)``."""
    return {
        f.metadata["engine"]: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if "engine" in f.metadata
    }


def rollout_engine_config(cfg: RolloutConfig, device: str, seed: int) -> EngineConfig:
    """RL's engine (local and separate engines alike) from the seed's ``--vllm_*`` flags.

    The dtype rule: the rollout engine always runs ``auto`` — bfloat16 on CUDA, float32 on CPU —
    whatever the trainer's ``--param_dtype``. On CUDA this is what OpenRLHF does (its vLLM engines run
    bf16 whatever the trainer's dtype; importance-sampling correction covers the mismatch). On CPU the
    engine stays float32 so rollout log-probs match the float32 trainer's. ``tidal generate``/``chat``
    have no trainer, so their ``--param_dtype`` sets the engine's dtype directly.
    """
    return engine_config(
        max_num_seqs=rollout_max_num_seqs(cfg),
        max_model_len=cfg.total_len,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        seed=seed,
        param_dtype=ROLLOUT_PARAM_DTYPE,
        device=device,
        **engine_knobs(cfg),  # --enforce_eager, --moe_router_replay, --exact_logprobs, ...
    )


def rollout_max_num_seqs(cfg: RolloutConfig) -> int:
    """The most sequences RL's engine decodes together: ``DEFAULT_MAX_NUM_SEQS``, or one prompt's samples
    (training's or evaluation's) when more, since the engine schedules a prompt's samples together."""
    return max(DEFAULT_MAX_NUM_SEQS, cfg.n_samples_per_prompt, cfg.eval_n_samples_per_prompt)
