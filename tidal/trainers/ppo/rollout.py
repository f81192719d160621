"""Rollout in local mode: the engine generates, agents act, rewards score, weights sync back.

``LocalRollout`` owns tidal's ``LLMEngine`` on the trainer's device (the hybrid engine: it sleeps
while the trainer trains when ``--vllm_enable_sleep`` is set) and the agent executor. It turns a
batch of prompts into an ``Experience`` with scalar rewards. Distributed modes provide the same
two methods, ``generate`` and ``sync_weights``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from tidal.agents import AgentExecutorBase, SingleTurnAgentExecutor, Trajectory, load_agent_executor
from tidal.config.rl import RLModelsConfig, RolloutConfig
from tidal.data.prompts import PromptSample
from tidal.distributed.weight_sync import engine_weights
from tidal.experience.experience import Experience
from tidal.experience.maker import from_trajectories
from tidal.rewards import RewardResult, load_reward_source
from tidal.rollout import EngineConfig, LLMEngine, SamplingParams


def build_executor(models: RLModelsConfig, apply_chat_template: bool) -> AgentExecutorBase:
    executor = (
        load_agent_executor(models.agent_func_path) if models.agent_func_path else SingleTurnAgentExecutor()
    )
    # Chat-rendered prompts already carry the template's special tokens (see tidal.data.templates).
    executor.add_special_tokens = not apply_chat_template
    return executor


def check_sync_flags(cfg: RolloutConfig, device: torch.device) -> None:
    """Weights reach the engines over the training process group; other transports do not exist here."""
    from tidal.config.args import ConfigError

    if cfg.vllm_sync_with_ray:
        raise ConfigError(
            "--vllm_sync_with_ray: tidal's engines sit with the policy ranks; weights are copied in process"
        )
    if device.type == "cuda" and cfg.vllm_sync_backend == "gloo":
        raise ConfigError(
            "--vllm_sync_backend gloo: on CUDA weights are gathered over the NCCL training group"
        )


class LocalRollout:
    """Generation and scoring on the trainer's own device."""

    def __init__(
        self,
        model_path: str,
        tokenizer,
        cfg: RolloutConfig,
        models: RLModelsConfig,
        device: torch.device,
        pad_id: int,
        apply_chat_template: bool,
        seed: int,
        reward_models=None,
    ):
        check_sync_flags(cfg, device)
        engine_cfg = EngineConfig(
            max_num_seqs=cfg.vllm_generate_batch_size or 256,
            max_model_len=cfg.total_len,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            device=str(device),
            seed=seed,
            enforce_eager=cfg.enforce_eager,
        )
        self.engine = LLMEngine(model_path, engine_cfg)
        self.lock = threading.Lock()  # generation (maybe on a background thread) and weight sync take turns
        self.cfg, self.tokenizer, self.pad_id = cfg, tokenizer, pad_id
        self.executor = build_executor(models, apply_chat_template)
        self.reward_source = load_reward_source(models.remote_rm_url) if models.remote_rm_url else None
        self.reward_models = reward_models
        if not (models.agent_func_path or self.reward_source or reward_models):
            from tidal.config.args import ConfigError

            raise ConfigError(
                "RL needs rewards: pass --remote_rm_url, --reward_pretrain or --agent_func_path"
            )

    def sampling_params(self, n: int, temperature: float, seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(n=n, temperature=temperature, top_p=c.top_p, top_k=c.top_k,
                              max_new_tokens=c.generate_max_len, seed=seed)  # fmt: skip

    def generate(
        self, prompts: Sequence[PromptSample], n: int, temperature: float, seed: int, first_index: int = 0
    ):
        """Trajectories (prompt-major) and their Experience with rewards, scores and reward logs.

        ``first_index``: where ``prompts`` start in the whole rollout (a data-parallel share); sample
        seeds follow the global index. Passed on only when set, for executors overriding ``run``."""
        params = self.sampling_params(n, temperature, seed)
        offset = {"first_index": first_index} if first_index else {}
        with self.lock:
            if self.engine.is_sleeping:
                self.engine.wake_up()
            trajectories = self.executor.run(
                self.engine, self.tokenizer, [p.prompt for p in prompts], [p.label for p in prompts], params,
                self.cfg.total_len, **offset,
            )  # fmt: skip
        exp = from_trajectories(trajectories, self.pad_id)
        result = self.score(trajectories, exp, n, prompts)
        exp.rewards, exp.scores = result.rewards.float(), result.scores.float()
        return trajectories, exp, result.extra_logs

    def score(self, trajectories: list[Trajectory], exp: Experience, n: int, prompts) -> RewardResult:
        if all(t.reward is not None for t in trajectories):  # agents already rewarded every sample
            return RewardResult(rewards=exp.rewards, scores=exp.scores)
        if self.reward_models is not None:
            return self.reward_models(exp)
        queries = [t.prompt + t.response_text for t in trajectories]
        labels = [p.label for p in prompts for _ in range(n)]
        return self.reward_source(queries, [t.prompt for t in trajectories], labels)

    def sync_weights(self, policy: nn.Module) -> int:
        """Copy the policy's weights into the engine (in place, same device)."""
        with self.lock, engine_weights(policy) as named:
            return self.engine.update_weights(named)

    def sleep(self) -> None:
        with self.lock:
            self.engine.sleep()
